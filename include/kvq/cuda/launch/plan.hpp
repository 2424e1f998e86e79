// kvq/cuda/launch/plan.hpp — launch arithmetic of the CUDA kernels, in plain C++.
//
// Everything a launcher decides on the host (kernel, rows per CTA, grid, workspace size)
// is a constexpr/inline function here, so it is tested with g++ on machines without a
// GPU. The numbers the kernels must agree with (tile geometry, split ranges, workspace
// layout, shared memory) live in kvq/cuda/traits/, which kernels and launchers both
// include. No CUDA header is needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/core/config.hpp"
#include "kvq/core/status.hpp"
#include "kvq/cuda/traits/geometry.hpp"

namespace kvq::cuda {

// Query rows (query tokens × query heads of one KV head) a decode CTA may hold.
inline constexpr int kRowOptions[] = {4, 8, 16};

// Rows per CTA for a GQA group and the longest query run of a sequence: the smallest
// option that covers all rows of a (sequence, KV head), else the largest allowed.
inline constexpr int choose_rows_per_cta(int head_dim, int group, int max_q_per_seq) {
  const long long need = static_cast<long long>(group) * (max_q_per_seq < 1 ? 1 : max_q_per_seq);
  const int cap = max_rows_per_cta(head_dim);
  int best = 0;
  for (int r : kRowOptions) {
    if (r > cap) break;
    best = r;
    if (r >= need) break;
  }
  return best;
}

// Which decode kernel runs the q·k and p·v products.
//   simt        : fp32 CUDA cores, one token per lane (every policy, head_dim, metadata type)
//   tensor_core : mma.sync m16n8k16 with tokens in M and 8 query rows in N, codes
//                 unpacked exactly, the fp32 operands rounded to fp16 once or split
//                 (DecodePrecision, kernel/decode_mma.cuh); for quantized caches whose
//                 groups give each lane ≥ 16 bits (every preset) and fp16/bf16 caches,
//                 sm_80+ (kvq/cuda/traits/tensor_core.hpp)
//   automatic   : tensor_core where the cache type has one and the device runs it (the
//                 launchers ask the driver which code the device runs for it: a device
//                 below sm_80, or one that runs a JIT of PTX older than compute_80, takes
//                 simt), else simt; simt also for split calls whose tiles exceed the
//                 kSplitCounters arrival counters. Measured on an H200
//                 (benchmarks/gpu_check.sh, 2026-12-04): the tensor-core kernel was the faster
//                 one at every shape from 1×4K to 64×32K, in both precisions and for fp16
//                 and bf16 pages
enum class DecodeKernel { automatic, simt, tensor_core };

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
  // The device runs that kernel's mma code: the code it runs was compiled for compute_80
  // or newer. The launchers ask the driver (cudaFuncGetAttributes' ptxVersion); planning
  // on the host alone (decode_workspace_bytes, an engine's own plan) assumes it does,
  // which changes no workspace size: both kernels take the same.
  bool tensor_core_runs = true;
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct DecodePlan {
  DecodeKernel kernel = DecodeKernel::simt;  // resolved: simt or tensor_core
  int rows = 0;       // query rows per CTA
  int row_tiles = 0;  // CTAs per (sequence, KV head, split)
  Dim3 grid{};        // x: batch × row_tiles, y: KV heads, z: splits
  Dim3 merge_grid{};  // split merge kernel: one warp per (query row, query head); x = 0
                      // when the decode kernel merges its splits itself (tensor_core)
  int merge_block = 128;
  // The split workspace (geometry.hpp), in this order: the arrival counters (used by the
  // tensor-core kernel, kept clear by both), partial o [S][total_q][Hq][D] fp32, partial
  // lse [S][total_q][Hq] fp32.
  std::size_t counter_bytes = 0;
  std::size_t partial_o_bytes = 0;
  std::size_t partial_lse_bytes = 0;
  std::size_t workspace_bytes() const { return counter_bytes + partial_o_bytes + partial_lse_bytes; }
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
  KVQ_CHECK_ARG(s.kernel == DecodeKernel::automatic || s.kernel == DecodeKernel::simt ||
                    s.kernel == DecodeKernel::tensor_core,
                invalid_argument, "decode plan: unknown DecodeKernel value");
  KVQ_CHECK_ARG(s.kernel != DecodeKernel::tensor_core || s.tensor_core_ok, unsupported,
                "decode plan: no tensor-core kernel for this cache (it serves quantized policies with "
                "key group x bits >= 64 and value group x bits >= 128, and fp16/bf16 caches)");
  KVQ_CHECK_ARG(s.kernel != DecodeKernel::tensor_core || !s.tensor_core_ok || s.tensor_core_runs, unsupported,
                "decode plan: the device runs the tensor-core kernel from code compiled for below sm_80 (an older "
                "device, or a JIT of older PTX), where mma.sync m16n8k16 does not exist: use DecodeKernel::simt "
                "or DecodeKernel::automatic, or build for this device");
  const int group = s.num_qo_heads / s.num_kv_heads;
  // A sequence's query run never exceeds total_q: a looser bound would only add CTAs.
  const int q_cap = s.total_q > 1 ? s.total_q : 1;
  const int max_q = s.max_q_per_seq < q_cap ? s.max_q_per_seq : q_cap;
  auto row_tiles_of = [&](int rows) { return (static_cast<long long>(group) * max_q + rows - 1) / rows; };
  // The tensor-core kernel merges splits with one arrival counter per (sequence, row
  // tile, KV head) tile, kSplitCounters at most: past them `automatic` takes the CUDA-core
  // kernel (such grids fill the GPU unsplit anyway), an explicit tensor_core is refused.
  const long long mma_row_tiles = row_tiles_of(kMmaRows);
  const long long counters = static_cast<long long>(kSplitCounters);
  const bool counters_ok = s.num_splits == 1 || (mma_row_tiles <= counters && s.batch <= counters / mma_row_tiles &&
                                                 s.batch * mma_row_tiles * s.num_kv_heads <= counters);
  KVQ_CHECK_ARG(s.kernel != DecodeKernel::tensor_core || counters_ok, invalid_argument,
                "decode plan: num_splits > 1 with the tensor-core kernel takes at most " + std::to_string(counters) +
                    " (sequence, row tile, KV head) tiles (use num_splits = 1: such grids fill the GPU)");
  const bool simt = s.kernel == DecodeKernel::simt ||
                    (s.kernel == DecodeKernel::automatic && (!s.tensor_core_ok || !s.tensor_core_runs || !counters_ok));
  plan.kernel = simt ? DecodeKernel::simt : DecodeKernel::tensor_core;
  plan.rows = plan.kernel == DecodeKernel::tensor_core ? kMmaRows : choose_rows_per_cta(s.head_dim, group, max_q);
  const long long row_tiles = row_tiles_of(plan.rows);
  const long long x = static_cast<long long>(s.batch) * row_tiles;
  KVQ_CHECK_ARG(x < (1ll << 31), invalid_argument, "decode plan: batch × row tiles exceeds the grid limit");
  plan.row_tiles = static_cast<int>(row_tiles);
  plan.grid = {static_cast<unsigned>(x), static_cast<unsigned>(s.num_kv_heads), static_cast<unsigned>(s.num_splits)};
  const std::size_t rows_total = std::size_t(s.total_q) * s.num_qo_heads;
  plan.partial_o_bytes = plan.partial_lse_bytes = plan.counter_bytes = 0;
  plan.merge_grid = {0, 1, 1};
  if (s.num_splits > 1) {
    plan.counter_bytes = kSplitCounterBytes;
    plan.partial_o_bytes = split_partial_o_bytes(s.num_splits, rows_total, s.head_dim);
    plan.partial_lse_bytes = split_partial_lse_bytes(s.num_splits, rows_total);
    if (plan.kernel != DecodeKernel::tensor_core) {
      const std::size_t warps_per_block = plan.merge_block / 32;
      const std::size_t blocks = (rows_total + warps_per_block - 1) / warps_per_block;
      KVQ_CHECK_ARG(blocks < (1ull << 31), invalid_argument, "decode plan: too many rows for the merge grid");
      plan.merge_grid = {static_cast<unsigned>(blocks), 1, 1};
    }
  }
  return {};
}

// A split factor by FlashAttention-2's wave rule: a wave is num_sms × ctas_per_sm
// resident CTAs (decode_ctas_per_sm), a grid's wave efficiency is CTAs / (whole waves ×
// wave). A grid at 80% or more without splits gets none; otherwise the smallest factor
// within 85% of the best efficiency, with every split at least `min_tokens_per_split`
// keys of the longest sequence (and at most 256 splits). Unlike FA2 this also splits
// grids of more than one wave: 64 × 8 CTAs of fp16 pages on 132 SMs × 3 fill 1.3 waves
// (65%); two splits fill 2.6 (86%).
inline int suggest_num_splits(int batch, int num_kv_heads, int row_tiles, int max_seq_len, int num_sms,
                              int min_tokens_per_split = 256, int ctas_per_sm = 1) {
  const long long base = static_cast<long long>(batch) * num_kv_heads * (row_tiles < 1 ? 1 : row_tiles);
  if (base <= 0 || max_seq_len <= 0 || num_sms <= 0) return 1;
  const long long wave = static_cast<long long>(num_sms) * (ctas_per_sm < 1 ? 1 : ctas_per_sm);
  auto efficiency = [&](long long s) {
    const long long ctas = base * s, waves = (ctas + wave - 1) / wave;
    return double(ctas) / double(waves * wave);
  };
  if (efficiency(1) >= 0.8) return 1;
  long long cap = max_seq_len / (min_tokens_per_split < 1 ? 1 : min_tokens_per_split);
  cap = cap < 1 ? 1 : (cap > 256 ? 256 : cap);
  double best = 0;
  for (long long s = 1; s <= cap; ++s) best = efficiency(s) > best ? efficiency(s) : best;
  for (long long s = 1; s <= cap; ++s)
    if (efficiency(s) >= 0.85 * best) return static_cast<int>(s);
  return 1;
}

// Grid of the elementwise kernels (append, dequantize, rotate, merge): one warp per row
// item, kRowWarpsPerBlock warps per block.
inline Dim3 row_grid(long long items) {
  const long long blocks = (items + kRowWarpsPerBlock - 1) / kRowWarpsPerBlock;
  return {static_cast<unsigned>(blocks), 1, 1};
}

}  // namespace kvq::cuda
