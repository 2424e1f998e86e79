// kvq/cuda/kernel/decode_mma.cuh — the tensor-core decode kernel (DESIGN §9 and the
// project's GPU-DECODE notes §3, both kept beside this repository), for quantized pages
// and, as the baseline of equal engineering,
// fp16 and bf16 pages.
//
// Same work decomposition, staging, softmax semantics and output path as decode_kernel
// (kernel/decode.cuh), whose pieces it shares (row_tile, prepare_rows, issue_tile,
// write_rows). A CTA holds R = 8 query rows (GQA heads × query tokens of one KV head);
// each of its warps streams its own 32-token tiles through an NS-stage cp.async pipeline.
//
// Swapped MMA roles (mma.sync m16n8k16, tokens in M, the 8 rows in N), per 16 tokens:
//   q·k  Sᵀ [16 tokens × 8 rows] = Σ_groups s_g ⊙ (C_g · Q'_gᵀ) + lo_g ⊗ Σq'_g
//        A = key codes of tokens g and g+8, unpacked exactly to fp16 subnormals (one LOP3
//        per code pair: the masked code bits are the mantissa, c·2^(e−24), no bias to
//        remove); B = Q' fragments built once per CTA.
//        Each MMA's k-step lies in one key group, whose fp32 accumulator is folded with
//        the token's (scale, lo) — the codes are never dequantized.
//   p·v  Oᵀ [D dims × 8 rows] += C_vᵀ · (P ⊙ s_v)ᵀ, and Σ p·lo_v per (row, value group)
//        A = value codes of tokens (2t, 2t+1, 2t+8, 2t+9), unpacked in token pairs; B = the
//        probabilities times the value scale, packed from the Sᵀ accumulator and moved into
//        B layout by movmatrix.trans. (16-bit pages: ldmatrix from swizzled rows, K as A of
//        q·k and Vᵀ via ldmatrix.trans as A of p·v; B = Q', P.)
// At GQA 4 half of the N columns are padding (a CTA holds 8 rows; the m16 roles of the
// old kernel wasted 12 of 16).
//
// Permuted head dimension. q·k only needs Q and K under the same permutation of the
// head dims, so a lane takes a contiguous run of each key group of its tokens (the
// quarter t of the group's bytes) and Q' is laid out to match; p·v permutes the output
// dims likewise and un-permutes them when the warps merge. Masking in place leaves code
// j of a 32-bit word scaled by an exact power of two 2^(e−24) (e: its bit offset, or
// offset − 6 after one shift); Q' absorbs 2^−e for keys, the output for values, and the
// common 2^−24 (kCodeExp) comes back through the softmax (logits held scaled by 2^−24)
// and the output. (Until 2026-12-06 the codes were 1024 + c·2^e by the 0x6400 trick,
// which cost an HSUB2 per code pair, or, for `fast` keys, a −1024·Σb accumulator start
// and a cancellation term in the bound below.)
//
// Precision (DecodePrecision, kvq/cuda/traits/tensor_core.hpp). `exact`: Q' and p·s_v are
// split into fp16 hi + lo (bf16 pages: hi + mid + lo) — fp32-like products, within 1e-5
// of the CPU reference. `fast`: one rounding to the operand type (unit roundoff u = 2⁻¹¹
// for fp16, 2⁻⁸ for bf16 pages). Both fp16 operands are scaled by powers of two (Q' per
// CTA; p·s_v per tile for quantized pages, p by a fixed 2^13 for fp16 pages, bf16 pages
// unscaled) so that they neither overflow nor lose bits to fp16 subnormals;
// codes (subnormal by design, and exact) and metadata enter exactly in both modes.
//
// Error of `fast` against exact attention over K̂, V̂, per output element d of a row, to
// first order in u (the test adds the factor 2^{2u·max a} for the rest, and fp32 rounding):
//   |Δo_d| ≤ u·Σ_t p_t·(ln2·a_t·|ŵ_{t,d} − o_d| + |s_{v,t}·c_{t,d}|)
//   a_t = Σ_i |q'_i·s_{g(i),t}·c_{t,i}|   log₂ units
//         (q' = τ·log₂e·q·R_K; 16-bit pages: Σ_i |q'_i·k_{t,i}|, and the last term |v_{t,d}|)
// with t over the row's visible tokens, p the exact weights, ŵ_t the stored-basis value
// row and o the stored-basis output (R_V is orthogonal: the error's L2 norm is the same in
// the original basis). Why: rounding Q' moves logit t by at most u·a_t; a logit error
// moves the output by ln2·Σ_t p_t·Δs_t·(ŵ_t − o); rounding p·s_v moves each value
// code term by at most u of itself. tests/cuda/test_emulated.cpp checks it against fp64
// attention over the dequantized cache, and tests/cuda/test_attention.cu on the device.
//
// Served cache types: kTensorCoreDecode<P> / kTensorCoreDenseDecode<T, D> (traits).
// Registers per lane: Oᵀ 4·D/16, Sᵀ 8, key-group accumulator 4, m/l 4, Σ p·lo 2·NV.
#pragma once

