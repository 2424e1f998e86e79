// kvq/attention/decode.hpp — decode attention over the paged quantized cache (CPU
// reference, DESIGN §4).
//
// For query head j (KV head h) with rotated query q' = q·R_K and quantized token t:
//   logit_t = τ·Σ_g Σ_{i∈g} q'_i·(s_{t,g}·c_{t,i} + lo_{t,g})
// which is DESIGN §4's on-code form τ·Σ_g [s·Σ q'c + lo·Σ q'] summed in another order.
// On the CPU each block of 64 tokens is dequantized, 32 tokens at a time, into fp32 tiles
// in L1 that go through the register-blocked tile products of kvq/cpu/tile.hpp, the same ones
// the fp16 baseline uses (the CUDA kernels work on the codes directly). With
// KeyScoring::int8_query the keys are instead scored on their codes with integer dot
// products against a per-group int8 query (kvq/cpu/query_int8.hpp), and with
// ValueAccumulation::int8_weights values are summed on their codes with 8-bit weights
// (kvq/cpu/value_int8.hpp). Values accumulate under an online softmax in fp32; then
// ô = acc/l, o = ô·R_Vᵀ + ν (unless rotated_output), and lse = m + ln l + τ·(q·μ_K) so
// the part merges with un-centered parts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

#include "kvq/attention/params.hpp"
#include "kvq/attention/softmax.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cpu/executor.hpp"
#include "kvq/cpu/online.hpp"
#include "kvq/cpu/query_int8.hpp"
#include "kvq/cpu/value_int8.hpp"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/transform.hpp"

