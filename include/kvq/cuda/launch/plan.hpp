// kvq/cuda/launch/plan.hpp — launch arithmetic of the CUDA kernels, in plain C++.
//
// Everything a launcher decides on the host (rows per CTA, grid, split chunking,
// shared-memory layout, workspace size) is a constexpr/inline function here, so it is
// tested with g++ on machines without a GPU and the kernels use the very same numbers.
// No CUDA header is needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/core/config.hpp"
#include "kvq/core/status.hpp"

namespace kvq::cuda {

// Tokens one warp processes per step of the decode kernels (one token per lane in the
// q·k phase).
inline constexpr int kWarpTokens = 32;
// Query rows (query tokens × query heads of one KV head) a decode CTA may hold.
inline constexpr int kRowOptions[] = {4, 8, 16};

KVQ_HOST_DEVICE constexpr std::size_t align_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
KVQ_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The largest row count whose fp32 value accumulators fit a lane's register budget
// (rows × dims-per-lane ≤ 64, with at least head_dim/32 dims per lane).
KVQ_HOST_DEVICE constexpr int max_rows_per_cta(int head_dim) {
  const int r = 2048 / head_dim;
  return r > 16 ? 16 : r;
}

// Value dimensions one lane accumulates in the p·v phase.
KVQ_HOST_DEVICE constexpr int value_dims_per_lane(int head_dim, int rows) {
  const int min_dims = head_dim / 32;
  int d = 64 / rows;
  if (d > 8) d = 8;
  return d < min_dims ? min_dims : d;
}

// Rows per CTA for a GQA group and the longest query run of a sequence: the smallest
// option that covers all rows of a (sequence, KV head), else the largest allowed.
inline constexpr int choose_rows_per_cta(int head_dim, int group, int max_q_per_seq) {
  const int need = group * (max_q_per_seq < 1 ? 1 : max_q_per_seq);
  const int cap = max_rows_per_cta(head_dim);
  int best = 0;
  for (int r : kRowOptions) {
    if (r > cap) break;
    best = r;
    if (r >= need) break;
  }
  return best;
}

// Warps per decode CTA: each warp double-buffers its own 32-token tile, and the CTA's
// staging buffers are kept ≤ 64 KiB so that several CTAs fit one SM.
KVQ_HOST_DEVICE constexpr int decode_warps(std::size_t bytes_per_token) {
  const std::size_t stage = bytes_per_token * kWarpTokens;
  if (2 * 4 * stage <= 65536) return 4;
  if (2 * 2 * stage <= 65536) return 2;
  return 1;
}

// Shared memory of a decode CTA, in bytes from the start of dynamic shared memory.
//   per warp, 2 stages of: K codes [Ck][32] 16-byte chunks, K meta [32][kmb],
//                          V codes [32][vcb], V meta [32][vmb]
//   per warp: p [32][R] fp32
//   per CTA : q' [R][D] fp32, Σq' per key group [R][NK] fp32, shift [R], limit [R],
//             then `frag_bytes` for the tensor-core kernel's query fragments
//   after the token loop the stage buffers are reused for the cross-warp merge:
//             acc [NW][R][D], m [NW][R], l [NW][R]
struct DecodeSmem {
  std::size_t kcb = 0, kmb = 0, vcb = 0, vmb = 0;  // bytes per token
  int head_dim = 128, rows = 8, key_groups = 1, warps = 4;
  std::size_t frag_bytes = 0;