#include <utility>

#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/kernel/grid_dependency.cuh"
#include "kvq/cuda/traits/decode_smem.hpp"
#include "kvq/cuda/traits/geometry.hpp"
#include "kvq/cuda/traits/tensor_core.hpp"
#include "kvq/cuda/warp/mma.cuh"

namespace kvq::cuda::kernel {

// ---- exact code unpacking ------------------------------------------------------------------

// Loads Bytes (2, 4, 8, 16, 32, …) of a run into 32-bit words (2 bytes: w[0] low half).
template <int Bytes>
__device__ __forceinline__ void load_run(const std::byte* p, unsigned (&w)[Bytes < 4 ? 1 : Bytes / 4]) {
  if constexpr (Bytes == 2) {
    w[0] = *reinterpret_cast<const unsigned short*>(p);
  } else if constexpr (Bytes == 4) {
    w[0] = *reinterpret_cast<const unsigned*>(p);
  } else if constexpr (Bytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < Bytes / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  }
}

// Code j of both 16-bit halves of w (bit offset o = j·Bits), masked in place, is an fp16
// pair of subnormals c·2^(e + kCodeExp) — exact, no bias to remove (an fp16 with a zero
// exponent field is mantissa·2^-24; the tensor cores take subnormal fp16 operands, which
// the device test CudaMma.SubnormalHalfOperandsMultiplyExactly checks): e = o when the
// code fits the 10 mantissa bits there, else o − 6 from w >> 6. One LOP3 per code pair.
inline constexpr int kCodeExp = -24;
template <int Bits>
KVQ_HOST_DEVICE constexpr int code_exp(int j) {
  return j * Bits + Bits <= 10 ? j * Bits : j * Bits - 6;
}
template <int Bits, int J>
__device__ __forceinline__ unsigned code_pair(unsigned w, unsigned w6) {
  constexpr unsigned kMask = (((1u << Bits) - 1u) << code_exp<Bits>(J)) * 0x00010001u;
  return (J * Bits + Bits <= 10 ? w : w6) & kMask;
}

// f(std::integral_constant<int, i>) for i = 0 … N−1: code positions as template arguments
// (read them as decltype(i)::value; the conversion operator is host-only).
template <int N, class F>
__device__ __forceinline__ void for_each_index(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

// A lane's run of one key group of one token: RunBits = group·Bits/4 bits (16 or a
// multiple of 32) → GK/8 fp16 pairs, two codes of the same token each.
//   pair r = (code lo(r), code hi(r)) of the run, both scaled by 2^(exp(r) + kCodeExp)
template <int Bits, int RunBits>
struct KeyRun {
  static_assert(RunBits == 16 || RunBits % 32 == 0, "kvq: key runs are 16 bits or whole words");
  static constexpr int kPairs = RunBits / Bits / 2;
  static constexpr int kPerWord = 16 / Bits;  // pairs per 32-bit word
  KVQ_HOST_DEVICE static constexpr int lo(int r) {
    return RunBits == 16 ? r : (r / kPerWord) * (32 / Bits) + r % kPerWord;
  }
  KVQ_HOST_DEVICE static constexpr int hi(int r) { return RunBits == 16 ? 8 / Bits + r : lo(r) + 16 / Bits; }
  KVQ_HOST_DEVICE static constexpr int exp(int r) { return RunBits == 16 ? r * Bits : code_exp<Bits>(r % kPerWord); }

  __device__ static void unpack(const std::byte* run, unsigned (&u)[kPairs]) {
    unsigned w[RunBits < 32 ? 1 : RunBits / 32];
    load_run<RunBits / 8>(run, w);
    if constexpr (RunBits == 16) {
      // bytes (b0, b1) → halves (b0, b1): code j of each byte at bit j·Bits ≤ 6
      const unsigned x = warp::byte_perm(w[0], 0u, 0x4140u);
      for_each_index<kPairs>(
          [&](auto r) { u[decltype(r)::value] = code_pair<Bits, decltype(r)::value>(x, x); });
    } else {
#pragma unroll
      for (int q = 0; q < RunBits / 32; ++q) {
        const unsigned w6 = w[q] >> 6;
        for_each_index<kPerWord>([&](auto j) {
          constexpr int J = decltype(j)::value;
          u[q * kPerWord + J] = code_pair<Bits, J>(w[q], w6);
        });
      }
    }
  }
};

// A lane's run of one value group for two tokens a, b: RunBits = group·Bits/8 bits (16 or
// a multiple of 32) → group/8 fp16 pairs (code(r) of token a, code(r) of token b)·2^(exp(r) + kCodeExp).
template <int Bits, int RunBits>
struct ValueRun {
  static_assert(RunBits == 16 || RunBits % 32 == 0, "kvq: value runs are 16 bits or whole words");
  static constexpr int kPairs = RunBits / Bits;
  static constexpr int kPerHalf = 16 / Bits;
  KVQ_HOST_DEVICE static constexpr int code(int r) { return r; }  // halves in order, codes j in order
  KVQ_HOST_DEVICE static constexpr int exp(int r) { return code_exp<Bits>(r % kPerHalf); }

  // (token a, token b) halves interleaved: PRMT picks the low or high halves of both.
  __device__ static void unpack(const std::byte* run_a, const std::byte* run_b, unsigned (&u)[kPairs]) {
    unsigned wa[RunBits < 32 ? 1 : RunBits / 32], wb[RunBits < 32 ? 1 : RunBits / 32];
    load_run<RunBits / 8>(run_a, wa);
    load_run<RunBits / 8>(run_b, wb);
#pragma unroll
    for (int h = 0; h < RunBits / 16; ++h) {
      const int q = h / 2;
      const unsigned x = warp::byte_perm(wa[q], wb[q], h % 2 ? 0x7632u : 0x5410u), x6 = x >> 6;
      for_each_index<kPerHalf>([&](auto j) {
        constexpr int J = decltype(j)::value;
        u[h * kPerHalf + J] = code_pair<Bits, J>(x, x6);
      });
    }
  }
};

// ---- the products of one cache type ------------------------------------------------------
//
// Fragment index conventions (g = lane / 4, t = lane % 4), per 16-token m-tile:
//   s[i]      logit / probability of token g + 8·(i / 2), row 2t + i % 2
//   o[md][i]  output of dim slot (md, g + 8·(i / 2)), row 2t + i % 2 (dim_of maps slots)
//   olo[j][gv] Σ p·lo_v of row 2t + j, value group gv, over this lane's tokens
template <class Src>
struct MmaOps {
  static constexpr bool kOk = false;
};

// Quantized pages.
template <Policy P>
struct MmaOps<QuantSource<P>> {
  using Src = QuantSource<P>;
  using Operand = half_t;
  static constexpr int D = P.head_dim, NK = Src::NK, GK = P.key.group, GV = P.value.group, NV = D / GV;
  static constexpr bool kOk = kTensorCoreDecode<P>;
  static constexpr int KSG = GK / 16;               // k-steps per key group
  static constexpr int MPG = GV / 16;               // value m-tiles per value group
  static constexpr int kKeyRunBytes = GK * P.key.bits / 32;    // per lane, group, token
  static constexpr int kValueRunBytes = GV * P.value.bits / 64;
  using KR = KeyRun<P.key.bits, kKeyRunBytes * 8>;
  using VR = ValueRun<P.value.bits, kValueRunBytes * 8>;
  static constexpr StageLayout kKeyLayout = StageLayout::linear, kValueLayout = StageLayout::linear;
  static constexpr bool kZeroMissingValues = false;  // codes are finite; zero weights are skipped
  static constexpr int kUnitExp = kCodeExp;  // logits and Oᵀ come out scaled by 2^kUnitExp

  // Head dim and power-of-two exponent of element i (0: b[0] low, 1: b[0] high, 2: b[1]
  // low, 3: b[1] high) of the Q' fragment of k-step ks for lane quarter t.
  __device__ static int key_dim(int ks, int t, int i, int& e) {
    const int grp = ks / KSG, r = 2 * (ks % KSG) + i / 2;
    e = KR::exp(r);
    return grp * GK + t * (GK / 4) + (i % 2 ? KR::hi(r) : KR::lo(r));
  }
  // Head dim and exponent of output slot (md, g + 8·top).
  __device__ static int value_dim(int md, int g, int top, int& e) {
    const int gv = md / MPG, r = 2 * (md % MPG) + top;
    e = VR::exp(r);
    return gv * GV + g * (GV / 8) + VR::code(r);
  }
  __device__ static int value_group(int dim) { return dim / GV; }

  // Largest |s_v| over the value groups of staged token `tok`.
  __device__ static float value_scale(const std::byte* vm, int tok) {
    const auto* meta = reinterpret_cast<const meta_storage_t<P.value.meta>*>(vm + std::size_t(tok) * Src::vmb);
    float m = 0.f;
#pragma unroll
    for (int gv = 0; gv < NV; ++gv) m = fmaxf(m, fabsf(meta_fast<P.value.meta>(meta[2 * gv])));
    return m;
  }

  // s += (Σ_groups s_g·(C_g·Q'_gᵀ) + lo_g·Σq'_g)·qup for m-tile `mt`, scaled by
  // 2^kUnitExp (C_g: the codes as subnormals); qf_s: Q' fragments [KS][Splits][32] uint2;
  // qsum: Σq'_g·2^kUnitExp/qup of rows 2t, 2t+1.
  template <int Splits>
  __device__ static void logits(const std::byte* kc, const std::byte* km, int mt, const uint2* qf_s,
                                const float (&qsum)[2][NK], float qup, float (&s)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ta = 16 * mt + g, tb = ta + 8;
    const auto* ma = reinterpret_cast<const meta_storage_t<P.key.meta>*>(km + std::size_t(ta) * Src::kmb);
    const auto* mb = reinterpret_cast<const meta_storage_t<P.key.meta>*>(km + std::size_t(tb) * Src::kmb);
#pragma unroll
    for (int grp = 0; grp < NK; ++grp) {
      const std::size_t off = std::size_t(grp) * (GK * P.key.bits / 8) + t * kKeyRunBytes;
      unsigned ua[KR::kPairs], ub[KR::kPairs];
      KR::unpack(kc + std::size_t(ta) * Src::kcb + off, ua);
      KR::unpack(kc + std::size_t(tb) * Src::kcb + off, ub);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < KSG; ++k) {
        const unsigned a[4] = {ua[2 * k], ub[2 * k], ua[2 * k + 1], ub[2 * k + 1]};
#pragma unroll
        for (int p = 0; p < Splits; ++p) {
          const uint2 q = qf_s[((grp * KSG + k) * Splits + p) * 32 + lane];
          const unsigned b[2] = {q.x, q.y};
          warp::mma_16816<Operand>(acc, a, b);
        }
      }
      const float sa = meta_fast<P.key.meta>(ma[2 * grp]), la = meta_fast<P.key.meta>(ma[2 * grp + 1]);
      const float sb = meta_fast<P.key.meta>(mb[2 * grp]), lb = meta_fast<P.key.meta>(mb[2 * grp + 1]);
      s[0] = fmaf(sa, acc[0], fmaf(la, qsum[0][grp], s[0]));
      s[1] = fmaf(sa, acc[1], fmaf(la, qsum[1][grp], s[1]));
      s[2] = fmaf(sb, acc[2], fmaf(lb, qsum[0][grp], s[2]));
      s[3] = fmaf(sb, acc[3], fmaf(lb, qsum[1][grp], s[3]));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] *= qup;  // a power of two: the same roundings as scaling each term
  }

  // Oᵀ += C_vᵀ·(P ⊙ s_v·xscale)ᵀ, olo += P·lo_v, for m-tile `mt`.
  template <int Splits>
  __device__ static void values(const std::byte* vc, const std::byte* vm, int mt, const float (&p)[4], float xscale,
                                float (&o)[D / 16][4], float (&olo)[2][NV]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ta = 16 * mt + g, tb = ta + 8;
    const auto* ma = reinterpret_cast<const meta_storage_t<P.value.meta>*>(vm + std::size_t(ta) * Src::vmb);
    const auto* mb = reinterpret_cast<const meta_storage_t<P.value.meta>*>(vm + std::size_t(tb) * Src::vmb);
    const std::byte* v0 = vc + std::size_t(16 * mt + 2 * t) * Src::vcb;  // tokens 2t, 2t+1, 2t+8, 2t+9
#pragma unroll
    for (int gv = 0; gv < NV; ++gv) {
      const float sa = meta_fast<P.value.meta>(ma[2 * gv]), la = meta_fast<P.value.meta>(ma[2 * gv + 1]);
      const float sb = meta_fast<P.value.meta>(mb[2 * gv]), lb = meta_fast<P.value.meta>(mb[2 * gv + 1]);
      // A zero weight contributes nothing, whatever the (possibly NaN) metadata. xscale is
      // a power of two (2^pexp), so p·(s·xscale) is (p·s)·xscale but at the ends of fp32's
      // range: one product per token instead of one per weight.
      const float sxa = sa * xscale, sxb = sb * xscale;
      const float x0 = p[0] != 0.f ? p[0] * sxa : 0.f, x1 = p[1] != 0.f ? p[1] * sxa : 0.f;
      const float x2 = p[2] != 0.f ? p[2] * sxb : 0.f, x3 = p[3] != 0.f ? p[3] * sxb : 0.f;
      olo[0][gv] += (p[0] != 0.f ? p[0] * la : 0.f) + (p[2] != 0.f ? p[2] * lb : 0.f);
      olo[1][gv] += (p[1] != 0.f ? p[1] * la : 0.f) + (p[3] != 0.f ? p[3] * lb : 0.f);
      unsigned xa[Splits], xb[Splits];
      warp::split_pack2<Operand, Splits>(x0, x1, xa);
      warp::split_pack2<Operand, Splits>(x2, x3, xb);
      unsigned b[Splits][2];
#pragma unroll
      for (int k = 0; k < Splits; ++k) b[k][0] = warp::transpose_8x8(xa[k]), b[k][1] = warp::transpose_8x8(xb[k]);
      const std::size_t off = std::size_t(gv) * (GV * P.value.bits / 8) + g * kValueRunBytes;
      unsigned va[VR::kPairs], vb[VR::kPairs];
      VR::unpack(v0 + off, v0 + Src::vcb + off, va);
      VR::unpack(v0 + 8 * Src::vcb + off, v0 + 9 * Src::vcb + off, vb);
#pragma unroll
      for (int k = 0; k < MPG; ++k) {
        const unsigned a[4] = {va[2 * k], va[2 * k + 1], vb[2 * k], vb[2 * k + 1]};
#pragma unroll
        for (int sp = 0; sp < Splits; ++sp) warp::mma_16816<Operand>(o[gv * MPG + k], a, b[sp]);
      }
    }
  }
};

// 16-bit pages (fp16 or bf16 rows, DenseSource): K and V enter the MMAs as stored.
template <ActivationType T, int HD>
struct MmaOps<DenseSource<T, HD>> {
  using Src = DenseSource<T, HD>;
  using Operand = T;
  static constexpr int D = HD, NK = 1, NV = 1;
  static constexpr bool kOk = kTensorCoreDenseDecode<T, HD>;
  static constexpr StageLayout kKeyLayout = StageLayout::swizzled, kValueLayout = StageLayout::swizzled;
  static constexpr bool kZeroMissingValues = true;

