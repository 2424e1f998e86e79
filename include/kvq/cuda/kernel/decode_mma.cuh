// kvq/cuda/kernel/decode_mma.cuh — the tensor-core decode kernel (DESIGN §9: at 2–4 bits
// with GQA, fp32 CUDA cores cannot keep up with HBM), for quantized pages and, as the
// baseline of equal engineering, fp16 pages.
//
// Same work decomposition, staging, softmax semantics and output path as decode_kernel
// (kernel/decode.cuh); only the products change (MmaOps<Src>). A CTA holds R = 16 query
// rows (one m16 tile; rows past the GQA group × query tokens are zero and masked). Per
// warp tile of 32 tokens:
//   q·k  S [16 rows × 32 tokens] = Σ_groups s_g ⊙ (Q'_g · C_gᵀ) + lo_g · Σq'_g
//        A = Q' (fp32, split into fp16 hi + lo, pre-packed in shared memory per k-step),
//        B = key codes unpacked exactly to fp16 straight from the staged 16-byte chunks;
//        each key group accumulates in its own fragment and is folded with the token's
//        (scale, lo) — the codes are never dequantized. (fp16 pages: B = K as stored.)
//   p·v  O [16 × D] += (P ⊙ s_v) · C_v + P · lo_v
//        The S accumulator layout is the A layout of m16n8k16 (as in FlashAttention-2), so
//        P never leaves registers; P ⊙ s_v (per token and value group) is split into fp16
//        hi + lo, B = value codes unpacked exactly; Σ p·lo_v is a per-row scalar per group.
//        (fp16 pages: A = P, B = V as stored.)
// Precision (DecodePrecision, kvq/cuda/traits/tensor_core.hpp). `exact`: the hi/lo
// splits make every product fp32-accurate (relative error about 2⁻²²), so the result
// matches the CPU reference as closely as the CUDA-core kernel does. `fast`: only the hi
// halves, i.e. Q' and p·s_v (P for fp16 pages) rounded to fp16 once (unit roundoff
// u = 2⁻¹¹). Both fp16 operands are scaled by powers of two (Q' per CTA, p·s_v per tile)
// so that they neither overflow nor lose bits to fp16 subnormals.
//
// Error of `fast` against exact attention over K̂, V̂, per output element d of a row, to
// first order in u (the test adds the factor 2^{2u·max a} for the rest, and fp32 rounding):
//   |Δo_d| ≤ u·Σ_t p_t·(ln2·a_t·|ŵ_{t,d} − o_d| + |s_{v,t}·c_{t,d}|)
//   a_t = Σ_i |q'_i·s_{g(i),t}·c_{t,i}|   the code part of token t's logit, log₂ units
//         (q' = τ·log₂e·q·R_K; fp16 pages: Σ_i |q'_i·k_{t,i}|, and the last term |v_{t,d}|)
// with t over the row's visible tokens, p the exact weights, ŵ_t the stored-basis value
// row and o the stored-basis output (R_V is orthogonal: the error's L2 norm is the same in
// the original basis). Why: rounding Q' moves logit t by at most u·a_t, which moves the
// output by ln2·Σ_t p_t·Δs_t·(ŵ_t − o); rounding p·s_v moves each value code term by at
// most u of itself. tests/cuda/test_emulated.cpp checks it against fp64 attention over
// the dequantized cache.
//
// Served cache types: kTensorCoreDecode<P> / kTensorCoreDenseDecode<T, D> (launch/api.hpp).
// Registers per lane: O 4·D/8 + S 16 + group accumulator 16.
#pragma once

#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/traits/decode_smem.hpp"
#include "kvq/cuda/traits/geometry.hpp"
#include "kvq/cuda/traits/tensor_core.hpp"
#include "kvq/cuda/warp/mma.cuh"