namespace kvq {

// How the CPU decode scores keys.
enum class KeyScoring : std::uint8_t {
  fp32_tiles,  // keys dequantized into fp32 tiles: the reference, within 1e-5 of fp64
               // attention over K̂, V̂
  int8_query,  // integer dot products on the codes with a per-group int8 query
               // (DESIGN §9, kvq/cpu/query_int8.hpp): faster; q' is rounded to
               // 8 bits per key group
};

// How the CPU decode accumulates the softmax-weighted values.
enum class ValueAccumulation : std::uint8_t {
  fp32_tiles,    // values dequantized into fp32 tiles: the reference
  int8_weights,  // integer dot products on the codes with 8-bit weights p·s per row,
                 // value group and block (kvq/cpu/value_int8.hpp): faster with AVX-512
                 // VNNI + VBMI; each weight keeps 8 bits relative to its block's
                 // largest. Needs value_group·bits/8 a multiple of 16 bytes (every preset)
};

struct CpuDecodeOptions {
  KeyScoring key_scoring = KeyScoring::fp32_tiles;
  ValueAccumulation value_accumulation = ValueAccumulation::fp32_tiles;
};

// Whether policy P can use ValueAccumulation::int8_weights (every kvq preset can).
template <Policy P>
constexpr bool supports_int8_value_weights() {
  return detail::int8_values_supported<P.value.bits, P.value.group, P.head_dim>();
}

namespace detail {

// One packed row → fp32 ŷ = s·c + lo in slab order. Byte j of every slab belongs to
// group j / (G/per_byte), so each group is one contiguous run of bytes in every slab,
// with its scale and offset broadcast over the run.
// Returns true when every ŷ is bounded by a finite Σ_g |s|·levels + |lo| (so is finite).
template <int Bits, int G, int D, MetaType M>
KVQ_FORCE_INLINE bool dequantize_row_slabs(const std::uint8_t* KVQ_RESTRICT codes, const meta_storage_t<M>* meta,
                                           float* KVQ_RESTRICT out) {
  constexpr int per_byte = 8 / Bits, bytes = D / per_byte, group_bytes = G / per_byte;
  constexpr unsigned mask = (1u << Bits) - 1u;
  static_assert(G % per_byte == 0 && D % 4 == 0);
  float bound = 0.f;
  for (int g = 0; g < D / G; ++g) {
    const float s = MetaTraits<M>::decode(meta[2 * g]), lo = MetaTraits<M>::decode(meta[2 * g + 1]);
    bound += std::abs(s) * float(mask) + std::abs(lo);
    const std::uint8_t* group_codes = codes + g * group_bytes;
    for (int k = 0; k < per_byte; ++k) {
      float* dst = out + k * bytes + g * group_bytes;
#if KVQ_GNU_HOST
      // The widest vector (≥ 4 lanes) whose width divides the group's run of bytes.
      constexpr int W = group_bytes % kNativeFloatLanes == 0 ? kNativeFloatLanes : (group_bytes % 8 == 0 ? 8 : 4);
      if constexpr (group_bytes % W == 0) {
        // W bytes → W floats with vector extensions (vpmovzxbd + vcvtdq2ps on x86). The
        // shift runs on 16-bit words (x86 has no byte shift); the mask drops what crosses
        // from the neighbouring byte.
        using Bytes = typename GnuVec<std::uint8_t, W>::type;
        using Words = typename GnuVec<std::uint16_t, W / 2>::type;
        using Ints = typename GnuVec<std::int32_t, W>::type;  // widened in two steps: GCC
                                                               // scalarizes u8 → float
        const FloatVec<W> scale_vec = zero_vec<W>() + s, lo_vec = zero_vec<W>() + lo;
        for (int j = 0; j < group_bytes; j += W) {
          Words w;
          std::memcpy(&w, group_codes + j, sizeof w);
          w >>= k * Bits;
          Bytes b;
          std::memcpy(&b, &w, sizeof b);
          b &= std::uint8_t(mask);
          store_vec<W>(dst + j, scale_vec * __builtin_convertvector(__builtin_convertvector(b, Ints), FloatVec<W>) + lo_vec);
        }
        continue;
      }
#endif
      for (int j = 0; j < group_bytes; ++j) dst[j] = s * float((unsigned(group_codes[j]) >> (k * Bits)) & mask) + lo;
    }
  }
  return bound - bound == 0.f;
}

// Keys and values of one sequence and KV head for attend_part.
//   fp32_tiles : q is [padded_rows(rows)][D], τ·q' in the key slab order; keys are
//                dequantized into fp32 tiles
//   int8_query : q8 holds the int8 rows; keys are scored on their codes
// Values are dequantized into fp32 tiles (values), or accumulated on their codes with
// int8 weights when v8 is set (accumulate_values).
template <Policy P, KeyScoring S>
struct QuantizedTileSource {
  static constexpr int D = P.head_dim;
  static constexpr bool kInt8Values = supports_int8_value_weights<P>();
  using ValueBlock = std::conditional_t<kInt8Values, Int8ValueBlock<P.value.bits, P.value.group, D>, void>;
  const ConstPagedCacheView<P>& cache;
  const PageTableView& table;
  int batch, head, rows;
  const float* q;
  const Int8Query<P.key.bits, P.key.group, D>* q8;
  ValueBlock* v8;  // nullptr: fp32 value tiles
  PrefetchQueue next_block;  // the next block's lines, queued by prefetch_keys

