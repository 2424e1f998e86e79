// kvq/cuda/kernel/decode.cuh — split-KV decode attention over a paged cache, quantized
// (DESIGN §4) or full precision (the windows and the BF16 baseline), one design for both.
//
// Work decomposition. A CTA owns one (sequence b, KV head h, split s, row tile): all
// query rows (query tokens × the g query heads of h, up to R rows) that read the same
// codes, so every code is loaded once per GQA group. Each of the NW warps walks its own
// 32-token tiles of the split, double-buffered with cp.async into shared memory (16-byte
// chunks; 8- or 4-byte ones for metadata rows that are not whole 16-byte chunks):
//   K codes  [16-byte chunk][32 tokens]  (transposed: lane t reads token t conflict-free)
//   K meta, V codes, V meta              (token-major)
// q·k phase: lane t computes all R logits of token t directly on the codes,
//   logit = Σ_g s_g·(q'_g·c_g) + lo_g·Σq'_g, with q' pre-scaled by τ·log₂e (so the
//   softmax runs in exp2) and the per-group sums Σq'_g computed once per CTA.
// softmax: running max m (warp-uniform), per-lane partial sums l, fp32.
// p·v phase: lane (u, slice) owns VD value dims of tokens u, u+U, …; it expands
//   ŵ = s·c + lo in registers and accumulates p·ŵ for all R rows.
// The warps' states merge through shared memory; with one split the CTA normalizes,
// applies R_Vᵀ and ν (unless rotated_output) and writes o and lse; with several splits it
// writes fp32 partials, which split_merge_kernel joins (the tensor-core kernel joins them
// itself: merge_if_last_split).
//
// This is the fp32 CUDA-core kernel; it serves every policy, head_dim and cache type.
// DESIGN §9: at 2 bits with GQA it is compute-bound below the bandwidth target, hence the
// tensor-core kernel (kernel/decode_mma.cuh), which shares the pieces below.
#pragma once

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "kvq/attention/softmax.hpp"
#include "kvq/core/decode_params.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cuda/config.cuh"
#include "kvq/cuda/kernel/grid_dependency.cuh"
#include "kvq/cuda/traits/decode_smem.hpp"
#include "kvq/cuda/traits/device_error.hpp"
#include "kvq/cuda/traits/geometry.hpp"
#include "kvq/cuda/warp/copy.cuh"
#include "kvq/cuda/warp/reduce.cuh"
#include "kvq/cuda/warp/rotate.cuh"
#include "kvq/layout/dense.hpp"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/params.hpp"

namespace kvq::cuda::kernel {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Exact small integer → float without I2F: 2^23 + c has c in its low mantissa bits.
__device__ __forceinline__ float code_to_float(unsigned c) { return __uint_as_float(0x4B000000u | c) - 8388608.f; }

// Metadata decode with the hardware conversion (exact, so the same value as
// MetaTraits<M>::decode).
template <MetaType M>
__device__ __forceinline__ float meta_fast(meta_storage_t<M> s) {
  if constexpr (M == MetaType::fp16) {
    return __half2float(__ushort_as_half(s));
  } else if constexpr (M == MetaType::bf16) {
    return __uint_as_float(static_cast<unsigned>(s) << 16);
  } else {
    return s;
  }
}

// Two 16-bit values of a little-endian word → floats (exact).
template <ActivationType T>
__device__ __forceinline__ float2 pair_to_float2(unsigned w) {
  if constexpr (std::is_same_v<T, half_t>) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
  } else {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
}

template <class Word>
__device__ __forceinline__ Word load_word(const std::byte* p) {
  return *reinterpret_cast<const Word*>(p);
}

// ---- key/value sources ------------------------------------------------------------------

// Where one KV head's rows lie in every page: the page pitch and the byte offsets, from a
// page's start, of the head's K codes, K meta, V codes and V meta at slot 0 (rows follow
// at kcb, kmb, vcb, vmb bytes). Computed per tile from the kernel parameters (uniform
// values), so that a tile's four source addresses cost one multiply and four adds.
// Offsets inside a page are 32-bit: the launchers reject pages of 4 GiB or more
// (measured with ptxas: 64-bit offsets made the default `fast` kernel spill).
struct HeadRegions {
  std::size_t page_bytes = 0;
  unsigned kc = 0, km = 0, vc = 0, vm = 0;
};

// Quantized pages of policy P (kvq/layout/paged.hpp).
template <Policy P>
struct QuantSource {
  static constexpr Policy kPolicy = P;
  static constexpr int D = P.head_dim;
  using Layout = PageLayout<P>;
  static constexpr int kcb = int(Layout::kKeyCodeBytes), kmb = int(Layout::kKeyMetaBytes);
  static constexpr int vcb = int(Layout::kValueCodeBytes), vmb = int(Layout::kValueMetaBytes);
  static constexpr int GK = P.key.group, NK = D / GK;
  static_assert(kcb % 16 == 0 && vcb % 16 == 0, "kvq: packed rows are whole 16-byte chunks");

  const std::byte* pool;
  int num_pages;
  Layout layout;

  __device__ int num_kv_heads() const { return layout.num_kv_heads; }
  __device__ HeadRegions head_regions(int h) const {
    return {layout.page_bytes(), unsigned(layout.key_codes_offset(h)), unsigned(layout.key_meta_offset(h)),
            unsigned(layout.value_codes_offset(h)), unsigned(layout.value_meta_offset(h))};
  }
  __device__ const std::byte* page(int i) const { return pool + layout.page_bytes() * std::size_t(i); }
  __device__ const std::byte* k_codes(int pg, int h, int slot) const { return layout.key_codes(page(pg), h, slot); }
  __device__ const std::byte* k_meta(int pg, int h, int slot) const { return layout.key_meta_bytes(page(pg), h, slot); }
  __device__ const std::byte* v_codes(int pg, int h, int slot) const { return layout.value_codes(page(pg), h, slot); }
  __device__ const std::byte* v_meta(int pg, int h, int slot) const { return layout.value_meta_bytes(page(pg), h, slot); }

  // q ← q·R_K; returns q·μ_K (0 without key centering).
  __device__ float prepare_query(float (&x)[D / 32], int h, const RotationParams& r, float* scratch) const {
    float shift = 0.f;
    if constexpr (P.key.centered) {
      const float* mu = r.key_mean + std::size_t(h) * D + warp::lane_id() * (D / 32);
      float part = 0.f;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) part = fmaf(x[k], mu[k], part);
      shift = warp::sum(part);
    }
    warp::rotate_query<P>(x, h, r, scratch);
    return shift;
  }

  __device__ void finish(float (&x)[D / 32], int h, const RotationParams& r, float* scratch) const {
    warp::untransform_output<P>(x, h, r, scratch);
  }