namespace kvq::cuda::kernel {

// Codes (dim, dim + 1) of token `tok` from the transposed key stage [chunk][32][16 B].
template <int Bits>
__device__ __forceinline__ unsigned key_code_pair(const std::byte* kc, int tok, int dim) {
  const int bit = dim * Bits;
  const unsigned w = reinterpret_cast<const unsigned*>(kc + (std::size_t(bit >> 7) * 32 + tok) * 16)[(bit >> 5) & 3];
  constexpr unsigned mask = (1u << Bits) - 1u;
  return warp::codes_to_half2((w >> (bit & 31)) & mask, (w >> ((bit & 31) + Bits)) & mask);
}

// Code of `dim` in a token-major packed row.
template <int Bits>
__device__ __forceinline__ unsigned row_code(const std::byte* row, int dim) {
  const int bit = dim * Bits;
  return (reinterpret_cast<const unsigned*>(row)[bit >> 5] >> (bit & 31)) & ((1u << Bits) - 1u);
}

__device__ __forceinline__ float meta_half(const std::byte* meta, int i) {
  return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(meta)[i]));
}

// The products of one warp tile (32 tokens) for a cache type; the kernel below does the
// rest. Fragment index conventions (g = lane / 4, tq = lane % 4):
//   s[nt][i]  logit / probability of row g + 8·(i / 2), token 8·nt + 2·tq + i % 2
//   o[nd][i]  output of row g + 8·(i / 2), dim 8·nd + 2·tq + i % 2 (units of 2^-e)
//   olo[rh][gv]  Σ p·lo_v of row g + 8·rh and value group gv over this lane's tokens
template <class Src>
struct MmaOps {
  static constexpr bool kOk = false;
};

// Quantized pages: codes unpacked exactly, per-group metadata folded outside the MMAs.
template <Policy P>
struct MmaOps<QuantSource<P>> {
  using Src = QuantSource<P>;
  static constexpr int D = P.head_dim, NK = Src::NK, NV = D / P.value.group;
  static constexpr bool kOk = kTensorCoreDecode<P>;

  // Largest value scale of one staged token (what bounds p·s_v).
  __device__ static float value_scale(const std::byte* vm, int tok) {
    float m = 0.f;
#pragma unroll
    for (int gv = 0; gv < NV; ++gv) m = fmaxf(m, fabsf(meta_half(vm + std::size_t(tok) * Src::vmb, 2 * gv)));
    return m;
  }