  // The next block's lines are asked for between the steps of this block: after each 16
  // tokens scored with int8_query, before each 32-token key tile with fp32_tiles
  // (kScoreWeight shares per 16 tokens), and before each 16 tokens of the int8 value
  // sums' passes (one share). Until 2026-12-07 they went in two bursts (the keys after the
  // products, the values after the logits) and the cold decode's compute waited behind
  // them. A score step's share follows the key codes' bits over the values': at GQA 4 a
  // K4V2 score step takes about as long as two value steps, a K2V2 one about one (32K
  // cold on a Xeon core, weights 1 / 2 / 3: K4V2 1114–1128 / 1044–1122 / 1126–1146 µs,
  // K2V2 888–898 / 911–967 / 956–965; benchmarks/README.md, 2026-12-07).
  static constexpr int kScoreWeight = P.key.bits > P.value.bits ? P.key.bits / P.value.bits : 1;
  void logits(int t0, int n, float* tile, float (*s)[kTokensPerBlock]) {
    if constexpr (S == KeyScoring::fp32_tiles) {
      next_block.pace(kScoreWeight * ((n + 15) / 16) + value_steps(n));
      logits_from_tile<D>(q, padded_rows(rows), t0, n, tile, s, [&](int t, int count, float* out) {
        next_block.step(kScoreWeight * ((count + 15) / 16));
        for_each_key_row(t, count, [&](int j, const std::uint8_t* codes, const meta_storage_t<P.key.meta>* meta) {
          dequantize_row_slabs<P.key.bits, P.key.group, D, P.key.meta>(codes, meta, out + j * D);
        });
      });
    } else {
      const std::uint8_t* codes[kRowPointerSlots];
      const meta_storage_t<P.key.meta>* meta[kRowPointerSlots];
      int j = 0;
      table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
        const std::byte* base = cache.page(page);
        strided_rows(codes + j, reinterpret_cast<const std::uint8_t*>(cache.layout.key_codes(base, head, slot)),
                     cache.layout.kKeyCodeBytes, run);
        strided_rows(meta + j,
                     reinterpret_cast<const meta_storage_t<P.key.meta>*>(cache.layout.key_meta_bytes(base, head, slot)),
                     cache.layout.kKeyMetaBytes, run);
        j += run;
      });
      next_block.pace(kScoreWeight * ((n + 15) / 16) + value_steps(n));
      for (int j0 = 0; j0 < n; j0 += 16) {
        q8->template score_block<P.key.meta>(std::min(16, n - j0), codes + j0, meta + j0, rows, s, j0);
        next_block.step(kScoreWeight);
      }
    }
  }
  // Queues the codes and metadata of tokens t0 .. t0 + n, keys then values, after what
  // the block before left unasked (one whose softmax masked every token).
  void prefetch_keys(int t0, int n) {
    next_block.flush();
    next_block.clear();
    const auto& L = cache.layout;
    table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
      const std::byte* base = cache.page(page);
      next_block.push(L.key_codes(base, head, slot), run * L.kKeyCodeBytes);
      next_block.push(L.key_meta_bytes(base, head, slot), run * L.kKeyMetaBytes);
    });
    table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
      const std::byte* base = cache.page(page);
      next_block.push(L.value_codes(base, head, slot), run * L.kValueCodeBytes);
      next_block.push(L.value_meta_bytes(base, head, slot), run * L.kValueMetaBytes);
    });
  }
  void prefetch_values(int, int) {}  // queued with the keys
  // One line of each 4 KB OS page that holds this head's rows of tokens t0 .. t0 + n, two
  // blocks ahead (touch_os_span): the page walks happen before the next block's queued
  // prefetches need them. A page run's rows (key codes … value metadata) lie in one span.
  void touch_pages(int t0, int n) {
    const auto& L = cache.layout;
    std::uintptr_t os_page = 0;
    table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
      const std::byte* base = cache.page(page);
      touch_os_span(L.key_codes(base, head, slot), L.value_meta_bytes(base, head, slot + run - 1), os_page);
    });
  }
  // Finite metadata with |s|·levels + |lo| finite bounds every |s·c + lo|, so the rows
  // are finite without looking at them.
  bool values(int t0, int n, float* tile) {
    next_block.flush();
    bool finite = true;
    int j = 0;
    table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
      const std::byte* base = cache.page(page);
      const auto* c = reinterpret_cast<const std::uint8_t*>(cache.layout.value_codes(base, head, slot));
      const auto* m = reinterpret_cast<const meta_storage_t<P.value.meta>*>(cache.layout.value_meta_bytes(base, head, slot));
      for (int u = 0; u < run; ++u, ++j)
        finite &= dequantize_row_slabs<P.value.bits, P.value.group, D, P.value.meta>(
            c + u * cache.layout.kValueCodeBytes, m + u * 2 * (D / P.value.group), tile + j * D);
    });
    return finite;
  }
  // acc [rows_padded][D] += Σ_j p[r][j]·v̂_j on the codes (kvq/cpu/value_int8.hpp). False,
  // with acc untouched, without v8 or when the block has non-finite weights or metadata.
  bool accumulate_values(int t0, int n, const float (*p)[kTokensPerBlock], int rows_padded, float* acc) {
    if constexpr (kInt8Values) {
      if (!v8) return false;
      constexpr int kGroups = D / P.value.group;
      const std::uint8_t* codes[kRowPointerSlots];
      alignas(64) meta_storage_t<P.value.meta> raw[kTokensPerBlock][2 * kGroups] = {};
      int j = 0;
      table.for_each_page_run(batch, t0, n, [&](int page, int slot, int count) {
        const std::byte* base = cache.page(page);
        strided_rows(codes + j, reinterpret_cast<const std::uint8_t*>(cache.layout.value_codes(base, head, slot)),
                     cache.layout.kValueCodeBytes, count);
        std::memcpy(raw[j], cache.layout.value_meta_bytes(base, head, slot), count * sizeof raw[0]);
        j += count;
      });
      alignas(64) float scale[kGroups][kTokensPerBlock], lo[kGroups][kTokensPerBlock];
      decode_meta_block<P.value.meta, kGroups>(raw, scale, lo);
      if (!v8->set_weights(p, rows_padded, scale, lo)) return false;
      v8->accumulate_add(codes, n, rows_padded, acc, [this] { next_block.step(); });
      next_block.flush();
      return true;
    } else {
      return false;
    }
  }

 private:
  // The steps accumulate_values takes over a block of n tokens (next_block.step() calls).
  int value_steps(int n) const {
    if constexpr (kInt8Values) {
      if (v8) return ValueBlock::between_calls(n, padded_rows(rows));
    }
    return 0;
  }
  // fn(j, codes, meta) for the key row of token t0 + j, j < n: a page's slots are
  // contiguous rows, so one address computation per page run, not one per token.
  template <class Fn>
  KVQ_FORCE_INLINE void for_each_key_row(int t0, int n, Fn&& fn) const {
    int j = 0;
    table.for_each_page_run(batch, t0, n, [&](int page, int slot, int run) {
      const std::byte* base = cache.page(page);
      const auto* c = reinterpret_cast<const std::uint8_t*>(cache.layout.key_codes(base, head, slot));
      const auto* m = reinterpret_cast<const meta_storage_t<P.key.meta>*>(cache.layout.key_meta_bytes(base, head, slot));
      for (int u = 0; u < run; ++u, ++j) fn(j, c + u * cache.layout.kKeyCodeBytes, m + u * 2 * (D / P.key.group));
    });
  }
};