  // Logits (log₂ domain) of this lane's token for R rows.
  //   kc: K codes stage [C][32] uint4; km: this token's K meta; q_s [R][D]; qsum_s [R][NK]
  template <int R>
  __device__ __forceinline__ void qk(const std::byte* kc, const std::byte* km, const float* q_s, const float* qsum_s,
                                     float (&logit)[R]) const {
    constexpr int bits = P.key.bits, CPW = 32 / bits, WPG = GK / CPW, C = kcb / 16;
    constexpr unsigned mask = (1u << bits) - 1u;
    const uint4* chunks = reinterpret_cast<const uint4*>(kc);
    const auto* meta = reinterpret_cast<const meta_storage_t<P.key.meta>*>(km);
    const int lane = warp::lane_id();
    float dot[R] = {};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint4 v = chunks[c * 32 + lane];
      const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int sub = 0; sub < 4; ++sub) {
        const int W = c * 4 + sub;
        if (W % WPG == 0) {
#pragma unroll
          for (int r = 0; r < R; ++r) dot[r] = 0.f;
        }
        float f[CPW];
#pragma unroll
        for (int k = 0; k < CPW; ++k) f[k] = code_to_float((words[sub] >> (k * bits)) & mask);
        const int d0 = W * CPW;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float4* q4 = reinterpret_cast<const float4*>(q_s + r * D + d0);
          float a = dot[r];
#pragma unroll
          for (int k4 = 0; k4 < CPW / 4; ++k4) {
            const float4 q = q4[k4];
            a = fmaf(q.x, f[4 * k4 + 0], a);
            a = fmaf(q.y, f[4 * k4 + 1], a);
            a = fmaf(q.z, f[4 * k4 + 2], a);
            a = fmaf(q.w, f[4 * k4 + 3], a);
          }
          dot[r] = a;
        }
        if (W % WPG == WPG - 1) {
          const int g = W / WPG;
          const float s = meta_fast<P.key.meta>(meta[2 * g]), lo = meta_fast<P.key.meta>(meta[2 * g + 1]);
#pragma unroll
          for (int r = 0; r < R; ++r) logit[r] = fmaf(s, dot[r], fmaf(lo, qsum_s[r * NK + g], logit[r]));
        }
      }
    }
  }

  // acc[r][k] += p[r]·ŵ[d0 + k] for one token; vrow/vmeta: the token's staged V row/meta.
  template <int R, int VD>
  __device__ __forceinline__ void pv(const std::byte* vrow, const std::byte* vmeta, int d0, const float* p,
                                     float (&acc)[R][VD]) const {
    constexpr int bits = P.value.bits, NB = VD * bits / 8;
    using Word = std::conditional_t<NB == 1, std::uint8_t,
                 std::conditional_t<NB == 2, std::uint16_t, std::conditional_t<NB == 4, std::uint32_t, std::uint64_t>>>;
    const Word w = load_word<Word>(vrow + d0 * bits / 8);
    const auto* meta = reinterpret_cast<const meta_storage_t<P.value.meta>*>(vmeta);
    const int g = d0 / P.value.group;
    const float s = meta_fast<P.value.meta>(meta[2 * g]), lo = meta_fast<P.value.meta>(meta[2 * g + 1]);
    float v[VD];
#pragma unroll
    for (int k = 0; k < VD; ++k)
      v[k] = fmaf(s, code_to_float(static_cast<unsigned>((w >> (k * bits)) & ((1u << bits) - 1u))), lo);
    float pr[R];
#pragma unroll
    for (int r4 = 0; r4 < R / 4; ++r4) {
      const float4 q = reinterpret_cast<const float4*>(p)[r4];
      pr[4 * r4] = q.x, pr[4 * r4 + 1] = q.y, pr[4 * r4 + 2] = q.z, pr[4 * r4 + 3] = q.w;
    }
    if (isfinite(s) && isfinite(lo)) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int k = 0; k < VD; ++k) acc[r][k] = fmaf(pr[r], v[k], acc[r][k]);
    } else {  // a NaN group reaches exactly the rows that give it weight (as on the host)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int k = 0; k < VD; ++k)
          if (pr[r] != 0.f) acc[r][k] += pr[r] * v[k];
    }
  }
};

// Full-precision pages (DensePageLayout<T, D> of kvq/layout/dense.hpp).
template <ActivationType T, int HeadDim>
struct DenseSource {
  static constexpr int D = HeadDim;
  using Layout = DensePageLayout<T, D>;
  static constexpr int kcb = D * int(sizeof(T)), kmb = 0, vcb = D * int(sizeof(T)), vmb = 0;
  static constexpr int GK = D, NK = 1;

  const std::byte* pool;
  int num_pages;
  Layout layout;

  __device__ int num_kv_heads() const { return layout.num_kv_heads; }
  __device__ HeadRegions head_regions(int h) const {
    const std::size_t k = 2 * layout.region_bytes() * std::size_t(h);
    return {layout.page_bytes(), unsigned(k), 0, unsigned(k + layout.region_bytes()), 0};
  }
  __device__ const std::byte* page(int i) const { return pool + layout.page_bytes() * std::size_t(i); }
  __device__ const std::byte* k_codes(int pg, int h, int slot) const {
    return reinterpret_cast<const std::byte*>(layout.key_row(page(pg), h, slot));
  }
  __device__ const std::byte* k_meta(int, int, int) const { return nullptr; }
  __device__ const std::byte* v_codes(int pg, int h, int slot) const {
    return reinterpret_cast<const std::byte*>(layout.value_row(page(pg), h, slot));
  }
  __device__ const std::byte* v_meta(int, int, int) const { return nullptr; }

  __device__ float prepare_query(float (&)[D / 32], int, const RotationParams&, float*) const { return 0.f; }
  __device__ void finish(float (&)[D / 32], int, const RotationParams&, float*) const {}