  KVQ_HOST_DEVICE constexpr std::size_t kc_off() const { return 0; }
  KVQ_HOST_DEVICE constexpr std::size_t km_off() const { return kc_off() + align_up(kcb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t vc_off() const { return km_off() + align_up(kmb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t vm_off() const { return vc_off() + align_up(vcb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t stage_bytes() const { return vm_off() + align_up(vmb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t stage_off(int warp, int stage) const {
    return (std::size_t(warp) * 2 + stage) * stage_bytes();
  }
  KVQ_HOST_DEVICE constexpr std::size_t staging_bytes() const { return std::size_t(warps) * 2 * stage_bytes(); }
  KVQ_HOST_DEVICE constexpr std::size_t merge_bytes() const {
    return std::size_t(warps) * rows * (head_dim + 2) * 4;
  }
  KVQ_HOST_DEVICE constexpr std::size_t loop_bytes() const {
    return staging_bytes() > merge_bytes() ? staging_bytes() : merge_bytes();
  }
  KVQ_HOST_DEVICE constexpr std::size_t p_off(int warp) const {
    return align_up(loop_bytes(), 16) + std::size_t(warp) * kWarpTokens * rows * 4;
  }
  KVQ_HOST_DEVICE constexpr std::size_t q_off() const { return p_off(warps); }
  KVQ_HOST_DEVICE constexpr std::size_t qsum_off() const { return q_off() + std::size_t(rows) * head_dim * 4; }
  KVQ_HOST_DEVICE constexpr std::size_t shift_off() const {
    return qsum_off() + align_up(std::size_t(rows) * key_groups * 4, 16);
  }
  KVQ_HOST_DEVICE constexpr std::size_t limit_off() const { return shift_off() + align_up(std::size_t(rows) * 4, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t frag_off() const { return limit_off() + align_up(std::size_t(rows) * 4, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t total() const { return frag_off() + align_up(frag_bytes, 16); }
};

// Tokens [begin, end) of a sequence of length `len` that split `s` of `num_splits`
// covers. Chunks are multiples of the warp tile; trailing splits may be empty.
KVQ_HOST_DEVICE constexpr int split_chunk(int len, int num_splits) {
  const int c = (len + num_splits - 1) / num_splits;
  return (c + kWarpTokens - 1) / kWarpTokens * kWarpTokens;
}
KVQ_HOST_DEVICE constexpr int split_begin(int len, int num_splits, int s) {
  const long long b = static_cast<long long>(split_chunk(len, num_splits)) * s;
  return b > len ? len : static_cast<int>(b);
}
KVQ_HOST_DEVICE constexpr int split_end(int len, int num_splits, int s) {
  return split_begin(len, num_splits, s + 1);
}

// Which decode kernel runs the q·k and p·v products.
//   simt        : fp32 CUDA cores, one token per lane (every policy, head_dim, metadata type)
//   tensor_core : mma.sync m16n8k16 on fp16 fragments, codes unpacked exactly and the
//                 fp32 operands split into two fp16 halves (kernel/decode_mma.cuh); for
//                 quantized caches with fp16 metadata and fp16 caches, head_dim 64 or
//                 128, sm_80+
//   automatic   : simt, until the tensor-core kernel has been measured on hardware
enum class DecodeKernel { automatic, simt, tensor_core };

// Rows per CTA of the tensor-core kernel: one m16 tile.
inline constexpr int kMmaRows = 16;

// Host-visible shape of a decode call.
struct DecodeShape {
  int batch = 0;
  int num_kv_heads = 1;
  int num_qo_heads = 1;
  int total_q = 0;        // rows of q = q_indptr[batch]
  int max_q_per_seq = 1;  // ≥ q_indptr[b+1] − q_indptr[b] for every b
  int num_splits = 1;     // split-KV factor (flash-decoding); 1 = no merge pass
  int head_dim = 128;
  DecodeKernel kernel = DecodeKernel::automatic;
  bool tensor_core_ok = false;  // the cache type has a tensor-core kernel
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct DecodePlan {
  DecodeKernel kernel = DecodeKernel::simt;  // resolved: simt or tensor_core
  int rows = 0;       // query rows per CTA
  int row_tiles = 0;  // CTAs per (sequence, KV head, split)
  Dim3 grid{};        // x: batch × row_tiles, y: KV heads, z: splits
  Dim3 merge_grid{};  // split merge: one warp per (query row, query head)
  int merge_block = 128;
  std::size_t partial_o_bytes = 0;    // workspace: [S][total_q][Hq][D] fp32
  std::size_t partial_lse_bytes = 0;  // workspace: [S][total_q][Hq] fp32
  std::size_t workspace_bytes() const { return partial_o_bytes + partial_lse_bytes; }
};

inline Status make_decode_plan(const DecodeShape& s, DecodePlan& plan) {
  using enum StatusCode;
  KVQ_CHECK_ARG(s.batch >= 0 && s.total_q >= 0, invalid_argument, "decode plan: negative batch or total_q");
  KVQ_CHECK_ARG(s.num_kv_heads >= 1, invalid_argument, "decode plan: num_kv_heads must be >= 1");
  KVQ_CHECK_ARG(s.num_qo_heads >= 1 && s.num_qo_heads % s.num_kv_heads == 0, invalid_argument,
                "decode plan: num_qo_heads (" + std::to_string(s.num_qo_heads) +
                    ") must be a positive multiple of num_kv_heads (" + std::to_string(s.num_kv_heads) + ")");
  KVQ_CHECK_ARG(s.max_q_per_seq >= 1, invalid_argument, "decode plan: max_q_per_seq must be >= 1");
  KVQ_CHECK_ARG(s.num_splits >= 1 && s.num_splits <= 65535, invalid_argument,
                "decode plan: num_splits must be in [1, 65535]");
  KVQ_CHECK_ARG(s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256, unsupported,
                "decode plan: head_dim must be 64, 128 or 256");
  KVQ_CHECK_ARG(s.num_kv_heads <= 65535, invalid_argument, "decode plan: num_kv_heads must be <= 65535");
  KVQ_CHECK_ARG(s.kernel != DecodeKernel::tensor_core || s.tensor_core_ok, unsupported,
                "decode plan: no tensor-core kernel for this cache (it serves quantized policies with fp16 "
                "metadata and fp16 caches, head_dim 64 or 128)");
  const int group = s.num_qo_heads / s.num_kv_heads;
  plan.kernel = s.kernel == DecodeKernel::tensor_core ? DecodeKernel::tensor_core : DecodeKernel::simt;
  plan.rows = plan.kernel == DecodeKernel::tensor_core ? kMmaRows
                                                       : choose_rows_per_cta(s.head_dim, group, s.max_q_per_seq);
  plan.row_tiles = ceil_div(group * s.max_q_per_seq, plan.rows);
  const long long x = static_cast<long long>(s.batch) * plan.row_tiles;
  KVQ_CHECK_ARG(x < (1ll << 31), invalid_argument, "decode plan: batch × row tiles exceeds the grid limit");
  plan.grid = {static_cast<unsigned>(x), static_cast<unsigned>(s.num_kv_heads), static_cast<unsigned>(s.num_splits)};
  const std::size_t rows_total = std::size_t(s.total_q) * s.num_qo_heads;
  if (s.num_splits > 1) {
    plan.partial_o_bytes = align_up(std::size_t(s.num_splits) * rows_total * s.head_dim * 4, 256);
    plan.partial_lse_bytes = align_up(std::size_t(s.num_splits) * rows_total * 4, 256);
    const std::size_t warps_per_block = plan.merge_block / 32;
    const std::size_t blocks = (rows_total + warps_per_block - 1) / warps_per_block;
    KVQ_CHECK_ARG(blocks < (1ull << 31), invalid_argument, "decode plan: too many rows for the merge grid");
    plan.merge_grid = {static_cast<unsigned>(blocks), 1, 1};
  } else {
    plan.partial_o_bytes = plan.partial_lse_bytes = 0;
    plan.merge_grid = {0, 1, 1};
  }
  return {};
}

// A split factor that gives about two waves of CTAs on `num_sms` SMs while leaving
// every split at least `min_tokens_per_split` keys of the longest sequence.
inline int suggest_num_splits(int batch, int num_kv_heads, int row_tiles, int max_seq_len, int num_sms,
                              int min_tokens_per_split = 256) {
  const long long base = static_cast<long long>(batch) * num_kv_heads * (row_tiles < 1 ? 1 : row_tiles);
  if (base <= 0 || max_seq_len <= 0 || num_sms <= 0) return 1;
  const long long want = (2ll * num_sms + base - 1) / base;
  long long cap = max_seq_len / (min_tokens_per_split < 1 ? 1 : min_tokens_per_split);
  if (cap < 1) cap = 1;
  long long s = want < cap ? want : cap;
  if (s > 256) s = 256;
  return s < 1 ? 1 : static_cast<int>(s);
}

// Elementwise kernels (append, dequantize, rotate, merge): one warp per row item.
inline constexpr int kRowWarpsPerBlock = 4;
inline Dim3 row_grid(long long items) {
  const long long blocks = (items + kRowWarpsPerBlock - 1) / kRowWarpsPerBlock;
  return {static_cast<unsigned>(blocks), 1, 1};
}

}  // namespace kvq::cuda
