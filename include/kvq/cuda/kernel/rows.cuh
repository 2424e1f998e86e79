// kvq/cuda/kernel/rows.cuh — row-wise kernels: fused quantize-append, dequantize and
// standalone rotation. One warp per item: (token, KV head), or (token, KV head, key or
// value row) for appends below kAppendSplitBelow token·heads; (row, head) for rotate; a
// row for merge_states.
//
// Bit-exactness: rows are converted with kvq::to_float, transformed by the warp
// functions of kvq/cuda/warp/rotate.cuh (same operations and order as the host), and
// quantized by the warp (quantize_row_warp: a group per segment of lanes) with the scalar
// quantizer's operations, so codes and metadata equal kvq::append_kv's bit for bit.
#pragma once

#include <cstddef>

#include "kvq/attention/softmax.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cuda/config.cuh"
#include "kvq/cuda/kernel/grid_dependency.cuh"
#include "kvq/cuda/traits/device_error.hpp"
#include "kvq/cuda/traits/geometry.hpp"
#include "kvq/cuda/traits/rotate_op.hpp"
#include "kvq/cuda/warp/rotate.cuh"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"

namespace kvq::cuda::kernel {

// Page and slot of (b, pos) with every index checked; 0 and an error bit otherwise.
struct SlotRef {
  int page = -1;
  int slot = 0;
  unsigned error = 0;
};

__device__ __forceinline__ SlotRef locate(const PageTableView& t, int num_pages, int b, int pos) {
  SlotRef r;
  if (b < 0 || b >= t.batch_size) {
    r.error = kBadBatchIndex;
  } else if (!t.seq_within_pages(b)) {
    r.error = kBadPageTable;
  } else if (pos < 0 || pos >= t.seq_len(b)) {
    r.error = kBadPosition;
  } else {
    r.page = t.page_of(b, pos);
    r.slot = pos % t.page_size;
    if (r.page < 0 || r.page >= num_pages) r.error = kBadPage;
  }
  return r;
}

// The page and row of pool slot s (pool_slot): padding (s < 0) is page −1 without an
// error, the token is skipped silently.
__device__ __forceinline__ SlotRef locate_slot(std::int64_t s, int page_size, int num_pages) {
  const PoolSlot p = pool_slot(s, page_size, num_pages);
  return {p.page, p.row, p.outside ? unsigned(kBadPage) : 0u};
}

__device__ __forceinline__ void report(unsigned* flags, unsigned bits) {
  if (flags && bits && warp::lane_id() == 0) atomicOr(flags, bits);
}

// Quantizes the [D] fp32 shared row into one packed row + metadata, bit for bit
// kvq::quantize_group's result. Lane l holds the E = D/32 elements from l·E, so a group
// is a segment of W = G/E consecutive lanes (G ≥ 16 ≥ E), and every step of the scalar
// code runs across the segment:
//   finite    a ballot; a non-finite group stores s = lo = NaN and codes 0
//   clip      the rank-k |x| (k = clip_rank), walked down from the largest key
//             |bits(x)|: each round the segment's largest key below the last one and
//             its ties, until more than G−1−k keys lie at or above it (2 rounds for
//             keys at OptR's 0.96 of 32, 11 for values at 0.92 of 128; the scalar
//             ranks all pairs, G² compares in one lane). Key 0 is a zero, whose sign
//             the scalar's index tie-break takes from the k-th zero of the group.
//   range     the scalar fold a < b ? a : b keeps the later operand on a tie, an
//             associative rule: the butterfly combines lower and upper lanes in that
//             order, so even the sign of a zero extremum is the scalar's
//   codes     the scalar's metadata and quantize_value per element, packed in the
//             lane (two lanes per byte for 2-bit codes at D 64).
template <QuantSpec S, int D>
__device__ __forceinline__ void quantize_row_warp(const float* row, std::byte* codes, std::byte* meta) {
  using Meta = MetaTraits<S.meta>;
  constexpr int E = D / 32, G = S.group, W = G / E, kLevels = S.levels();
  static_assert(G % E == 0 && W <= 32, "kvq: a group spans whole lanes of one warp");
  const int lane = warp::lane_id(), first = lane * E;
  const unsigned segment = (W == 32 ? KVQ_FULL_MASK : (1u << W) - 1u) << (lane / W * W);
  float x[E];
  bool lane_finite = true;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    x[e] = row[first + e];
    lane_finite = lane_finite && is_finite_f(x[e]);
  }
  const bool finite = (__ballot_sync(KVQ_FULL_MASK, !lane_finite) & segment) == 0;