  __device__ static int key_dim(int ks, int t, int i, int& e) {
    e = 0;
    return 16 * ks + 2 * t + 8 * (i / 2) + i % 2;
  }
  __device__ static int value_dim(int md, int g, int top, int& e) {
    e = 0;
    return 16 * md + g + 8 * top;
  }
  __device__ static int value_group(int) { return 0; }
  __device__ static float value_scale(const std::byte*, int) { return 1.f; }
  static constexpr int kUnitExp = 0;

  // Row `tok`'s 16-byte chunk c in the swizzled stage.
  __device__ static const std::byte* chunk(const std::byte* base, int tok, int c) {
    return base + std::size_t(tok) * Src::kcb + ((c ^ (tok & 7)) * 16);
  }

  template <int Splits>
  __device__ static void logits(const std::byte* kc, const std::byte*, int mt, const uint2* qf_s,
                                const float (&)[2][NK], float qup, float (&s)[4]) {
    const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    const int tok = 16 * mt + (i & 1) * 8 + r;  // ldmatrix row of this lane: a[0..3] = (tok 0-7 | 8-15) × (k 0-7 | 8-15)
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      unsigned a[4];
      warp::load_matrix_x4<false>(chunk(kc, tok, 2 * ks + (i >> 1)), a);
#pragma unroll
      for (int p = 0; p < Splits; ++p) {
        const uint2 q = qf_s[(ks * Splits + p) * 32 + lane];
        const unsigned b[2] = {q.x, q.y};
        warp::mma_16816<Operand>(acc, a, b);
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] += acc[k] * qup;
  }