template <Policy P>
Status validate_decode(const ConstPagedCacheView<P>& cache, const PageTableView& table, const RotationParams& r) {
  using enum StatusCode;
  KVQ_CHECK_ARG(cache.pool || cache.num_pages == 0, invalid_argument, "attention: cache pool is null");
  KVQ_CHECK_ARG(table.page_size == cache.layout.page_size, invalid_argument,
                "attention: page table page_size differs from the cache layout's");
  KVQ_RETURN_IF_ERROR(validate_page_table(table, cache.num_pages));
  return validate_rotation_params<P>(r);
}

template <Policy P>
Status validate_value_accumulation(const CpuDecodeOptions& o) {
  using enum StatusCode;
  KVQ_CHECK_ARG(o.value_accumulation == ValueAccumulation::fp32_tiles ||
                    o.value_accumulation == ValueAccumulation::int8_weights,
                invalid_argument, "attention: unknown value_accumulation");
  KVQ_CHECK_ARG(o.value_accumulation != ValueAccumulation::int8_weights || supports_int8_value_weights<P>(), unsupported,
                "attention: int8 value weights need value group·bits/8 a multiple of 16 bytes");
  return {};
}

}  // namespace detail

namespace detail {

// One pass of the quantized decode: sequence b, KV head h, query rows [r0, r0 + rows)
// of that head (row r ↔ query token r / group, query head h·group + r % group), keys
// [t_begin, t_end). Calls write(rr, o, lse) per row with o [D] normalized in the output
// basis (the original one unless p.rotated_output) and lse in the original logit domain;
// a row that sees no key gets o = 0, lse = −∞.
template <Policy P, KeyScoring S, ActivationType QT, ActivationType OT, class Write>
void decode_pass(const ConstPagedCacheView<P>& cache, const PageTableView& table, const DecodeParams<QT, OT>& p,
                 const RotationParams& r, bool int8_values, int b, int h, int r0, int rows, int t_begin, int t_end,
                 Write&& write) {
  constexpr int D = P.head_dim;
  constexpr int kRows = kMaxRowsPerPass;
  const int hkv = cache.layout.num_kv_heads;
  const int hq = p.num_qo_heads, group = hq / hkv;
  const float tau = p.scale(D);
  const int q0 = p.q_indptr[b], nq = p.q_indptr[b + 1] - q0;
  const int len = table.seq_len(b);
  const int offset = p.causal_offset ? p.causal_offset[b] : len - nq;

  alignas(64) float qrot[D];
  alignas(64) float q_slabs[S == KeyScoring::fp32_tiles ? kRows * D : 1];  // τ·q' in the key slab order
  struct Unused {};
  std::conditional_t<S == KeyScoring::int8_query, Int8Query<P.key.bits, P.key.group, D>, Unused> q8;
  const Int8Query<P.key.bits, P.key.group, D>* q8_rows = nullptr;
  if constexpr (S == KeyScoring::int8_query) q8_rows = &q8;
  float shift[kRows] = {};
  int limit[kRows] = {};
  alignas(64) float acc[kRows * D];  // in the value slab order
  float m[kRows], l[kRows];
  alignas(64) float o[D];
  float scratch[D];

  if constexpr (S == KeyScoring::fp32_tiles) std::fill(q_slabs, q_slabs + padded_rows(rows) * D, 0.f);
  for (int rr = 0; rr < rows; ++rr) {
    const int i = (r0 + rr) / group, j = h * group + (r0 + rr) % group;
    const QT* src = p.q + (std::size_t(q0 + i) * hq + j) * D;
    for (int d = 0; d < D; ++d) qrot[d] = to_float(src[d]);
    shift[rr] = transform_query<P>(qrot, h, r, scratch);
    for (int d = 0; d < D; ++d) qrot[d] *= tau;
    if constexpr (S == KeyScoring::fp32_tiles) {
      for (int d = 0; d < D; ++d) q_slabs[rr * D + slab_position<P.key.bits, D>(d)] = qrot[d];
    } else {
      q8.set_row(rr, qrot);
    }
    const long long lim = static_cast<long long>(i) + offset;
    limit[rr] = lim < 0 ? -1 : static_cast<int>(std::min<long long>(lim, len - 1));
  }
  using Source = QuantizedTileSource<P, S>;
  std::conditional_t<Source::kInt8Values, typename Source::ValueBlock, Unused> v8;
  typename Source::ValueBlock* v8_block = nullptr;
  if constexpr (Source::kInt8Values)
    if (int8_values) v8_block = &v8;
  Source source{cache, table, b, h, rows, q_slabs, q8_rows, v8_block, {}};
  attend_part<D>(t_begin, t_end, rows, limit, acc, m, l, source);
  // Normalize, return to the output basis, write.
  for (int rr = 0; rr < rows; ++rr) {
    const bool empty = l[rr] == 0.f;
    const float inv_l = empty ? 0.f : 1.f / l[rr];
    constexpr int kPerByte = 8 / P.value.bits, kSlab = D / kPerByte;  // slab_position's inverse, strided
    for (int k = 0; k < kPerByte; ++k)
      for (int j = 0; j < kSlab; ++j) o[kPerByte * j + k] = acc[rr * D + k * kSlab + j] * inv_l;
    if (!empty && !p.rotated_output) untransform_output<P>(o, h, r, scratch);
    write(rr, o, empty ? neg_inf_f() : m[rr] + std::log(l[rr]) + tau * shift[rr]);
  }
}

// Writes row rr of the pass (b, h, r0) into p.out / p.lse.
template <int D, ActivationType QT, ActivationType OT>
KVQ_FORCE_INLINE void write_decode_row(const DecodeParams<QT, OT>& p, int group, int b, int h, int r0, int rr,
                                       const float* o, float lse) {
  const int i = (r0 + rr) / group, j = h * group + (r0 + rr) % group;
  const std::size_t row = std::size_t(p.q_indptr[b] + i) * p.num_qo_heads + j;
  OT* dst = p.out + row * D;
  for (int d = 0; d < D; ++d) dst[d] = from_float<OT>(o[d]);
  if (p.lse) p.lse[row] = lse;
}

template <Policy P, KeyScoring S, ActivationType QT, ActivationType OT>
void decode_quantized(const ConstPagedCacheView<P>& cache, const PageTableView& table, const DecodeParams<QT, OT>& p,
                      const RotationParams& r, bool int8_values) {
  const int hkv = cache.layout.num_kv_heads, group = p.num_qo_heads / hkv;
  for (int b = 0; b < table.batch_size; ++b) {
    const int rows_total = (p.q_indptr[b + 1] - p.q_indptr[b]) * group;
    for (int h = 0; h < hkv; ++h)
      for (int r0 = 0; r0 < rows_total; r0 += kMaxRowsPerPass)
        decode_pass<P, S>(cache, table, p, r, int8_values, b, h, r0, std::min(kMaxRowsPerPass, rows_total - r0), 0,
                          table.seq_len(b), [&](int rr, const float* o, float lse) {
                            write_decode_row<P.head_dim>(p, group, b, h, r0, rr, o, lse);
                          });
  }
}

// Split-KV bookkeeping kept in the caller's workspace: per sequence b, the first task
// and the first merge unit (unit = KV head × pass of ≤ kMaxRowsPerPass query rows; a
// unit's keys are cut into `chunks` tasks), then one (o [D], lse) slot per task row.
struct SplitLayout {
  int batch, hkv, group, chunk_tokens;
  int tasks = 0, units = 0;
  std::size_t index_bytes = 0, bytes = 0;

