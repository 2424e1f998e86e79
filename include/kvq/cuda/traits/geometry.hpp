// kvq/cuda/traits/geometry.hpp — the work geometry the CUDA kernels and their launchers
// agree on: tokens per warp step, rows per CTA, warps per CTA, split-KV ranges and the
// split workspace layout. Plain C++ (constexpr, host and device), so the launch plan
// (kvq/cuda/launch/plan.hpp) and the kernels (kvq/cuda/kernel/) use the same numbers
// and g++ tests them on machines without a GPU.
#pragma once

#include <cstddef>

#include "kvq/core/config.hpp"

namespace kvq::cuda {

// Tokens one warp processes per step of the decode kernels (the CUDA-core kernel: one
// token per lane in the q·k phase; the tensor-core kernel: two 16-token m-tiles).
inline constexpr int kWarpTokens = 32;
// Rows per CTA of the tensor-core decode kernel: the N = 8 of m16n8k16 (tokens are M).
inline constexpr int kMmaRows = 8;
// Elementwise kernels (append, dequantize, rotate, merge): warps per block, one warp
// per row item.
inline constexpr int kRowWarpsPerBlock = 4;

// The append kernel's row items. A decode step appends few tokens, and a warp's work is
// a chain of dependent loads and reductions: below kAppendSplitBelow token·heads one warp
// quantizes a token's key row and another its value row (2 parts), side by side; above
// it one warp does both, which saves the second page lookup (a 16K-token prefill chunk
// appended 28% slower split, on the H200).
inline constexpr long long kAppendSplitBelow = 4096;
KVQ_HOST_DEVICE constexpr int append_parts(long long tokens, int num_kv_heads) {
  return tokens * num_kv_heads < kAppendSplitBelow ? 2 : 1;
}
KVQ_HOST_DEVICE constexpr long long append_items(long long tokens, int num_kv_heads, int parts) {
  return parts * tokens * num_kv_heads;
}

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

// Warps per decode CTA: each warp double-buffers its own 32-token tile, and the CTA's
// staging buffers are kept ≤ 64 KiB so that several CTAs fit one SM, where one warp's two
// stages allow it (else 1 warp: fp32 pages at d 256 stage 128 KiB).
KVQ_HOST_DEVICE constexpr int decode_warps(std::size_t bytes_per_token) {
  const std::size_t stage = bytes_per_token * kWarpTokens;
  if (2 * 4 * stage <= 65536) return 4;
  if (2 * 2 * stage <= 65536) return 2;
  return 1;
}

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

// Split-KV workspace (num_splits > 1), 256-byte aligned regions, rows = total_q × Hq:
//   arrivals    [kSplitCounters] u32    at byte 0: one per CTA tile (sequence × row tile ×
//               KV head, the tensor-core kernel: the last split CTA of a tile to arrive
//               merges the splits and resets its counter to zero)
//   partial o   [S][rows][D] fp32       at byte kSplitCounterBytes
//   partial lse [S][rows]    fp32       after it
// The counters have a fixed place and size whatever the call's shape, and both kernels
// keep their partials clear of them: so one workspace, zeroed once after allocation,
// serves calls of every shape and kernel (counters that followed the partials moved with
// total_q·Hq·S, and a later call of another shape found its counters in the floats of an
// earlier call's partials: its splits were never merged).
inline constexpr std::size_t kSplitCounters = 65536;  // tiles of one split call, at most
inline constexpr std::size_t kSplitCounterBytes = kSplitCounters * sizeof(unsigned);  // 256 KiB
KVQ_HOST_DEVICE constexpr std::size_t split_partial_o_bytes(int num_splits, std::size_t rows, int head_dim) {
  return align_up(std::size_t(num_splits) * rows * std::size_t(head_dim) * 4, 256);
}
KVQ_HOST_DEVICE constexpr std::size_t split_partial_lse_bytes(int num_splits, std::size_t rows) {
  return align_up(std::size_t(num_splits) * rows * 4, 256);
}

}  // namespace kvq::cuda