  // Oᵀ += Vᵀ·(P·xscale)ᵀ; tokens not loaded in this tile were zero-filled.
  template <int Splits>
  __device__ static void values(const std::byte* vc, const std::byte*, int mt, const float (&p)[4], float xscale,
                                float (&o)[D / 16][4], float (&)[2][NV]) {
    const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    unsigned xa[Splits], xb[Splits];
    warp::split_pack2<Operand, Splits>(p[0] * xscale, p[1] * xscale, xa);
    warp::split_pack2<Operand, Splits>(p[2] * xscale, p[3] * xscale, xb);
    unsigned b[Splits][2];
#pragma unroll
    for (int k = 0; k < Splits; ++k) b[k][0] = warp::transpose_8x8(xa[k]), b[k][1] = warp::transpose_8x8(xb[k]);
    const int tok = 16 * mt + (i >> 1) * 8 + r;  // a[0..3] = (dims 0-7 | 8-15) × (tok 0-7 | 8-15), transposed
#pragma unroll
    for (int md = 0; md < D / 16; ++md) {
      unsigned a[4];
      warp::load_matrix_x4<true>(chunk(vc, tok, 2 * md + (i & 1)), a);
#pragma unroll
      for (int sp = 0; sp < Splits; ++sp) warp::mma_16816<Operand>(o[md], a, b[sp]);
    }
  }
};

// Warps per CTA and cp.async stages per warp of the tensor-core kernel; 0 takes
// MmaDecodeConfig's default. The launchers use the default; other pipelines exist for
// benchmark sweeps (cuda::tuning in launch/launch.cuh) that choose the default by
// measurement.
template <int Warps = 0, int Stages = 0>
struct MmaPipeline {
  static_assert(Warps == 0 || Warps == 1 || Warps == 2 || Warps == 4, "kvq: 1, 2 or 4 warps per CTA");
  static_assert(Stages == 0 || (Stages >= 2 && Stages <= 4), "kvq: 2 to 4 pipeline stages");
  static constexpr int warps = Warps, stages = Stages;
};

template <class Src, class Pipeline = MmaPipeline<>>
struct MmaDecodeConfig {
  using Ops = MmaOps<Src>;
  static_assert(Ops::kOk, "kvq: no tensor-core decode kernel for this cache type (MmaOps<Src>::kOk)");
  static constexpr int D = Src::D, R = kMmaRows, KS = D / 16;
  static constexpr std::size_t kTileBytes = std::size_t(Src::kcb + Src::kmb + Src::vcb + Src::vmb) * kWarpTokens;
  // Warps and pipeline stages by default: the deepest pipeline whose staging stays
  // ≤ 64 KiB per CTA (three CTAs per SM), preferring 4 warps.
  static constexpr int kDefaultWarps = 3 * 4 * kTileBytes <= 65536   ? 4
                                       : 2 * 4 * kTileBytes <= 65536 ? 4
                                       : 2 * 2 * kTileBytes <= 65536 ? 2
                                                                     : 1;
  static constexpr int NW = Pipeline::warps ? Pipeline::warps : kDefaultWarps;
  static constexpr int NS = Pipeline::stages ? Pipeline::stages : 3 * NW * kTileBytes <= 65536 ? 3 : 2;
  static constexpr int kMaxSplits = std::is_same_v<typename Ops::Operand, bfloat16_t> ? 3 : 2;
  // 16 warps per SM (≤ 128 registers) for d ≤ 128: left to itself ptxas gave K4V2 `exact`
  // 160 registers, 3 CTAs per SM, and 64 × 4K then ran in 1.3 waves. d 256, and 16-bit
  // pages in `exact` (up to 3 MMAs per product), would spill under that cap.
  static constexpr int min_ctas_per_sm(DecodePrecision p) {
    return D <= 128 && (Src::kmb > 0 || p == DecodePrecision::fast) ? 16 / NW : 1;
  }
  // Query fragments [KS][kMaxSplits][32 lanes] uint2, then the CTA's exponent of Q'
  // (int, 16 bytes).
  static constexpr std::size_t kQmaxOff = std::size_t(KS) * kMaxSplits * 32 * 8;
  static constexpr std::size_t kFragBytes = kQmaxOff + 16;
  static constexpr DecodeSmem smem{std::size_t(Src::kcb), std::size_t(Src::kmb), std::size_t(Src::vcb),
                                   std::size_t(Src::vmb), D, R, Src::NK, NW, kFragBytes, NS, false};
};

// Max over the 8 lanes of a lane quarter t (lanes t, t+4, …, t+28: the tokens of a row).
__device__ __forceinline__ float max_over_tokens(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x = warp::fmax_nan(x, __shfl_xor_sync(KVQ_FULL_MASK, x, off));
  return x;
}
__device__ __forceinline__ float sum_over_tokens(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x += __shfl_xor_sync(KVQ_FULL_MASK, x, off);
  return x;
}

// KP = DecodeKernelParams<Src, QT, OT> with MmaOps<Src>::kOk.
template <class KP, DecodePrecision kPrecision, class Pipeline = MmaPipeline<>>
__global__ void __launch_bounds__(MmaDecodeConfig<typename KP::source_type, Pipeline>::NW * 32,
                                  MmaDecodeConfig<typename KP::source_type, Pipeline>::min_ctas_per_sm(kPrecision))
    decode_mma_kernel(KP a) {
  using Src = typename KP::source_type;
  using Cfg = MmaDecodeConfig<Src, Pipeline>;
  using Ops = MmaOps<Src>;
  using Operand = typename Ops::Operand;
  constexpr bool kHalf = std::is_same_v<Operand, half_t>;
  constexpr int Splits = kPrecision == DecodePrecision::exact ? Cfg::kMaxSplits : 1;
  constexpr bool kQuant = Src::kmb > 0;
  constexpr int D = Src::D, R = Cfg::R, NW = Cfg::NW, NS = Cfg::NS, KS = Cfg::KS, NK = Src::NK, NV = Ops::NV;
  constexpr DecodeSmem S = Cfg::smem;
  std::byte* smem = reinterpret_cast<std::byte*>(kvq_decode_smem);
  float* q_s = reinterpret_cast<float*>(smem + S.q_off());
  float* qsum_s = reinterpret_cast<float*>(smem + S.qsum_off());
  float* shift_s = reinterpret_cast<float*>(smem + S.shift_off());
  int* limit_s = reinterpret_cast<int*>(smem + S.limit_off());
  uint2* qf_s = reinterpret_cast<uint2*>(smem + S.frag_off());
  int* qmax_s = reinterpret_cast<int*>(smem + S.frag_off() + Cfg::kQmaxOff);

  const int w = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  wait_for_prior_grids();  // queries, page table and cache may come from the previous kernels
  const RowTile tile = row_tile(a, R);
  if (tile.rows == 0) return;  // CTA-uniform

  // 1. This split's tokens: the first NS − 1 tiles of each warp's pipeline are issued
  //    before the query rows are prepared, so that their loads (and the page-table reads)
  //    overlap that preparation (at small batches a CTA streams only a few tiles).
  int tb, te;
  split_range(tile, a.num_splits, tb, te);
  // NS-stage pipeline over this warp's tiles t0 = tb + 32·w, step 32·NW (the stage
  // buffers lie apart from the query rows and fragments).
  auto stage = [&](int i) { return smem + S.stage_off(w, i); };
  PageAhead ahead;
  ahead.start(a, tile, tb + 32 * w, te);
  auto issue = [&](int i, int t_begin) -> unsigned {
    return t_begin < te ? issue_tile<KP, Ops::kKeyLayout, Ops::kValueLayout, Ops::kZeroMissingValues>(
                              a, S, tile, stage(i), t_begin, te, ahead.take(a, tile, t_begin, 32 * NW, te))
                        : 0u;
  };
  warp::StageRing<NS> ring;
  ring.start(issue, tb + 32 * w, 32 * NW);

  // 2. Query rows, then the B fragments of Q' in the permuted head-dim order, scaled by
  //    2^-qexp so that max |Q'| lands in [2^13, 2^14) for fp16 operands (finite
  //    non-negative floats order like their bit patterns; bf16 has fp32's range).
  if (threadIdx.x == 0) *qmax_s = 0;
  prepare_rows<KP, R, NW>(a, tile, q_s, qsum_s, shift_s, limit_s);
  __syncthreads();
  if constexpr (kHalf) {
    float mx = 0.f;
    for (int i = threadIdx.x; i < R * D; i += NW * 32) mx = fmaxf(mx, fabsf(q_s[i]));
    mx = warp::max(mx);
    if (lane == 0 && mx == mx && mx <= 3.0e38f) atomicMax(qmax_s, __float_as_int(mx));
    __syncthreads();
  }
  const float qmax = __int_as_float(*qmax_s);
  const int qexp = kHalf && qmax > 0.f ? ilogbf(qmax) - 13 : 0;  // B = Q'·2^-qexp, S = (A·B)·2^qexp
  const float qup = ldexpf(1.f, qexp);
  for (int ks = w; ks < KS; ks += NW) {
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int e;
      const int dim = Ops::key_dim(ks, t, i, e);
      x[i] = ldexpf(q_s[g * D + dim], -qexp - e);
    }
    unsigned b0[Splits], b1[Splits];
    warp::split_pack2<Operand, Splits>(x[0], x[1], b0);
    warp::split_pack2<Operand, Splits>(x[2], x[3], b1);
#pragma unroll
    for (int p = 0; p < Splits; ++p) qf_s[(ks * Splits + p) * 32 + lane] = uint2{b0[p], b1[p]};
  }
  __syncthreads();