  template <class Params>
  SplitLayout(const PageTableView& table, const Params& p, int num_kv_heads, int d, int chunk)
      : batch(table.batch_size), hkv(num_kv_heads), group(p.num_qo_heads / num_kv_heads), chunk_tokens(chunk) {
    for (int b = 0; b < batch; ++b) {
      units += hkv * passes(p, b);
      tasks += hkv * passes(p, b) * chunks(table, b);
    }
    index_bytes = (2 * std::size_t(batch + 1) * sizeof(std::int32_t) + 63) / 64 * 64;
    bytes = index_bytes + std::size_t(tasks) * kMaxRowsPerPass * (d + 1) * sizeof(float);
  }
  template <class Params>
  int passes(const Params& p, int b) const {
    return ((p.q_indptr[b + 1] - p.q_indptr[b]) * group + kMaxRowsPerPass - 1) / kMaxRowsPerPass;
  }
  int chunks(const PageTableView& table, int b) const {
    return std::max(1, (table.seq_len(b) + chunk_tokens - 1) / chunk_tokens);
  }
};

// Where a task or a unit lives: sequence b, KV head h, first row r0, rows, chunk c.
struct SplitItem {
  int b, h, r0, rows, c;
};

template <class Params>
SplitItem locate_split_item(const SplitLayout& L, const std::int32_t* begin, int index, const PageTableView& table,
                            const Params& p, bool is_task) {
  const int b = int(std::upper_bound(begin + 1, begin + L.batch + 1, index) - (begin + 1));
  int local = index - begin[b];
  const int chunks = is_task ? L.chunks(table, b) : 1;
  const int c = local % chunks;
  local /= chunks;
  const int passes = L.passes(p, b), h = local / passes, r0 = local % passes * kMaxRowsPerPass;
  const int rows_total = (p.q_indptr[b + 1] - p.q_indptr[b]) * L.group;
  return {b, h, r0, std::min(kMaxRowsPerPass, rows_total - r0), c};
}

template <Policy P, KeyScoring S, ActivationType QT, ActivationType OT, class Exec>
void decode_quantized_split(const ConstPagedCacheView<P>& cache, const PageTableView& table,
                            const DecodeParams<QT, OT>& p, const RotationParams& r, bool int8_values,
                            const SplitLayout& L, std::byte* workspace, Exec& ex) {
  constexpr int D = P.head_dim;
  auto* task_begin = reinterpret_cast<std::int32_t*>(workspace);
  std::int32_t* unit_begin = task_begin + (L.batch + 1);
  auto* partial = reinterpret_cast<float*>(workspace + L.index_bytes);  // [tasks][kMaxRowsPerPass][D + 1]
  task_begin[0] = unit_begin[0] = 0;
  for (int b = 0; b < L.batch; ++b) {
    unit_begin[b + 1] = unit_begin[b] + L.hkv * L.passes(p, b);
    task_begin[b + 1] = task_begin[b] + L.hkv * L.passes(p, b) * L.chunks(table, b);
  }
  auto slot = [&](int task, int rr) { return partial + (std::size_t(task) * kMaxRowsPerPass + rr) * (D + 1); };
  ex(L.tasks, [&](int task) {
    const SplitItem it = locate_split_item(L, task_begin, task, table, p, true);
    const int t_begin = it.c * L.chunk_tokens, t_end = std::min(table.seq_len(it.b), t_begin + L.chunk_tokens);
    decode_pass<P, S>(cache, table, p, r, int8_values, it.b, it.h, it.r0, it.rows, t_begin, std::max(t_begin, t_end),
                      [&](int rr, const float* o, float lse) {
                        float* dst = slot(task, rr);
                        std::copy(o, o + D, dst);
                        dst[D] = lse;
                      });
  });
  // Merge each unit's chunks in chunk order: the result does not depend on the executor.
  ex(L.units, [&](int unit) {
    const SplitItem it = locate_split_item(L, unit_begin, unit, table, p, false);
    const int chunks = L.chunks(table, it.b);
    const int first = task_begin[it.b] + (unit - unit_begin[it.b]) * chunks;
    alignas(64) float o[D];
    for (int rr = 0; rr < it.rows; ++rr) {
      const float* part = slot(first, rr);
      std::copy(part, part + D, o);
      float lse = part[D];
      for (int c = 1; c < chunks; ++c) {
        part = slot(first + c, rr);
        float w_acc, w_part;
        lse = merge_weights(lse, part[D], w_acc, w_part);
        for (int d = 0; d < D; ++d) o[d] = w_acc * o[d] + w_part * part[d];
      }
      write_decode_row<D>(p, L.group, it.b, it.h, it.r0, rr, o, lse);
    }
  });
}

}  // namespace detail