  template <int R>
  __device__ __forceinline__ void qk(const std::byte* kc, const std::byte*, const float* q_s, const float*,
                                     float (&logit)[R]) const {
    constexpr int EPC = 16 / int(sizeof(T)), C = kcb / 16;
    const uint4* chunks = reinterpret_cast<const uint4*>(kc);
    const int lane = warp::lane_id();
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint4 v = chunks[c * 32 + lane];
      float f[EPC];
      if constexpr (sizeof(T) == 2) {
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 t = pair_to_float2<T>(words[k]);
          f[2 * k] = t.x, f[2 * k + 1] = t.y;
        }
      } else {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float4* q4 = reinterpret_cast<const float4*>(q_s + r * D + c * EPC);
        float a = logit[r];
#pragma unroll
        for (int k4 = 0; k4 < EPC / 4; ++k4) {
          const float4 q = q4[k4];
          a = fmaf(q.x, f[4 * k4 + 0], a);
          a = fmaf(q.y, f[4 * k4 + 1], a);
          a = fmaf(q.z, f[4 * k4 + 2], a);
          a = fmaf(q.w, f[4 * k4 + 3], a);
        }
        logit[r] = a;
      }
    }
  }

  template <int R, int VD>
  __device__ __forceinline__ void pv(const std::byte* vrow, const std::byte*, int d0, const float* p,
                                     float (&acc)[R][VD]) const {
    float v[VD];
    if constexpr (sizeof(T) == 2) {
      const unsigned* w = reinterpret_cast<const unsigned*>(vrow + d0 * 2);
#pragma unroll
      for (int k = 0; k < VD / 2; ++k) {
        const float2 t = pair_to_float2<T>(w[k]);
        v[2 * k] = t.x, v[2 * k + 1] = t.y;
      }
    } else {
      const float* w = reinterpret_cast<const float*>(vrow + d0 * 4);
#pragma unroll
      for (int k = 0; k < VD; ++k) v[k] = w[k];
    }
    float pr[R];
#pragma unroll
    for (int r4 = 0; r4 < R / 4; ++r4) {
      const float4 q = reinterpret_cast<const float4*>(p)[r4];
      pr[4 * r4] = q.x, pr[4 * r4 + 1] = q.y, pr[4 * r4 + 2] = q.z, pr[4 * r4 + 3] = q.w;
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int k = 0; k < VD; ++k) acc[r][k] = fmaf(pr[r], v[k], acc[r][k]);
  }
};

// ---- the kernel ---------------------------------------------------------------------------

template <class Src, ActivationType QT, ActivationType OT>
struct DecodeKernelParams {
  using source_type = Src;
  using query_type = QT;
  using output_type = OT;
  Src src;
  PageTableView table;
  DecodeParams<QT, OT> p;
  RotationParams rotation;
  int num_splits;
  int row_tiles;
  int total_q;
  float tau;             // softmax scale τ
  float* partial_o;      // [S][total_q][Hq][D] when num_splits > 1
  float* partial_lse;    // [S][total_q][Hq]
  unsigned* split_counters;  // arrivals per CTA tile: the kernel merges its splits (null: a
                             // separate split_merge_kernel does)
  unsigned* error_flags;
  // Query rows per CTA (the decode kernel's R): a sequence's rows past row_tiles·tile_rows
  // per KV head are not computed (kBadQueryRows). Last: placed beside row_tiles, it moved
  // ptxas' register allocation of the CUDA-core K4V2 4-row kernel (136 → 128 registers,
  // 8 bytes spilled), which never reads it.
  int tile_rows;
};

template <class Src, int R>
struct DecodeConfig {
  static constexpr int D = Src::D;
  static constexpr int NW = decode_warps(std::size_t(Src::kcb + Src::kmb + Src::vcb + Src::vmb));
  static constexpr int VD = value_dims_per_lane(D, R);
  static constexpr int LPTV = D / VD;  // lanes per token in the p·v phase
  static constexpr int U = 32 / LPTV;  // tokens in flight per warp in the p·v phase
  static constexpr DecodeSmem smem{std::size_t(Src::kcb), std::size_t(Src::kmb), std::size_t(Src::vcb),
                                   std::size_t(Src::vmb), D, R, Src::NK, NW};
  static_assert(R % 4 == 0 && R <= max_rows_per_cta(D), "kvq: unsupported rows per CTA");
  static_assert(LPTV <= 32 && 32 % LPTV == 0, "kvq: value lanes must tile the warp");
};

// How a region's rows sit in a stage buffer (32 tokens):
//   linear     : token-major rows
//   transposed : 16-byte chunk c of token t at [c][t] (lane t reads token t conflict-free)
//   swizzled   : token-major, 16-byte chunk c of token t at chunk c ^ (t % 8) of its row,
//                so that ldmatrix over 8 tokens' rows hits 8 different bank groups
enum class StageLayout { linear, transposed, swizzled };

// The copy chunk of a region's rows in stage layout L.
template <int RowBytes, StageLayout L>
inline constexpr int kStageChunk =
    L != StageLayout::linear ? 16 : (RowBytes % 16 == 0 ? 16 : (RowBytes % 8 == 0 ? 8 : 4));

// Chunk c of token t's row in stage layout L (dst: the region's stage buffer).
template <int RowBytes, StageLayout L>
__device__ __forceinline__ std::byte* stage_chunk(std::byte* dst, int t, int c) {
  constexpr int Chunk = kStageChunk<RowBytes, L>;
  return L == StageLayout::transposed ? dst + (std::size_t(c) * 32 + t) * 16
         : L == StageLayout::swizzled ? dst + std::size_t(t) * RowBytes + (c ^ (t & 7)) * Chunk
                                      : dst + (std::size_t(t) * RowBytes + c * Chunk);
}

// Copies the RowBytes-byte rows of the tile's n tokens into shared memory. Lane t's
// (page, slot) is broadcast by shuffle; page < 0 marks a token that is skipped. With
// kZeroMissing, skipped tokens and tokens n..31 are zero-filled (16-bit values enter an
// MMA with weight 0, and 0·NaN would poison it).
template <int RowBytes, StageLayout L, bool kZeroMissing = false, class Addr>
__device__ __forceinline__ void stage_rows(std::byte* dst, int n, int my_page, int my_slot, Addr&& addr) {
  if constexpr (RowBytes > 0) {
    constexpr int Chunk = kStageChunk<RowBytes, L>;
    static_assert(RowBytes % Chunk == 0, "kvq: staged rows must be whole chunks");
    static_assert(L != StageLayout::swizzled || RowBytes % 128 == 0, "kvq: swizzled rows are whole 8-chunk groups");
    constexpr int CPT = RowBytes / Chunk;
    const int lane = warp::lane_id();
    const int items = (kZeroMissing ? kWarpTokens : n) * CPT;
    for (int base = 0; base < items; base += 32) {
      const int idx = base + lane;
      const int t = idx / CPT < 31 ? idx / CPT : 31;
      const int pg = __shfl_sync(KVQ_FULL_MASK, my_page, t);
      const int sl = __shfl_sync(KVQ_FULL_MASK, my_slot, t);
      if (idx >= items) continue;
      const int c = idx % CPT;
      std::byte* d = stage_chunk<RowBytes, L>(dst, t, c);
      if (t < n && pg >= 0) {
        warp::copy_async<Chunk>(d, addr(pg, sl) + c * Chunk);
      } else if constexpr (kZeroMissing) {
        *reinterpret_cast<uint4*>(d) = uint4{0u, 0u, 0u, 0u};
      }
    }
  }
}