  // 3. The token loop. This lane's rows are 2t and 2t + 1.
  const int lim[2] = {limit_s[2 * t], limit_s[2 * t + 1]};
  // Tiles that are whole and visible to every real row need no masking. Padding rows
  // (B columns of zeros) are then left unmasked: their logits are 0 (or NaN with NaN key
  // metadata), and their state is never written.
  int lim_real = te;
#pragma unroll
  for (int r = 0; r < R; ++r) lim_real = r < tile.rows && limit_s[r] < lim_real ? limit_s[r] : lim_real;
  // The logits come out scaled by 2^kUnitExp (the codes' subnormal scale), so the
  // lo terms' Σq' take that scale too (exactly, unless a group's Σq' is below 2^-115 of
  // max |q'|), and the softmax multiplies differences by kUnit (an FFMA in place of the
  // FADD: the same single rounding of s − m).
  constexpr float kUnit = static_cast<float>(1u << -Ops::kUnitExp);
  float qsum[2][NK];
#pragma unroll
  for (int k = 0; k < NK; ++k)
    qsum[0][k] = ldexpf(qsum_s[(2 * t) * NK + k], Ops::kUnitExp - qexp),
    qsum[1][k] = ldexpf(qsum_s[(2 * t + 1) * NK + k], Ops::kUnitExp - qexp);