  constexpr bool kClip = S.clips() && clip_rank(G, S.clip_permille) < G - 1;
  if constexpr (kClip) {
    constexpr int k = clip_rank(G, S.clip_permille), m = G - 1 - k;
    int key[E];
#pragma unroll
    for (int e = 0; e < E; ++e) key[e] = __float_as_int(x[e]) & 0x7fffffff;
    int threshold = 0x7fffffff, at_or_above = 0;
    bool walking = finite;
    while (__ballot_sync(KVQ_FULL_MASK, walking) != 0) {  // segments that are done idle along
      int next = -1, ties = 0;
#pragma unroll
      for (int e = 0; e < E; ++e) next = key[e] < threshold && key[e] > next ? key[e] : next;
#pragma unroll
      for (int off = W / 2; off > 0; off >>= 1) {
        const int other = __shfl_xor_sync(KVQ_FULL_MASK, next, off);
        next = other > next ? other : next;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) ties += key[e] == next;
#pragma unroll
      for (int off = W / 2; off > 0; off >>= 1) ties += __shfl_xor_sync(KVQ_FULL_MASK, ties, off);
      if (walking) {
        threshold = next;
        at_or_above += ties;
        walking = at_or_above <= m;
      }
    }
    float t = __int_as_float(threshold);
    if (finite && threshold == 0) {
      const float* group = row + first / G * G;
      for (int e = 0, zeros = 0; e < G; ++e)
        if (group[e] == 0.f && zeros++ == k) {
          t = group[e];  // ±0: the scalar's x < 0 ? −x : x keeps it
          break;
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = x[e] > t ? t : (x[e] < -t ? -t : x[e]);
  }

  float lo = x[0], hi = x[0];
#pragma unroll
  for (int e = 1; e < E; ++e) lo = fmin_f(lo, x[e]), hi = fmax_f(hi, x[e]);
#pragma unroll
  for (int off = 1; off < W; off <<= 1) {
    const float other_lo = __shfl_xor_sync(KVQ_FULL_MASK, lo, off), other_hi = __shfl_xor_sync(KVQ_FULL_MASK, hi, off);
    const bool upper = lane & off;
    lo = upper ? fmin_f(other_lo, lo) : fmin_f(lo, other_lo);
    hi = upper ? fmax_f(other_hi, hi) : fmax_f(hi, other_hi);
  }
  const float qnan = bits_float(0x7fc00000u);
  const auto s_bits = Meta::encode(finite ? div_rn(fmax_f(sub_rn(hi, lo), 1e-8f), static_cast<float>(kLevels)) : qnan);
  const auto lo_bits = Meta::encode(finite ? lo : qnan);
  const float s_stored = Meta::decode(s_bits), lo_stored = Meta::decode(lo_bits);
  const float inv = finite && s_stored != 0.f ? div_rn(1.f, s_stored) : 0.f;  // 0: codes 0, as the scalar's
  unsigned long long packed = 0;
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (inv != 0.f) packed |= static_cast<unsigned long long>(quantize_value(x[e], lo_stored, inv, kLevels)) << (e * S.bits);
  auto* out = reinterpret_cast<std::uint8_t*>(codes);
  if constexpr (E * S.bits < 8) {  // 2-bit codes at D 64: lanes 2j and 2j+1 share a byte
    static_assert(E * S.bits == 4);
    const unsigned long long upper = __shfl_xor_sync(KVQ_FULL_MASK, packed, 1);
    if (lane % 2 == 0) out[first * S.bits / 8] = static_cast<std::uint8_t>(packed | upper << 4);
  } else {
#pragma unroll
    for (int b = 0; b < E * S.bits / 8; ++b) out[first * S.bits / 8 + b] = static_cast<std::uint8_t>(packed >> (8 * b));
  }
  if (lane % W == 0) {
    auto* m = reinterpret_cast<meta_storage_t<S.meta>*>(meta) + 2 * (first / G);
    m[0] = s_bits;
    m[1] = lo_bits;
  }
  __syncwarp();
}

// Templated on the argument type, not on the Policy value: nvcc cannot spell a
// class-type non-type template argument in its host stubs.
template <class Args>
__global__ void __launch_bounds__(kRowWarpsPerBlock * 32) append_kernel(Args a, int parts) {
  constexpr Policy P = Args::kPolicy;
  constexpr int D = P.head_dim, E = D / 32;
  __shared__ float smem[kRowWarpsPerBlock][2][D];
  wait_for_prior_grids();  // the rows may come from the previous kernel
  allow_dependent_grids();
  const int w = threadIdx.x / 32;
  const int hkv = a.cache.layout.num_kv_heads;
  // Item (token i, head h[, part]): with 2 parts (append_parts) part 0 is the key row and
  // 1 the value row; with one the warp quantizes both.
  const long long item = static_cast<long long>(blockIdx.x) * kRowWarpsPerBlock + w;
  if (item >= append_items(a.num_tokens, hkv, parts)) return;
  const bool both = parts == 1;
  const bool value = !both && (item & 1);
  const long long row_item = both ? item : item >> 1;
  const int i = static_cast<int>(row_item / hkv), h = static_cast<int>(row_item % hkv);
  const std::size_t off = (std::size_t(i) * hkv + h) * D;
  float x[E];
  warp::load_row<D>((value ? a.values : a.keys) + off, x);  // in flight during the page lookup
  const SlotRef at = a.slot_mapping
                        ? locate_slot(a.slot_mapping[i], a.cache.layout.page_size, a.cache.num_pages)
                        : locate(a.table, a.cache.num_pages, a.batch_indices[i], a.positions[i]);
  if (at.error || at.page < 0) {  // out of range (reported) or padding
    report(a.error_flags, at.error);
    return;
  }
  std::byte* page = a.cache.page(at.page);
  const auto& L = a.cache.layout;
  float* row = smem[w][0];
  float* scratch = smem[w][1];
  if (!value) {
    warp::transform_key<P>(x, h, a.rotation, scratch);
    warp::to_shared<D>(row, x);
    quantize_row_warp<P.key, D>(row, L.key_codes(page, h, at.slot), L.key_meta_bytes(page, h, at.slot));
    if (!both) return;
    warp::load_row<D>(a.values + off, x);
  }
  warp::transform_value<P>(x, h, a.rotation, scratch);
  warp::to_shared<D>(row, x);
  quantize_row_warp<P.value, D>(row, L.value_codes(page, h, at.slot), L.value_meta_bytes(page, h, at.slot));
}

// x (fragment) ← dequantized packed row, exactly kvq::dequantize_row's values.
template <QuantSpec S, int D>
__device__ __forceinline__ void dequantize_fragment(const std::byte* codes, const std::byte* meta,
                                                    float (&x)[D / 32]) {
  using Meta = MetaTraits<S.meta>;
  constexpr int E = D / 32;
  const auto* m = reinterpret_cast<const meta_storage_t<S.meta>*>(meta);
  const auto* c = reinterpret_cast<const std::uint8_t*>(codes);
  const int d0 = warp::lane_id() * E;
  const int g = d0 / S.group;  // E ≤ 8 < group: a lane never straddles two groups
  const float s = Meta::decode(m[2 * g]), lo = Meta::decode(m[2 * g + 1]);
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = dequantize_value(unpack_code<S.bits>(c, d0 + k), s, lo);
}

template <class Args>
__global__ void __launch_bounds__(kRowWarpsPerBlock * 32) dequantize_kernel(Args a) {
  constexpr Policy P = Args::kPolicy;
  constexpr int D = P.head_dim, E = D / 32;
  __shared__ float smem[kRowWarpsPerBlock][D];
  wait_for_prior_grids();
  allow_dependent_grids();
  const int w = threadIdx.x / 32;
  const int hkv = a.cache.layout.num_kv_heads;
  const long long item = static_cast<long long>(blockIdx.x) * kRowWarpsPerBlock + w;
  if (item >= static_cast<long long>(a.num_tokens) * hkv) return;
  const int i = static_cast<int>(item / hkv), h = static_cast<int>(item % hkv);
  const std::size_t off = (std::size_t(i) * hkv + h) * D;
  const SlotRef at = locate(a.table, a.cache.num_pages, a.batch_indices[i], a.positions[i]);
  float x[E];
  if (at.error) {  // the row is still written (NaN), so callers never read garbage
    report(a.error_flags, at.error);
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = bits_float(0x7fc00000u);
    warp::store_row<D>(a.keys + off, x);
    warp::store_row<D>(a.values + off, x);
    return;
  }
  const std::byte* page = a.cache.page(at.page);
  const auto& L = a.cache.layout;
  dequantize_fragment<P.key, D>(L.key_codes(page, h, at.slot), L.key_meta_bytes(page, h, at.slot), x);
  warp::untransform_key<P>(x, h, a.rotation, smem[w]);
  warp::store_row<D>(a.keys + off, x);
  dequantize_fragment<P.value, D>(L.value_codes(page, h, at.slot), L.value_meta_bytes(page, h, at.slot), x);
  warp::untransform_output<P>(x, h, a.rotation, smem[w]);
  warp::store_row<D>(a.values + off, x);
}

template <class Args>
__global__ void __launch_bounds__(kRowWarpsPerBlock * 32) rotate_kernel(Args a) {
  constexpr Policy P = Args::kPolicy;
  constexpr int D = P.head_dim, E = D / 32;
  __shared__ float smem[kRowWarpsPerBlock][D];
  wait_for_prior_grids();
  allow_dependent_grids();
  const int w = threadIdx.x / 32;
  const long long item = static_cast<long long>(blockIdx.x) * kRowWarpsPerBlock + w;
  if (item >= static_cast<long long>(a.num_rows) * a.num_heads) return;
  const int head = static_cast<int>(item % a.num_heads);
  const int h = head / a.heads_per_kv_head;
  const std::size_t off = std::size_t(item) * D;
  float x[E];
  warp::load_row<D>(a.in + off, x);
  switch (a.op) {
    case RotateOp::key: warp::transform_key<P>(x, h, a.rotation, smem[w]); break;
    case RotateOp::value: warp::transform_value<P>(x, h, a.rotation, smem[w]); break;
    case RotateOp::query: warp::rotate_query<P>(x, h, a.rotation, smem[w]); break;
    case RotateOp::output: warp::untransform_output<P>(x, h, a.rotation, smem[w]); break;
  }
  warp::store_row<D>(a.out + off, x);
}

// merge_states over rows of `dim` elements: one warp per row.
template <ActivationType T>
__global__ void __launch_bounds__(kRowWarpsPerBlock * 32)
    merge_states_kernel(const T* o1, const float* lse1, const T* o2, const float* lse2, int rows, int dim, T* out,
                        float* lse_out) {
  wait_for_prior_grids();
  allow_dependent_grids();
  const long long row = static_cast<long long>(blockIdx.x) * kRowWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  float w1, w2;
  const float lse = merge_weights(lse1[row], lse2[row], w1, w2);
  const std::size_t base = std::size_t(row) * dim;
  for (int d = warp::lane_id(); d < dim; d += 32)
    out[base + d] = from_float<T>(w1 * to_float(o1[base + d]) + w2 * to_float(o2[base + d]));
  if (warp::lane_id() == 0) lse_out[row] = lse;
}

}  // namespace kvq::cuda::kernel