  // S = Σ_groups s_g ⊙ (Q'_g·C_gᵀ)·2^qexp + lo_g·Σq'_g; qf_s: Q' fragments [KS][hi, lo][32].
  template <bool kExact>
  __device__ static void logits(const std::byte* kc, const std::byte* km, const uint4* qf_s, const float* qsum_s,
                                float qup, float (&s)[4][4]) {
    constexpr int KSG = Src::GK / 16;  // k-steps per key group
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kg = 0; kg < NK; ++kg) {
      float acc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int ks = kg * KSG; ks < (kg + 1) * KSG; ++ks) {
        const uint4 qh = qf_s[(ks * 2) * 32 + lane], ql = kExact ? qf_s[(ks * 2 + 1) * 32 + lane] : uint4{};
        const unsigned ah[4] = {qh.x, qh.y, qh.z, qh.w}, al[4] = {ql.x, ql.y, ql.z, ql.w};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int tok = nt * 8 + g;
          const unsigned b[2] = {key_code_pair<P.key.bits>(kc, tok, ks * 16 + 2 * tq),
                                 key_code_pair<P.key.bits>(kc, tok, ks * 16 + 2 * tq + 8)};
          warp::mma_16816(acc[nt], ah, b);
          if constexpr (kExact) warp::mma_16816(acc[nt], al, b);
        }
      }
      const float qs0 = qsum_s[g * NK + kg], qs1 = qsum_s[(g + 8) * NK + kg];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const std::byte* meta = km + std::size_t(nt * 8 + 2 * tq + j) * Src::kmb;
          const float sc = meta_half(meta, 2 * kg), lo = meta_half(meta, 2 * kg + 1);
          s[nt][j] = fmaf(sc, acc[nt][j] * qup, fmaf(lo, qs0, s[nt][j]));
          s[nt][2 + j] = fmaf(sc, acc[nt][2 + j] * qup, fmaf(lo, qs1, s[nt][2 + j]));
        }
    }
  }

  // O += (P ⊙ s_v·2^e)·C_v, olo += P·lo_v.
  template <bool kExact>
  __device__ static void values(const std::byte* vc, const std::byte* vm, unsigned /*valid*/, const float (&s)[4][4],
                                float xscale, float (&o)[D / 8][4], float (&olo)[2][NV]) {
    constexpr int NDG = P.value.group / 8;  // value n-tiles per value group
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      const int tk[4] = {kt * 16 + 2 * tq, kt * 16 + 2 * tq + 1, kt * 16 + 2 * tq + 8, kt * 16 + 2 * tq + 9};
      const float pr[2][4] = {{s[2 * kt][0], s[2 * kt][1], s[2 * kt + 1][0], s[2 * kt + 1][1]},
                              {s[2 * kt][2], s[2 * kt][3], s[2 * kt + 1][2], s[2 * kt + 1][3]}};
#pragma unroll
      for (int gv = 0; gv < NV; ++gv) {
        float x[2][4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const std::byte* meta = vm + std::size_t(tk[k]) * Src::vmb;
          const float sv = meta_half(meta, 2 * gv), lv = meta_half(meta, 2 * gv + 1);
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            // A zero weight contributes nothing, whatever the (possibly NaN) metadata.
            x[rh][k] = pr[rh][k] != 0.f ? pr[rh][k] * sv * xscale : 0.f;
            olo[rh][gv] += pr[rh][k] != 0.f ? pr[rh][k] * lv : 0.f;
          }
        }
        unsigned ah[4], al[4];
        warp::split_half2(x[0][0], x[0][1], ah[0], al[0]);
        warp::split_half2(x[1][0], x[1][1], ah[1], al[1]);
        warp::split_half2(x[0][2], x[0][3], ah[2], al[2]);
        warp::split_half2(x[1][2], x[1][3], ah[3], al[3]);
#pragma unroll
        for (int nd = gv * NDG; nd < (gv + 1) * NDG; ++nd) {
          const int dim = nd * 8 + g;
          const unsigned b[2] = {
              warp::codes_to_half2(row_code<P.value.bits>(vc + std::size_t(tk[0]) * Src::vcb, dim),
                                   row_code<P.value.bits>(vc + std::size_t(tk[1]) * Src::vcb, dim)),
              warp::codes_to_half2(row_code<P.value.bits>(vc + std::size_t(tk[2]) * Src::vcb, dim),
                                   row_code<P.value.bits>(vc + std::size_t(tk[3]) * Src::vcb, dim))};
          warp::mma_16816(o[nd], ah, b);
          if constexpr (kExact) warp::mma_16816(o[nd], al, b);
        }
      }
    }
  }
};

// fp16 pages (the full-precision baseline of the same design): K and V halves go into
// the MMAs as stored; P is scaled by 2^13 (p ≤ 1) before its hi/lo split.
template <int HD>
struct MmaOps<DenseSource<half_t, HD>> {
  using Src = DenseSource<half_t, HD>;
  static constexpr int D = HD, NK = 1, NV = 1;
  static constexpr bool kOk = kTensorCoreDenseDecode<half_t, HD>;

  __device__ static float value_scale(const std::byte*, int) { return 1.f; }