// Decode attention of a ragged batch over the quantized part of its cache.
// Shapes: see DecodeParams. Writes out/lse for every query row (rows that see no key
// get o = 0, lse = −∞). A NaN group in the cache makes the rows that see it NaN.
template <Policy P, ActivationType QT, ActivationType OT>
Status decode_attention(const ConstPagedCacheView<P>& cache, const PageTableView& table,
                        const DecodeParams<QT, OT>& p, const RotationParams& r = {}, CpuDecodeOptions options = {}) {
  static_assert(check_policy<P>());
  KVQ_RETURN_IF_ERROR(detail::validate_decode(cache, table, r));
  KVQ_RETURN_IF_ERROR(validate_decode_params(p, table, cache.layout.num_kv_heads));
  KVQ_CHECK_ARG(!p.rotated_output || !P.value.centered, StatusCode::invalid_argument,
                "attention: rotated_output needs a policy without value centering");
  KVQ_RETURN_IF_ERROR(detail::validate_value_accumulation<P>(options));
  const bool int8_values = options.value_accumulation == ValueAccumulation::int8_weights;
  switch (options.key_scoring) {
    case KeyScoring::fp32_tiles:
      detail::decode_quantized<P, KeyScoring::fp32_tiles>(cache, table, p, r, int8_values);
      return {};
    case KeyScoring::int8_query:
      detail::decode_quantized<P, KeyScoring::int8_query>(cache, table, p, r, int8_values);
      return {};
  }
  return {StatusCode::invalid_argument, "attention: unknown key_scoring"};
}