// A whole tile of a region from kRuns page runs (1: 32 consecutive slots of one page;
// 2: slots 0–15 of two pages of 16), run j starting at src[j]: unrolled, every chunk at a
// fixed offset from its run's start, no bounds to test.
template <int RowBytes, StageLayout L, int kRuns = 1>
__device__ __forceinline__ void stage_full(std::byte* dst, const std::byte* const (&src)[kRuns]) {
  static_assert(kRuns == 1 || kRuns == 2, "kvq: a warp tile is one or two page runs");
  if constexpr (RowBytes > 0) {
    constexpr int Chunk = kStageChunk<RowBytes, L>, CPT = RowBytes / Chunk, kTileItems = kWarpTokens * CPT;
    constexpr int kRunItems = kTileItems / kRuns;
    const int lane = warp::lane_id();
#pragma unroll
    for (int i = 0; i < kTileItems / 32; ++i) {  // kTileItems = 32·CPT
      const int idx = lane + 32 * i;
      // The run of item idx: fixed per unrolled step when runs are whole steps of 32 items.
      const int run = kRuns == 1 ? 0 : (kRunItems % 32 == 0 ? 32 * i / kRunItems : (idx >= kRunItems ? 1 : 0));
      const std::byte* s = run == 0 ? src[0] : src[kRuns - 1];
      warp::copy_async<Chunk>(stage_chunk<RowBytes, L>(dst, idx / CPT, idx % CPT),
                              s + std::size_t(idx - run * kRunItems) * Chunk);
    }
  }
}

// stage_rows for a tile whose n tokens are consecutive slots of one page: the region is
// one contiguous run from `src` (null: the page is invalid, nothing is copied), so a
// lane's chunks need no page lookup.
template <int RowBytes, StageLayout L, bool kZeroMissing = false>
__device__ __forceinline__ void stage_run(std::byte* dst, int n, const std::byte* src) {
  if constexpr (RowBytes > 0) {
    constexpr int Chunk = kStageChunk<RowBytes, L>, CPT = RowBytes / Chunk;
    const int lane = warp::lane_id();
    const int copied = src ? n * CPT : 0, items = kZeroMissing ? kWarpTokens * CPT : copied;
    for (int idx = lane; idx < items; idx += 32) {
      std::byte* d = stage_chunk<RowBytes, L>(dst, idx / CPT, idx % CPT);
      if (idx < copied) {
        warp::copy_async<Chunk>(d, src + std::size_t(idx) * Chunk);
      } else if constexpr (kZeroMissing) {
        *reinterpret_cast<uint4*>(d) = uint4{0u, 0u, 0u, 0u};
      }
    }
  }
}

#ifndef KVQ_CUDA_HOST_EMULATION  // tests/cuda/emulator provides its own buffer
extern __shared__ uint4 kvq_decode_smem[];
#endif

// ---- pieces shared by the decode kernels ------------------------------------------------

// The query rows a CTA owns: blockIdx.x = sequence × row tile, y = KV head, z = split.
struct RowTile {
  int b = 0, h = 0, split = 0;
  int hq = 0, group = 0;  // query heads, query heads per KV head
  int q0 = 0;             // first query token of the sequence
  int r0 = 0, rows = 0;   // first row of the tile, valid rows (0: nothing to do)
  int len = 0;            // keys of the sequence
  int offset = 0;         // query token i sees keys [0, i + offset]
  const std::int32_t* pages = nullptr;  // the sequence's page indices
  int page_shift = -1;                  // log2(page_size) when a power of two, else -1
  // Pages a warp tile spans as runs of consecutive slots (tiles start at multiples of 32):
  // 1 when page_size % 32 == 0 (the tile lies in one page), 2 when page_size is 16 (vLLM's
  // default: two runs of 16), 0 otherwise (every token's page is looked up).
  int tile_pages = 0;
};

template <class KP>
__device__ __forceinline__ RowTile row_tile(const KP& a, int R) {
  RowTile t;
  t.hq = a.p.num_qo_heads;
  t.group = t.hq / a.src.num_kv_heads();
  t.b = blockIdx.x / a.row_tiles;
  t.h = blockIdx.y;
  t.split = blockIdx.z;
  t.q0 = a.p.q_indptr[t.b];
  const int q1 = a.p.q_indptr[t.b + 1];
  unsigned error = 0;
  // Tables in device memory are checked here (DeviceError): a run outside [0, total_q]
  // would read q and write out past their ends, a last_page_len past the page size reach
  // into the next sequence's pages. Every split of a tile decides alike, so the arrival
  // counts agree.
  int nq = q1 - t.q0;
  if (t.q0 < 0 || nq < 0 || q1 > a.total_q) error |= kBadQueryRows, nq = 0;
  const long long rows_total = static_cast<long long>(nq) * t.group;
  if (rows_total > static_cast<long long>(a.row_tiles) * R) error |= kBadQueryRows;
  t.r0 = (blockIdx.x % a.row_tiles) * R;
  t.rows = rows_total - t.r0 < R ? static_cast<int>(rows_total - t.r0) : R;
  if (t.rows < 0) t.rows = 0;
  const bool table_ok = a.table.seq_within_pages(t.b);
  if (!table_ok) error |= kBadPageTable;
  const int len = a.table.seq_len(t.b);
  t.len = table_ok && len > 0 ? len : 0;
  if (error && a.error_flags && threadIdx.x == 0) atomicOr(a.error_flags, error);
  t.pages = a.table.indices + a.table.indptr[t.b];
  const int ps = a.table.page_size;
  if (ps > 0 && (ps & (ps - 1)) == 0)
    for (t.page_shift = 0; (1 << t.page_shift) < ps;) ++t.page_shift;
  t.tile_pages = ps % kWarpTokens == 0 ? 1 : (ps == kWarpTokens / 2 ? 2 : 0);
  t.offset = a.p.causal_offset ? a.p.causal_offset[t.b] : t.len - nq;
  return t;
}

// The last key query token i of the tile sees (−1: none): i + offset, at most len − 1.
__device__ __forceinline__ int last_visible_key(const RowTile& t, int i) {
  const long long lim = static_cast<long long>(i) + t.offset;
  return lim < 0 ? -1 : static_cast<int>(lim < t.len - 1 ? lim : t.len - 1);
}