  template <bool kExact>
  __device__ static void logits(const std::byte* kc, const std::byte*, const uint4* qf_s, const float*, float qup,
                                float (&s)[4][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint4 qh = qf_s[(ks * 2) * 32 + lane], ql = kExact ? qf_s[(ks * 2 + 1) * 32 + lane] : uint4{};
      const unsigned ah[4] = {qh.x, qh.y, qh.z, qh.w}, al[4] = {ql.x, ql.y, ql.z, ql.w};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        // dims 16·ks + 2·tq + {0, 1} (+ 8): word tq of 16-byte chunks 2·ks and 2·ks + 1
        const int tok = nt * 8 + g;
        const unsigned b[2] = {reinterpret_cast<const unsigned*>(kc + (std::size_t(2 * ks) * 32 + tok) * 16)[tq],
                               reinterpret_cast<const unsigned*>(kc + (std::size_t(2 * ks + 1) * 32 + tok) * 16)[tq]};
        warp::mma_16816(acc[nt], ah, b);
        if constexpr (kExact) warp::mma_16816(acc[nt], al, b);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = acc[nt][i] * qup;
  }

  // O += (P·2^e)·V; tokens not loaded in this tile read as zero (their rows are stale).
  template <bool kExact>
  __device__ static void values(const std::byte* vc, const std::byte*, unsigned valid, const float (&s)[4][4],
                                float xscale, float (&o)[D / 8][4], float (&)[2][NV]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      const int tk[4] = {kt * 16 + 2 * tq, kt * 16 + 2 * tq + 1, kt * 16 + 2 * tq + 8, kt * 16 + 2 * tq + 9};
      unsigned ah[4], al[4];
      warp::split_half2(s[2 * kt][0] * xscale, s[2 * kt][1] * xscale, ah[0], al[0]);
      warp::split_half2(s[2 * kt][2] * xscale, s[2 * kt][3] * xscale, ah[1], al[1]);
      warp::split_half2(s[2 * kt + 1][0] * xscale, s[2 * kt + 1][1] * xscale, ah[2], al[2]);
      warp::split_half2(s[2 * kt + 1][2] * xscale, s[2 * kt + 1][3] * xscale, ah[3], al[3]);
      const unsigned short* row[4];
      bool ok[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        row[k] = reinterpret_cast<const unsigned short*>(vc + std::size_t(tk[k]) * Src::vcb);
        ok[k] = (valid >> tk[k]) & 1u;
      }
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        const int dim = nd * 8 + g;
        auto v = [&](int k) -> unsigned { return ok[k] ? row[k][dim] : 0u; };
        const unsigned b[2] = {v(0) | (v(1) << 16), v(2) | (v(3) << 16)};
        warp::mma_16816(o[nd], ah, b);
        if constexpr (kExact) warp::mma_16816(o[nd], al, b);
      }
    }
  }
};

template <class Src>
struct MmaDecodeConfig {
  static constexpr int D = Src::D, R = kMmaRows;
  static constexpr int NW = decode_warps(std::size_t(Src::kcb + Src::kmb + Src::vcb + Src::vmb));
  static constexpr int KS = D / 16;  // k-steps of q·k
  // Query fragments [KS][hi, lo][32 lanes] uint4, then the CTA's exponent of Q' (int).
  static constexpr std::size_t kFragBytes = std::size_t(KS) * 2 * 32 * 16 + 16;
  static constexpr DecodeSmem smem{std::size_t(Src::kcb), std::size_t(Src::kmb), std::size_t(Src::vcb),
                                   std::size_t(Src::vmb), D, R, Src::NK, NW, kFragBytes};
  static_assert(MmaOps<Src>::kOk, "kvq: no tensor-core decode kernel for this cache type (MmaOps<Src>::kOk)");
};