// Split-KV decode on the engine's threads (kvq/cpu/executor.hpp). The keys of every
// (sequence, KV head, pass of ≤ 16 query rows) are cut into chunks of chunk_tokens; each
// chunk is one task writing (o, lse) into the workspace, then one task per pass merges
// its chunks in chunk order (merge_weights), so the result does not depend on the
// executor or the thread count. It equals decode_attention's up to that merge's
// rounding. Chunks of 1–4K keys keep the merge negligible.
struct SplitKvConfig {
  int chunk_tokens = 2048;  // keys per task: a positive multiple of 64 (detail::kTokensPerBlock)
};

// Workspace bytes decode_attention_split needs for this call's shape (host arrays:
// table and p.q_indptr are read). 0 when chunk_tokens ≤ 0 or a head count is below 1;
// other arguments decode_attention_split rejects (chunk_tokens not a multiple of
// kTokensPerBlock, num_qo_heads not a multiple of num_kv_heads) still get a size.
template <Policy P, ActivationType QT, ActivationType OT>
std::size_t split_decode_workspace_bytes(const PageTableView& table, const DecodeParams<QT, OT>& p, int num_kv_heads,
                                         SplitKvConfig split = {}) {
  if (split.chunk_tokens <= 0 || num_kv_heads < 1 || p.num_qo_heads < 1) return 0;
  return detail::SplitLayout(table, p, num_kv_heads, P.head_dim, split.chunk_tokens).bytes;
}