// Phase 1: the R query rows, q' = q·R_K·τ·log₂e into q_s [R][D], Σq' per key group into
// qsum_s [R][NK], τ·q·μ_K into shift_s [R], the last visible key into limit_s [R]
// (−1 for padding rows, which are zero).
template <class KP, int R, int NW>
__device__ __forceinline__ void prepare_rows(const KP& a, const RowTile& t, float* q_s, float* qsum_s, float* shift_s,
                                             int* limit_s) {
  using Src = typename KP::source_type;
  constexpr int D = Src::D, E = D / 32, NK = Src::NK;
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int rr = w; rr < R; rr += NW) {
    float* qrow = q_s + rr * D;
    if (rr < t.rows) {
      const int i = (t.r0 + rr) / t.group, j = t.h * t.group + (t.r0 + rr) % t.group;
      float x[E];
      warp::load_row<D>(a.p.q + (std::size_t(t.q0 + i) * t.hq + j) * D, x);
      const float shift = a.src.prepare_query(x, t.h, a.rotation, qrow);
      const float scale = a.tau * kLog2e;
      float part = 0.f;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        x[k] *= scale;
        qrow[lane * E + k] = x[k];
        part += x[k];
      }
      constexpr int LPG = Src::GK / E;  // lanes per key group
#pragma unroll
      for (int off = 1; off < LPG; off <<= 1) part += __shfl_xor_sync(KVQ_FULL_MASK, part, off);
      if (lane % LPG == 0) qsum_s[rr * NK + lane / LPG] = part;
      if (lane == 0) {
        shift_s[rr] = a.tau * shift;
        limit_s[rr] = last_visible_key(t, i);
      }
    } else {
#pragma unroll
      for (int k = 0; k < E; ++k) qrow[lane * E + k] = 0.f;
      for (int g = lane; g < NK; g += 32) qsum_s[rr * NK + g] = 0.f;
      if (lane == 0) {
        shift_s[rr] = 0.f;
        limit_s[rr] = -1;
      }
    }
  }
}

// This split's key range [tb, te), cut at the last key any row may see: the tile's last
// query token's (last_visible_key grows with i), known before the rows are prepared.
__device__ __forceinline__ void split_range(const RowTile& t, int num_splits, int& tb, int& te) {
  const int max_limit = t.rows > 0 ? last_visible_key(t, (t.r0 + t.rows - 1) / t.group) : -1;
  tb = split_begin(t.len, num_splits, t.split);
  te = split_end(t.len, num_splits, t.split);
  te = te < max_limit + 1 ? te : max_limit + 1;
}

// Index into t.pages of the page that holds token `tok`.
__device__ __forceinline__ int page_slot_index(const RowTile& t, int page_size, int tok) {
  return t.page_shift >= 0 ? tok >> t.page_shift : tok / page_size;
}

// The page of each tile a warp issues (its first page when tile_pages is 2), read from the
// page table one issue ahead, so that a tile's copies never wait for that load
// (tile_pages > 0 only; -1 otherwise). The warp issues tiles t_first, t_first + step, …
// in order (warp::StageRing). One page ahead, not two: a second live register in the
// token loop cost the tensor-core kernel ~10 instructions per tile in rematerialized
// addresses (static SASS, 2026-12-07), so a tile's second page of 16 is read at issue,
// from the line that the first page's read one tile ahead brought in (unless the pair
// straddles a 128-byte line).
struct PageAhead {
  int next = -1;
  template <class KP>
  __device__ __forceinline__ void start(const KP& a, const RowTile& t, int t_first, int te) {
    next = t.tile_pages > 0 && t_first < te ? t.pages[page_slot_index(t, a.table.page_size, t_first)] : -1;
  }
  // The page of tile t_begin (the one after the last taken); loads the next one's.
  template <class KP>
  __device__ __forceinline__ int take(const KP& a, const RowTile& t, int t_begin, int step, int te) {
    const int pg = next;
    const int t_after = t_begin + step;
    if (t.tile_pages > 0 && t_after < te) next = t.pages[page_slot_index(t, a.table.page_size, t_after)];
    return pg;
  }
};

// Issues the copies of the warp tile [t0, min(t0 + 32, te)) into stage buffer `st`;
// returns the mask of loadable tokens (a page index outside the pool is skipped and
// flagged). Codes are staged in layout KL (keys) and VL (values), metadata linearly.
// pg: the tile's page (PageAhead; with pages of 16 its first) when t.tile_pages > 0;
// ignored otherwise, where every token's page is looked up.
template <class KP, StageLayout KL = StageLayout::transposed, StageLayout VL = StageLayout::linear,
          bool kZeroMissingValues = false>
__device__ __forceinline__ unsigned issue_tile(const KP& a, const DecodeSmem& S, const RowTile& t, std::byte* st, int t0,
                                               int te, int pg) {
  using Src = typename KP::source_type;
  constexpr auto lin = StageLayout::linear;
  const int lane = threadIdx.x & 31;
  const int n = te - t0 < 32 ? te - t0 : 32;
  const int h = t.h;
  auto valid = [&](int p) { return p >= 0 && p < a.src.num_pages; };
  if (t.tile_pages == 2 && n > kWarpTokens / 2) {
    // Pages of 16: slots 0–15 of two pages. A whole tile with both pages valid is four
    // unrolled pairs of runs; the rest (a tile of 17–31 tokens, cut short by the sequence
    // end or the causal limit; a bad page) takes the per-token path below.
    const int pg2 = t.pages[page_slot_index(t, a.table.page_size, t0) + 1];
    if (n == kWarpTokens && valid(pg) && valid(pg2)) {
      const HeadRegions r = a.src.head_regions(h);
      const std::byte* h0 = a.src.pool + std::size_t(pg) * r.page_bytes;
      const std::byte* h1 = a.src.pool + std::size_t(pg2) * r.page_bytes;
      const std::byte* const kc[2] = {h0 + r.kc, h1 + r.kc};
      const std::byte* const km[2] = {h0 + r.km, h1 + r.km};
      const std::byte* const vc[2] = {h0 + r.vc, h1 + r.vc};
      const std::byte* const vm[2] = {h0 + r.vm, h1 + r.vm};
      stage_full<Src::kcb, KL, 2>(st + S.kc_off(), kc);
      stage_full<Src::kmb, lin, 2>(st + S.km_off(), km);
      stage_full<Src::vcb, VL, 2>(st + S.vc_off(), vc);
      stage_full<Src::vmb, lin, 2>(st + S.vm_off(), vm);
      return KVQ_FULL_MASK;
    }
  } else if (t.tile_pages > 0) {
    // One run: the tile lies in page pg (tiles start at multiples of 32, split_chunk), or,
    // with pages of 16, all of its n ≤ 16 tokens do.
    const int slot = t.page_shift >= 0 ? t0 & (a.table.page_size - 1) : t0 % a.table.page_size;
    const bool ok = valid(pg);
    if (!ok && lane == 0 && a.error_flags) atomicOr(a.error_flags, static_cast<unsigned>(kBadPage));
    const HeadRegions r = a.src.head_regions(h);
    const std::byte* head = ok ? a.src.pool + std::size_t(pg) * r.page_bytes : nullptr;
    auto at = [&](unsigned region, int pitch) { return ok ? head + (region + unsigned(slot * pitch)) : nullptr; };
    if (n == kWarpTokens && ok) {  // the common case: four unrolled runs
      const std::byte* const kc[1] = {at(r.kc, Src::kcb)};
      const std::byte* const km[1] = {at(r.km, Src::kmb)};
      const std::byte* const vc[1] = {at(r.vc, Src::vcb)};
      const std::byte* const vm[1] = {at(r.vm, Src::vmb)};
      stage_full<Src::kcb, KL>(st + S.kc_off(), kc);
      stage_full<Src::kmb, lin>(st + S.km_off(), km);
      stage_full<Src::vcb, VL>(st + S.vc_off(), vc);
      stage_full<Src::vmb, lin>(st + S.vm_off(), vm);
      return KVQ_FULL_MASK;
    }
    stage_run<Src::kcb, KL>(st + S.kc_off(), n, at(r.kc, Src::kcb));
    stage_run<Src::kmb, lin>(st + S.km_off(), n, at(r.km, Src::kmb));
    stage_run<Src::vcb, VL, kZeroMissingValues>(st + S.vc_off(), n, at(r.vc, Src::vcb));
    stage_run<Src::vmb, lin>(st + S.vm_off(), n, at(r.vm, Src::vmb));
    return ok ? (n == 32 ? KVQ_FULL_MASK : (1u << n) - 1u) : 0u;
  }
  int my_page = -1, my_slot = 0;
  if (lane < n) {
    const int tok = t0 + lane;
    const int pg = t.pages[tok / a.table.page_size];
    if (pg >= 0 && pg < a.src.num_pages) {
      my_page = pg;
      my_slot = tok % a.table.page_size;
    } else if (a.error_flags) {
      atomicOr(a.error_flags, static_cast<unsigned>(kBadPage));
    }
  }
  stage_rows<Src::kcb, KL>(st + S.kc_off(), n, my_page, my_slot, [&](int pg, int sl) { return a.src.k_codes(pg, h, sl); });
  stage_rows<Src::kmb, lin>(st + S.km_off(), n, my_page, my_slot, [&](int pg, int sl) { return a.src.k_meta(pg, h, sl); });
  stage_rows<Src::vcb, VL, kZeroMissingValues>(st + S.vc_off(), n, my_page, my_slot,
                                               [&](int pg, int sl) { return a.src.v_codes(pg, h, sl); });
  stage_rows<Src::vmb, lin>(st + S.vm_off(), n, my_page, my_slot, [&](int pg, int sl) { return a.src.v_meta(pg, h, sl); });
  return __ballot_sync(KVQ_FULL_MASK, my_page >= 0);
}