// KP = DecodeKernelParams<Src, QT, OT> with MmaOps<Src>::kOk.
template <class KP, DecodePrecision kPrecision>
__global__ void __launch_bounds__(MmaDecodeConfig<typename KP::source_type>::NW * 32) decode_mma_kernel(KP a) {
  constexpr bool kExact = kPrecision == DecodePrecision::exact;
  using Src = typename KP::source_type;
  using Cfg = MmaDecodeConfig<Src>;
  using Ops = MmaOps<Src>;
  constexpr int D = Src::D, R = Cfg::R, NW = Cfg::NW, KS = Cfg::KS, NV = Ops::NV;
  constexpr DecodeSmem S = Cfg::smem;
  std::byte* smem = reinterpret_cast<std::byte*>(kvq_decode_smem);
  float* q_s = reinterpret_cast<float*>(smem + S.q_off());
  float* qsum_s = reinterpret_cast<float*>(smem + S.qsum_off());
  float* shift_s = reinterpret_cast<float*>(smem + S.shift_off());
  int* limit_s = reinterpret_cast<int*>(smem + S.limit_off());
  uint4* qf_s = reinterpret_cast<uint4*>(smem + S.frag_off());
  int* qmax_s = reinterpret_cast<int*>(smem + S.frag_off() + std::size_t(KS) * 2 * 32 * 16);

  const int w = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const RowTile tile = row_tile(a, R);
  if (tile.rows == 0) return;  // CTA-uniform

  // 1. Query rows, then their fp16 hi/lo A fragments, scaled by 2^-e so that max |Q'|
  //    lands in [2^13, 2^14) (finite non-negative floats order like their bit patterns).
  if (threadIdx.x == 0) *qmax_s = 0;
  prepare_rows<KP, R, NW>(a, tile, q_s, qsum_s, shift_s, limit_s);
  __syncthreads();
  {
    float mx = 0.f;
    for (int i = threadIdx.x; i < R * D; i += NW * 32) mx = fmaxf(mx, fabsf(q_s[i]));
    mx = warp::max(mx);
    if (lane == 0 && mx == mx && mx <= 3.0e38f) atomicMax(qmax_s, __float_as_int(mx));
  }
  __syncthreads();
  const float qmax = __int_as_float(*qmax_s);
  const int qexp = qmax > 0.f ? ilogbf(qmax) - 13 : 0;  // A = Q'·2^-qexp, S = (A·B)·2^qexp
  const float qdown = ldexpf(1.f, -qexp), qup = ldexpf(1.f, qexp);
  for (int ks = w; ks < KS; ks += NW) {
    const float* r0 = q_s + g * D + ks * 16 + 2 * tq;
    const float* r1 = r0 + 8 * D;
    uint4 hi, lo;
    warp::split_half2(r0[0] * qdown, r0[1] * qdown, hi.x, lo.x);
    warp::split_half2(r1[0] * qdown, r1[1] * qdown, hi.y, lo.y);
    warp::split_half2(r0[8] * qdown, r0[9] * qdown, hi.z, lo.z);
    warp::split_half2(r1[8] * qdown, r1[9] * qdown, hi.w, lo.w);
    qf_s[(ks * 2) * 32 + lane] = hi;
    qf_s[(ks * 2 + 1) * 32 + lane] = lo;
  }
  __syncthreads();

  // 2. This split's tokens.
  int tb, te;
  split_range<R>(tile, a.num_splits, limit_s, tb, te);
  const int lim[2] = {limit_s[g], limit_s[g + 8]};

  float o[D / 8][4];   // O fragments; n-tile nd = dims [8·nd, 8·nd + 8)
  float olo[2][NV];    // Σ p·lo_v of rows g and g + 8 per value group, this lane's tokens
  float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};
  int pexp = 0;        // o holds O·2^pexp (see the p·v operand below)
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
#pragma unroll
  for (int gv = 0; gv < NV; ++gv) olo[0][gv] = olo[1][gv] = 0.f;

  std::byte* const stage0 = smem + S.stage_off(w, 0);
  std::byte* const stage1 = smem + S.stage_off(w, 1);
  int t0 = tb + 32 * w;
  unsigned valid_cur = t0 < te ? issue_tile(a, S, tile, stage0, t0, te) : 0u;
  warp::copy_commit();
  int cur = 0;
  for (; t0 < te; t0 += 32 * NW) {
    const int tn = t0 + 32 * NW;
    const unsigned valid_next = tn < te ? issue_tile(a, S, tile, cur ? stage0 : stage1, tn, te) : 0u;
    warp::copy_commit();
    warp::copy_wait<1>();
    __syncwarp();
    const std::byte* st = cur ? stage1 : stage0;
    const std::byte* kc = st + S.kc_off();
    const std::byte* km = st + S.km_off();
    const std::byte* vc = st + S.vc_off();
    const std::byte* vm = st + S.vm_off();

    // q·k. s[nt][i]: row g + 8·(i / 2), token 8·nt + 2·tq + i % 2.
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    Ops::template logits<kExact>(kc, km, qf_s, qsum_s, qup, s);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = nt * 8 + 2 * tq + (i & 1);
        if (!((valid_cur >> tok) & 1u) || t0 + tok > lim[i >> 1]) s[nt][i] = neg_inf_f();
      }

    // The p·v operand p·s_v·2^e, with e per tile such that the largest value scale of the
    // tile maps into [2^13, 2^14): fp16 halves keep their precision for small scales and
    // cannot overflow for large ones. O is kept in units of 2^-e and rescaled on change.
    float smax = (valid_cur >> lane) & 1u ? Ops::value_scale(vm, lane) : 0.f;
    smax = warp::max(smax);
    const int e_new = smax > 0.f && smax <= 65504.f ? 13 - ilogbf(smax) : pexp;
    const float rescale = ldexpf(1.f, e_new - pexp), xscale = ldexpf(1.f, e_new);
    pexp = e_new;

    // Online softmax (log₂ domain) on rows g and g + 8; a row's 32 tokens live in the 4
    // lanes of a quad.
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = neg_inf_f();
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mx = warp::fmax_nan(mx, warp::fmax_nan(s[nt][2 * rh], s[nt][2 * rh + 1]));
      mx = warp::max_nan<4>(mx);
      const float m_new = warp::fmax_nan(m[rh], mx);
      float corr = 1.f, sum = 0.f;
      if (m_new != neg_inf_f()) {
        corr = exp2f(m[rh] - m_new);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            s[nt][2 * rh + j] = exp2f(s[nt][2 * rh + j] - m_new);
            sum += s[nt][2 * rh + j];
          }
      } else {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) s[nt][2 * rh] = s[nt][2 * rh + 1] = 0.f;
      }
      m[rh] = m_new;
      l[rh] = fmaf(l[rh], corr, sum);
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) o[nd][2 * rh] *= corr * rescale, o[nd][2 * rh + 1] *= corr * rescale;
#pragma unroll
      for (int gv = 0; gv < NV; ++gv) olo[rh][gv] *= corr;
    }

    // p·v over two k-steps of 16 tokens.
    Ops::template values<kExact>(vc, vm, valid_cur, s, xscale, o, olo);
    __syncwarp();
    cur ^= 1;
    valid_cur = valid_next;
  }
  warp::copy_wait<0>();

  // 3. l and Σ p·lo are per-lane partials over the quad's tokens; O is complete per warp
  //    (in units of 2^-pexp).
  const float oscale = ldexpf(1.f, -pexp);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    l[rh] += __shfl_xor_sync(KVQ_FULL_MASK, l[rh], 1);
    l[rh] += __shfl_xor_sync(KVQ_FULL_MASK, l[rh], 2);