// workspace: ≥ split_decode_workspace_bytes(...) bytes, 64-byte aligned, owned by the
// caller (nothing is allocated). Same results and errors as decode_attention, plus
// invalid_argument for a bad chunk size or a workspace too small or misaligned.
template <Policy P, ActivationType QT, ActivationType OT, cpu::Executor Exec>
Status decode_attention_split(const ConstPagedCacheView<P>& cache, const PageTableView& table,
                              const DecodeParams<QT, OT>& p, const RotationParams& r, CpuDecodeOptions options,
                              SplitKvConfig split, std::span<std::byte> workspace, Exec&& ex) {
  static_assert(check_policy<P>());
  using enum StatusCode;
  KVQ_RETURN_IF_ERROR(detail::validate_decode(cache, table, r));
  KVQ_RETURN_IF_ERROR(validate_decode_params(p, table, cache.layout.num_kv_heads));
  KVQ_CHECK_ARG(!p.rotated_output || !P.value.centered, invalid_argument,
                "attention: rotated_output needs a policy without value centering");
  KVQ_CHECK_ARG(split.chunk_tokens > 0 && split.chunk_tokens % detail::kTokensPerBlock == 0, invalid_argument,
                "split decode: chunk_tokens must be a positive multiple of " + std::to_string(detail::kTokensPerBlock) +
                    ", got " + std::to_string(split.chunk_tokens));
  const detail::SplitLayout layout(table, p, cache.layout.num_kv_heads, P.head_dim, split.chunk_tokens);
  KVQ_CHECK_ARG(workspace.size() >= layout.bytes, invalid_argument,
                "split decode: workspace has " + std::to_string(workspace.size()) + " bytes, needs " +
                    std::to_string(layout.bytes) + " (split_decode_workspace_bytes)");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(workspace.data()) % 64 == 0, invalid_argument,
                "split decode: workspace must be 64-byte aligned");
  KVQ_RETURN_IF_ERROR(detail::validate_value_accumulation<P>(options));
  const bool int8_values = options.value_accumulation == ValueAccumulation::int8_weights;
  switch (options.key_scoring) {
    case KeyScoring::fp32_tiles:
      detail::decode_quantized_split<P, KeyScoring::fp32_tiles>(cache, table, p, r, int8_values, layout,
                                                                workspace.data(), ex);
      return {};
    case KeyScoring::int8_query:
      detail::decode_quantized_split<P, KeyScoring::int8_query>(cache, table, p, r, int8_values, layout,
                                                                workspace.data(), ex);
      return {};
  }
  return {invalid_argument, "attention: unknown key_scoring"};
}

}  // namespace kvq