// Joins the split partials of output rows items[0 … n) (query row × Hq + query head) with
// one warp: o = Σ_s e^{lse_s − M}·o_s / Σ_s e^{lse_s − M}, then R_Vᵀ and ν unless
// rotated_output; scratch[r]: D floats of shared memory per row. The partials may come
// from other CTAs of the same launch: they are read past L1 (ld.global.cg). The merge
// is a chain of L2 round trips on the kernel's critical path (the last split CTA's, at
// small batches: at 1×32K, 57 splits, one round trip per split cost ~8 of 45 µs on the
// H200), so the loads are batched: the maxima's loads of all rows are in flight together
// (unrolled by 4 splits), then the partial rows of kInFlight splits of every row at once
// (64 floats a lane in all, no branches in the loop). Splits are taken in order per row:
// the sums do not depend on the batching or on how many rows a warp merges.
template <class KP, int kRows>
__device__ __forceinline__ void merge_split_rows(const KP& a, const std::size_t* items, int n, float* const* scratch) {
  using Src = typename KP::source_type;
  constexpr int D = Src::D, E = D / 32;
  [[maybe_unused]] constexpr int kInFlight = 64 / E / kRows > 0 ? 64 / E / kRows : 1;  // splits per row in flight
  if (n <= 0) return;  // warp-uniform
  const int lane = threadIdx.x & 31;
  const int hq = a.p.num_qo_heads;
  const std::size_t rows = std::size_t(a.total_q) * hq;
  // Rows past n read row 0's partials (no branch in the loops) and are not written.
  std::size_t src[kRows];
  float M[kRows], L[kRows], x[kRows][E];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    src[r] = r < n ? items[r] : items[0];
    M[r] = neg_inf_f(), L[r] = 0.f;
#pragma unroll
    for (int k = 0; k < E; ++k) x[r][k] = 0.f;
  }
#pragma unroll 4
  for (int s = lane; s < a.num_splits; s += 32)
#pragma unroll
    for (int r = 0; r < kRows; ++r) M[r] = warp::fmax_nan(M[r], __ldcg(a.partial_lse + s * rows + src[r]));
#pragma unroll
  for (int r = 0; r < kRows; ++r) M[r] = warp::max_nan(M[r]);
  for (int s0 = 0; s0 < a.num_splits; s0 += 32) {
    const int m = a.num_splits - s0 < 32 ? a.num_splits - s0 : 32;
    float lse_lane[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      lse_lane[r] = lane < m ? __ldcg(a.partial_lse + (s0 + lane) * rows + src[r]) : neg_inf_f();
#pragma unroll kInFlight
    for (int k = 0; k < m; ++k) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float ls = __shfl_sync(KVQ_FULL_MASK, lse_lane[r], k);
        const float* o = a.partial_o + ((s0 + k) * rows + src[r]) * D + lane * E;
        float ok[E];
        if constexpr (E % 4 == 0) {
#pragma unroll
          for (int i = 0; i < E; i += 4) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(o + i));
            ok[i] = v.x, ok[i + 1] = v.y, ok[i + 2] = v.z, ok[i + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int i = 0; i < E; ++i) ok[i] = __ldcg(o + i);
        }
        // An empty split (lse −∞) adds nothing, whatever its partial holds (M = −∞: all).
        const bool live = ls != neg_inf_f();
        const float wgt = expf(ls - M[r]);
        L[r] = live ? L[r] + wgt : L[r];
#pragma unroll
        for (int i = 0; i < E; ++i) x[r][i] = live ? fmaf(wgt, ok[i], x[r][i]) : x[r][i];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= n) break;  // warp-uniform
    const std::size_t item = items[r];
    const int h = static_cast<int>(item % hq) / (hq / a.src.num_kv_heads());
    const bool empty = M[r] == neg_inf_f() || L[r] == 0.f;
    const float inv_l = empty ? 0.f : 1.f / L[r];
#pragma unroll
    for (int k = 0; k < E; ++k) x[r][k] *= inv_l;
    if (!empty && !a.p.rotated_output) a.src.finish(x[r], h, a.rotation, scratch[r]);
    warp::store_row<D>(a.p.out + item * D, x[r]);
    if (lane == 0 && a.p.lse) a.p.lse[item] = empty ? neg_inf_f() : M[r] + logf(L[r]);
  }
}