#pragma unroll
    for (int gv = 0; gv < NV; ++gv) {
      olo[rh][gv] += __shfl_xor_sync(KVQ_FULL_MASK, olo[rh][gv], 1);
      olo[rh][gv] += __shfl_xor_sync(KVQ_FULL_MASK, olo[rh][gv], 2);
    }
  }
  __syncthreads();  // staging buffers are free from here on
  float* acc_m = reinterpret_cast<float*>(smem);  // [NW][R][D]
  float* m_m = acc_m + NW * R * D;                 // [NW][R]
  float* l_m = m_m + NW * R;                       // [NW][R]
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    const int gv = nd * 8 * NV / D, dim = nd * 8 + 2 * tq;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      acc_m[(w * R + g) * D + dim + j] = fmaf(o[nd][j], oscale, olo[0][gv]);
      acc_m[(w * R + g + 8) * D + dim + j] = fmaf(o[nd][2 + j], oscale, olo[1][gv]);
    }
  }
  if (tq == 0) {
    m_m[w * R + g] = m[0], m_m[w * R + g + 8] = m[1];
    l_m[w * R + g] = l[0], l_m[w * R + g + 8] = l[1];
  }
  __syncthreads();

  // 4. Normalize and write.
  write_rows<KP, R, NW>(a, tile, smem, q_s, shift_s);
}

}  // namespace kvq::cuda::kernel