  float o[D / 16][4];  // Oᵀ fragments, units of 2^-pexp times the slot's 2^(−e − kUnitExp)
  float olo[2][NV];
  float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};
  // p·v operand p·s_v·2^pexp: quantized pages choose pexp per tile (below); fp16 pages
  // scale p ≤ 1 by 2^13 once; bf16 needs no scaling.
  int pexp = kQuant || !kHalf ? 0 : 13;
#pragma unroll
  for (int md = 0; md < D / 16; ++md) o[md][0] = o[md][1] = o[md][2] = o[md][3] = 0.f;
#pragma unroll
  for (int gv = 0; gv < NV; ++gv) olo[0][gv] = olo[1][gv] = 0.f;

  for (int t0 = tb + 32 * w; t0 < te; t0 += 32 * NW) {
    unsigned vcur = 0;
    const std::byte* st = stage(ring.next(issue, t0 + 32 * NW * (NS - 1), vcur));
    const std::byte* kc = st + S.kc_off();
    const std::byte* km = st + S.km_off();
    const std::byte* vc = st + S.vc_off();
    const std::byte* vm = st + S.vm_off();

    // q·k: s[mt][i] = logit of token 16·mt + g + 8·(i / 2), row 2t + i % 2.
    float s[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
      Ops::template logits<Splits>(kc, km, mt, qf_s, qsum, qup, s[mt]);
    }
    if (vcur != KVQ_FULL_MASK || t0 + 31 > lim_real) {  // warp-uniform
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = 16 * mt + g + 8 * (i / 2);
          if (!((vcur >> tok) & 1u) || t0 + tok > lim[i % 2]) s[mt][i] = neg_inf_f();
        }
    }

    // The p·v operand's exponent: the largest value scale of the tile times 2^pexp stays
    // in [2^11, 2^15), so fp16 keeps its precision for small scales and cannot overflow
    // (p ≤ 1) for large ones. pexp only moves when the tile leaves that range, to
    // 2^13 (clamped to ±60 so that the rescale of O stays finite): most tiles then
    // rescale nothing.
    float xscale = warp::pow2(pexp), rescale = 1.f;
    if constexpr (kQuant) {
      // Lane = token; value_scale is ≥ 0 and never NaN (fmaxf drops NaN scales).
      const float sc = (vcur >> lane) & 1u ? Ops::value_scale(vm, lane) : 0.f;
      const unsigned smax = warp::max_u32(__float_as_uint(sc));
      if (smax != 0u && smax < 0x7f800000u) {  // positive and finite
        const int e = static_cast<int>(smax >> 23) - 127;  // ilogb; fp32 subnormals read −127
        if (e + pexp < 11 || e + pexp > 14) {
          int e_new = 13 - e;
          e_new = e_new < -60 ? -60 : (e_new > 60 ? 60 : e_new);
          rescale = warp::pow2(e_new - pexp);
          xscale = warp::pow2(e_new);
          pexp = e_new;
        }
      }
    }

    // Online softmax (log₂ domain) on rows 2t, 2t + 1; a row's 32 tokens live in the
    // lanes t, t + 4, …, t + 28.
    float corr[2] = {1.f, 1.f};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = warp::fmax_nan(warp::fmax_nan(s[0][j], s[0][j + 2]), warp::fmax_nan(s[1][j], s[1][j + 2]));
      mx = max_over_tokens(mx);
      const float m_new = warp::fmax_nan(m[j], mx), m_new_units = m_new * kUnit;
      float sum = 0.f;
      // In true units: a maximum below −FLT_MAX is −∞ there, as on the CPU (no weight).
      if (m_new_units != neg_inf_f()) {
        corr[j] = warp::exp2_weight(fmaf(m[j], kUnit, -m_new_units));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int i = j; i < 4; i += 2) {
            s[mt][i] = warp::exp2_weight(fmaf(s[mt][i], kUnit, -m_new_units));
            sum += s[mt][i];
          }
      } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) s[mt][j] = s[mt][j + 2] = 0.f;
      }
      m[j] = m_new;
      l[j] = fmaf(l[j], corr[j], sum);
    }
    // Rescale the state only when some row's maximum or pexp moved (a warp-uniform test:
    // after the first tiles it rarely does).
    if (__ballot_sync(KVQ_FULL_MASK, corr[0] * rescale != 1.f || corr[1] * rescale != 1.f)) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float oc = corr[j] * rescale;