// Whether the decode grid computed output row (query token qt, query head j): row_tile's
// checks seen from the row. The sequence is the last b with q_indptr[b] ≤ qt (runs do not
// decrease unless one is flagged); its run must lie in [0, total_q] and hold qt, and the
// row must fall inside the grid that max_q_per_seq sized. (row_tile's run check is
// written out again on purpose: one shared helper moved ptxas' allocation of the
// tensor-core K4V4 kernel, one more spill instruction in its token loop.)
template <class KP>
__device__ __forceinline__ bool row_in_grid(const KP& a, int qt, int j) {
  if (a.table.batch_size <= 0) return false;
  int lo = 0, hi = a.table.batch_size;  // the sequence lies in [lo, hi)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (a.p.q_indptr[mid] <= qt) lo = mid;
    else hi = mid;
  }
  const int q0 = a.p.q_indptr[lo], q1 = a.p.q_indptr[lo + 1];
  if (q0 < 0 || q1 > a.total_q || qt < q0 || qt >= q1) return false;
  const int group = a.p.num_qo_heads / a.src.num_kv_heads();
  const long long r = static_cast<long long>(qt - q0) * group + j % group;
  return r < static_cast<long long>(a.row_tiles) * a.tile_rows;
}

// The split merge as its own launch (after the CUDA-core kernel): one warp per row. Rows
// the decode grid did not compute (a flagged q_indptr run, rows past the grid) have no
// partials and stay unwritten, as with the in-kernel merge.
template <class KP>
__global__ void __launch_bounds__(128) split_merge_kernel(KP a) {
  __shared__ float scratch[4][KP::source_type::D];
  wait_for_prior_grids();  // the decode grid's partials
  allow_dependent_grids();
  const int w = threadIdx.x / 32;
  const std::size_t item = std::size_t(blockIdx.x) * 4 + w;
  if (item >= std::size_t(a.total_q) * a.p.num_qo_heads) return;
  if (!row_in_grid(a, static_cast<int>(item / a.p.num_qo_heads), static_cast<int>(item % a.p.num_qo_heads)))
    return;  // warp-uniform
  float* const row_scratch = scratch[w];
  merge_split_rows<KP, 1>(a, &item, 1, &row_scratch);
}

// The split merge inside the decode kernel (split_counters set): after its partials are
// written, each split CTA of a tile counts its arrival; the last one merges the tile's
// rows (warp w: rows w, w + NW, …, merged together) and resets the counter for the next
// launch. scratch: [R][D] floats.
template <class KP, int R, int NW>
__device__ __forceinline__ void merge_if_last_split(const KP& a, const RowTile& t, float* scratch) {
  __shared__ int last_s;
  __threadfence();  // this CTA's partials are visible device-wide before its arrival counts
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* c = a.split_counters + (std::size_t(blockIdx.x) * gridDim.y + blockIdx.y);
    const bool last = atomicAdd(c, 1u) == static_cast<unsigned>(a.num_splits - 1);
    if (last) *c = 0u;  // every split has arrived
    last_s = last;
  }
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  constexpr int D = KP::source_type::D, kRows = (R + NW - 1) / NW;
  const int w = threadIdx.x / 32;
  std::size_t items[kRows];
  float* rows_scratch[kRows];
  int n = 0;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int rr = w + k * NW;
    const int i = (t.r0 + rr) / t.group, j = t.h * t.group + (t.r0 + rr) % t.group;
    items[k] = std::size_t(t.q0 + i) * t.hq + j;
    rows_scratch[k] = scratch + rr * D;
    n += rr < t.rows;
  }
  merge_split_rows<KP, kRows>(a, items, n, rows_scratch);
}

// Phase 4: joins the NW warp states acc [NW][R][D], m [NW][R], l [NW][R] (at the start
// of shared memory), normalizes and writes the final output or this split's partial; with
// kMergeInKernel (the tensor-core kernel) the last split CTA then joins the partials.
template <class KP, int R, int NW, bool kMergeInKernel>
__device__ __forceinline__ void write_rows(const KP& a, const RowTile& t, std::byte* smem, float* q_s,
                                           const float* shift_s) {
  using Src = typename KP::source_type;
  constexpr int D = Src::D, E = D / 32;
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
  const float* acc_m = reinterpret_cast<const float*>(smem);
  const float* m_m = acc_m + NW * R * D;
  const float* l_m = m_m + NW * R;
  for (int rr = w; rr < t.rows; rr += NW) {
    float M = neg_inf_f();
    for (int ww = 0; ww < NW; ++ww) M = warp::fmax_nan(M, m_m[ww * R + rr]);
    float L = 0.f, x[E];
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = 0.f;
    for (int ww = 0; ww < NW; ++ww) {
      const float mw = m_m[ww * R + rr];
      if (mw == neg_inf_f()) continue;
      const float sc = warp::exp2_weight(mw - M);
      L = fmaf(sc, l_m[ww * R + rr], L);
#pragma unroll
      for (int k = 0; k < E; ++k) x[k] = fmaf(sc, acc_m[(ww * R + rr) * D + lane * E + k], x[k]);
    }
    const bool empty = M == neg_inf_f() || L == 0.f;
    const float inv_l = empty ? 0.f : 1.f / L;
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] *= inv_l;
    const float lse = empty ? neg_inf_f() : (M + log2f(L)) * kLn2 + shift_s[rr];
    const int i = (t.r0 + rr) / t.group, j = t.h * t.group + (t.r0 + rr) % t.group;
    const std::size_t orow = std::size_t(t.q0 + i) * t.hq + j;
    if (a.num_splits == 1) {
      if (!empty && !a.p.rotated_output) a.src.finish(x, t.h, a.rotation, q_s + rr * D);
      warp::store_row<D>(a.p.out + orow * D, x);
      if (lane == 0 && a.p.lse) a.p.lse[orow] = lse;
    } else {
      const std::size_t prow = std::size_t(t.split) * a.total_q * t.hq + orow;
#pragma unroll
      for (int k = 0; k < E; ++k) a.partial_o[prow * D + lane * E + k] = x[k];
      if (lane == 0) a.partial_lse[prow] = lse;
    }
  }
  if constexpr (kMergeInKernel)
    if (a.num_splits > 1 && a.split_counters) merge_if_last_split<KP, R, NW>(a, t, q_s);
}

// ---- the CUDA-core kernel ---------------------------------------------------------------

// KP = DecodeKernelParams<Src, QT, OT> (a type parameter: see rows.cuh on nvcc stubs).
template <class KP, int R>
__global__ void __launch_bounds__(DecodeConfig<typename KP::source_type, R>::NW * 32) decode_kernel(KP a) {
  using Src = typename KP::source_type;
  using Cfg = DecodeConfig<Src, R>;
  constexpr int D = Src::D, NW = Cfg::NW, VD = Cfg::VD, LPTV = Cfg::LPTV, U = Cfg::U;
  constexpr DecodeSmem S = Cfg::smem;
  std::byte* smem = reinterpret_cast<std::byte*>(kvq_decode_smem);
  float* q_s = reinterpret_cast<float*>(smem + S.q_off());
  float* qsum_s = reinterpret_cast<float*>(smem + S.qsum_off());
  float* shift_s = reinterpret_cast<float*>(smem + S.shift_off());
  int* limit_s = reinterpret_cast<int*>(smem + S.limit_off());

  const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
  wait_for_prior_grids();  // queries, page table and cache may come from the previous kernels
  const RowTile tile = row_tile(a, R);
  if (tile.rows == 0) return;  // CTA-uniform: this tile has no rows

  // 1. Query rows.
  prepare_rows<KP, R, NW>(a, tile, q_s, qsum_s, shift_s, limit_s);
  __syncthreads();

  // 2. This split's tokens.
  int tb, te;
  split_range(tile, a.num_splits, tb, te);

  float m[R], l[R], acc[R][VD];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf_f();
    l[r] = 0.f;
#pragma unroll
    for (int k = 0; k < VD; ++k) acc[r][k] = 0.f;
  }
  float* p_s = reinterpret_cast<float*>(smem + S.p_off(w));
  const int u = lane / LPTV, d0 = (lane % LPTV) * VD;

  // Two-stage pipeline over this warp's tiles t0 = tb + 32·w, step 32·NW.
  // The page is read at issue time; reading it a tile ahead (PageAhead) is for the
  // tensor-core kernel: this one is bound by its fp32 arithmetic (K4V2 read its bytes at
  // 19–20% of the copy figure on the H200).
  auto issue = [&](int i, int t_begin) -> unsigned {
    if (t_begin >= te) return 0u;
    const int pg = tile.tile_pages > 0 ? tile.pages[page_slot_index(tile, a.table.page_size, t_begin)] : -1;
    return issue_tile(a, S, tile, smem + S.stage_off(w, i), t_begin, te, pg);
  };
  warp::StageRing<2> ring;
  ring.start(issue, tb + 32 * w, 32 * NW);
  for (int t0 = tb + 32 * w; t0 < te; t0 += 32 * NW) {
    unsigned valid_cur = 0;
    const std::byte* st = smem + S.stage_off(w, ring.next(issue, t0 + 32 * NW, valid_cur));
    const int n = te - t0 < 32 ? te - t0 : 32;

    // q·k: lane = token t0 + lane.
    float logit[R];
#pragma unroll
    for (int r = 0; r < R; ++r) logit[r] = 0.f;
    a.src.template qk<R>(st + S.kc_off(), st + S.km_off() + lane * Src::kmb, q_s, qsum_s, logit);
    const bool loaded = (valid_cur >> lane) & 1u;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (!loaded || t0 + lane > limit_s[r]) logit[r] = neg_inf_f();

    // Online softmax (log₂ domain); p goes to shared memory for the p·v lanes.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float m_new = warp::fmax_nan(m[r], warp::max_nan(logit[r]));
      float corr = 1.f, p = 0.f;
      if (m_new != neg_inf_f()) {
        corr = warp::exp2_weight(m[r] - m_new);
        p = warp::exp2_weight(logit[r] - m_new);
      }
      m[r] = m_new;
      l[r] = fmaf(l[r], corr, p);
      p_s[lane * R + r] = p;
#pragma unroll
      for (int k = 0; k < VD; ++k) acc[r][k] *= corr;
    }
    __syncwarp();

    // p·v: lane (u, slice) takes tokens u, u + U, …
    for (int tt = u; tt < n; tt += U) {
      if (!((valid_cur >> tt) & 1u)) continue;
      a.src.template pv<R, VD>(st + S.vc_off() + std::size_t(tt) * Src::vcb, st + S.vm_off() + std::size_t(tt) * Src::vmb,
                               d0, p_s + tt * R, acc);
    }
    __syncwarp();
  }
  warp::copy_wait<0>();
  allow_dependent_grids();  // what is left is the merge of the warps (and splits)

  // 3. Merge the lanes, then publish the warp's state for write_rows.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    l[r] = warp::sum(l[r]);
#pragma unroll
    for (int k = 0; k < VD; ++k)
#pragma unroll
      for (int off = LPTV; off < 32; off <<= 1) acc[r][k] += __shfl_xor_sync(KVQ_FULL_MASK, acc[r][k], off);
  }
  __syncthreads();  // staging buffers are free from here on
  float* acc_m = reinterpret_cast<float*>(smem);  // [NW][R][D]
  float* m_m = acc_m + NW * R * D;                 // [NW][R]
  float* l_m = m_m + NW * R;                       // [NW][R]
  if (u == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int k = 0; k < VD; ++k) acc_m[(w * R + r) * D + d0 + k] = acc[r][k];
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m_m[w * R + r] = m[r];
      l_m[w * R + r] = l[r];
    }
  }
  __syncthreads();

  // 4. Normalize and write.
  write_rows<KP, R, NW, false>(a, tile, smem, q_s, shift_s);  // split_merge_kernel joins the splits
}

// Kernel parameters of one decode call (shared by the launchers and the host emulator).
// row_tiles, tile_rows: CTAs per (sequence, KV head, split) and query rows per CTA
// (DecodePlan::row_tiles, rows); workspace: the split-KV workspace laid out as
// kvq/cuda/traits/geometry.hpp describes (null when num_splits == 1); merge_in_kernel:
// the kernel merges its splits (with the arrival counters at the start of the workspace).
template <class Src, ActivationType QT, ActivationType OT>
DecodeKernelParams<Src, QT, OT> make_decode_params(const Src& src, const PageTableView& table,
                                                  const DecodeParams<QT, OT>& p, const RotationParams& r,
                                                  int num_splits, int row_tiles, int tile_rows, int total_q,
                                                  void* workspace,
                                                  unsigned* error_flags, bool merge_in_kernel = false) {
  DecodeKernelParams<Src, QT, OT> kp{};
  kp.src = src;
  kp.table = table;
  kp.p = p;
  kp.rotation = r;
  kp.num_splits = num_splits;
  kp.row_tiles = row_tiles;
  kp.tile_rows = tile_rows;
  kp.total_q = total_q;
  kp.tau = p.scale(Src::D);
  const std::size_t rows = std::size_t(total_q) * p.num_qo_heads;
  char* const base = static_cast<char*>(workspace);
  kp.split_counters = workspace && merge_in_kernel ? reinterpret_cast<unsigned*>(base) : nullptr;
  kp.partial_o = workspace ? reinterpret_cast<float*>(base + kSplitCounterBytes) : nullptr;
  kp.partial_lse = workspace ? reinterpret_cast<float*>(base + kSplitCounterBytes +
                                                        split_partial_o_bytes(num_splits, rows, Src::D))
                             : nullptr;
  kp.error_flags = error_flags;
  return kp;
}

}  // namespace kvq::cuda::kernel