#pragma unroll
        for (int md = 0; md < D / 16; ++md) o[md][j] *= oc, o[md][j + 2] *= oc;
#pragma unroll
        for (int gv = 0; gv < NV; ++gv) olo[j][gv] *= corr[j];
      }
    }

    // p·v.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) Ops::template values<Splits>(vc, vm, mt, s[mt], xscale, o, olo);
    __syncwarp();
  }
  warp::copy_wait<0>();
  allow_dependent_grids();  // what is left is the merge of the warps (and splits)

  // 4. l and Σ p·lo are per-lane partials over the lane's tokens; Oᵀ is complete per warp.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l[j] = sum_over_tokens(l[j]);
#pragma unroll
    for (int gv = 0; gv < NV; ++gv) olo[j][gv] = sum_over_tokens(olo[j][gv]);
  }
  __syncwarp();
  __syncthreads();  // staging buffers are free from here on
  float* acc_m = reinterpret_cast<float*>(smem);  // [NW][R][D]
  float* m_m = acc_m + NW * R * D;                 // [NW][R]
  float* l_m = m_m + NW * R;                       // [NW][R]
#pragma unroll
  for (int md = 0; md < D / 16; ++md)
#pragma unroll
    for (int top = 0; top < 2; ++top) {
      int e;
      const int dim = Ops::value_dim(md, g, top, e), gv = Ops::value_group(dim);
      const float unit = ldexpf(1.f, -pexp - e - Ops::kUnitExp);
#pragma unroll
      for (int j = 0; j < 2; ++j) acc_m[(w * R + 2 * t + j) * D + dim] = fmaf(o[md][2 * top + j], unit, olo[j][gv]);
    }
  if (g == 0) {
    m_m[w * R + 2 * t] = m[0] * kUnit, m_m[w * R + 2 * t + 1] = m[1] * kUnit;
    l_m[w * R + 2 * t] = l[0], l_m[w * R + 2 * t + 1] = l[1];
  }
  __syncthreads();

  // 5. Normalize and write.
  write_rows<KP, R, NW, true>(a, tile, smem, q_s, shift_s);
}

}  // namespace kvq::cuda::kernel
