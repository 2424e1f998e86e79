// kvq/cuda/launch/api.hpp — the CUDA entry points: argument structs, host-side
// validation and launcher declarations, in plain C++.
//
// Engines include this header from any translation unit (g++ or nvcc) and link the
// translation units that kvq_add_instantiations() generates (they include
// kvq/cuda/launch/launch.cuh, which defines the launchers). Every pointer inside the
// argument structs is DEVICE memory; launchers never dereference them on the host, so
// validation covers what the host can see (null pointers, counts, shapes, workspace
// size). The kernels bounds-check every page index and position they read, each
// sequence's last_page_len and each decode sequence's q_indptr run, and skip what is out
// of range, reporting it in the optional `error_flags` device word. What they cannot see
// is the engine's to keep: arrays of the sizes stated, and indptr values within indices
// when the table leaves PageTableView::num_indices at −1 (given, the kernels check them too).
//
// Launchers take the engine's stream (kvq::cuda::Stream is cudaStream_t), allocate
// nothing, never synchronize, and return a Status (cuda_error for launch failures).
// `launch_with_pdl` (default off) launches with programmatic dependent launch where the
// code the device runs was compiled for sm_90 or newer (cudaFuncGetAttributes' ptxVersion,
// asked once per kernel and device; ignored otherwise, e.g. for a JIT of older PTX): the
// kernel may then start while the previous kernel in the stream still runs, and its
// launch and block scheduling overlap that kernel's tail. Every kvq kernel waits for the
// previous grid's completion before it reads global memory (kernel/grid_dependency.cuh),
// so any launcher may take it after any kernel; a kernel of the engine launched with PDL
// after a kvq one must itself wait (cudaGridDependencySynchronize) before reading kvq's
// outputs. Example, one decode step: append_kv(…, stream, true) then
// decode_attention(…, stream, true).
// CUDA graphs: the launchers may be captured (tests/cuda: CudaDependentLaunch). Run each
// launcher once before capturing, as engines warm up before they capture: the first launch
// of a kernel may load its module, and the first call with launch_with_pdl, or the first
// decode that plans the tensor-core kernel, per kernel and device asks the driver for the
// kernel's attributes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <string>

#include "kvq/core/decode_params.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"
#include "kvq/cuda/launch/plan.hpp"
#include "kvq/cuda/traits/device_error.hpp"
#include "kvq/cuda/traits/rotate_op.hpp"
#include "kvq/cuda/traits/tensor_core.hpp"
#include "kvq/layout/dense.hpp"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/params.hpp"

struct CUstream_st;

namespace kvq::cuda {

using Stream = CUstream_st*;  // the same type as cudaStream_t

// Every `error_flags` below is an optional device word the kernels OR DeviceError bits
// into (kvq/cuda/traits/device_error.hpp) when they skip an out-of-range item.

// Fused quantize-append.
//   keys, values  : [num_tokens, Hkv, D] of T (post-RoPE rows)
//   batch_indices : [num_tokens] sequence of each token
//   positions     : [num_tokens] position inside the sequence; the page table must
//                   already include it (the engine grows the table first)
// Token i of head h goes to page indices[indptr[b] + pos / P], slot pos % P, with
// codes and metadata bit-identical to kvq::append_kv (kvq/cache/append.hpp).
//   slot_mapping  : optional [num_tokens], vLLM's convention: token i goes to pool slot
//                   s = slot_mapping[i], i.e. page s / P, row s % P (P = the layout's page
//                   size); s < 0 skips the token (padding). When given, table,
//                   batch_indices and positions are not read, and a token costs one
//                   dependent load before its page is known instead of three. Slots
//                   must be distinct, as positions must (tokens that share one are
//                   written concurrently: their bytes may mix; the CPU append writes
//                   in token order). 8-byte aligned.
template <Policy P, ActivationType T>
struct AppendArgs {
  static constexpr Policy kPolicy = P;
  using value_type = T;
  PagedCacheView<P> cache{};
  PageTableView table{};
  const T* keys = nullptr;
  const T* values = nullptr;
  int num_tokens = 0;
  const std::int32_t* batch_indices = nullptr;
  const std::int32_t* positions = nullptr;
  RotationParams rotation{};
  unsigned* error_flags = nullptr;  // optional
  const std::int64_t* slot_mapping = nullptr;  // optional, see above
};

// Dequantize tokens back to rows in the ORIGINAL basis (inverse rotation, means added),
// bit-identical to kvq::dequantize_sequence for T = float.
//   keys, values : [num_tokens, Hkv, D] of T
template <Policy P, ActivationType T>
struct DequantizeArgs {
  static constexpr Policy kPolicy = P;
  using value_type = T;
  ConstPagedCacheView<P> cache{};
  PageTableView table{};
  int num_tokens = 0;
  const std::int32_t* batch_indices = nullptr;
  const std::int32_t* positions = nullptr;
  T* keys = nullptr;
  T* values = nullptr;
  RotationParams rotation{};
  unsigned* error_flags = nullptr;
};

// Standalone rotation of rows (RotateOp, kvq/cuda/traits/rotate_op.hpp).
//   in, out : [num_rows, num_heads, D] of T (out may alias in)
//   head j of a row uses KV head ⌊j / heads_per_kv_head⌋ of the rotation params, which
//   must hold num_heads / heads_per_kv_head KV heads (a multiple: checked)
template <Policy P, ActivationType T>
struct RotateArgs {
  static constexpr Policy kPolicy = P;
  using value_type = T;
  const T* in = nullptr;
  T* out = nullptr;
  int num_rows = 0;
  int num_heads = 1;
  int heads_per_kv_head = 1;
  RotateOp op = RotateOp::key;
  RotationParams rotation{};
};

// Quantized split-KV decode attention (DESIGN §4), same semantics as
// kvq::decode_attention: see DecodeParams for q/out/lse/causal_offset/rotated_output.
// Host-visible extras:
//   total_q       : q_indptr[batch] (rows of q/out/lse)
//   max_q_per_seq : an upper bound of q_indptr[b+1] − q_indptr[b]
//   num_splits    : split-KV factor; > 1 needs workspace (decode_workspace_bytes), zeroed
//                   once after allocation: the tensor-core kernel merges its splits in the
//                   kernel with arrival counters at its start, which every launch leaves
//                   zero and no call's partials overlap, so one workspace serves calls of
//                   every shape and kernel (one workspace per stream; launches that share
//                   it must not overlap). With splits, the tensor-core kernel takes at most
//                   kSplitCounters (65536) sequence × row tile × KV head tiles: past them
//                   `automatic` runs the CUDA-core kernel, an explicit tensor_core is refused
//   kernel        : simt or tensor_core (see DecodeKernel in plan.hpp); asking for
//                   tensor_core where kTensorCoreOk is false (which caches have one:
//                   kvq/cuda/traits/tensor_core.hpp), or where the device runs that
//                   kernel from code compiled for below sm_80, returns `unsupported`
//   precision     : operands of the tensor-core kernel, fast (default: fp16, the error
//                   class of fp16 SDPA, bound in kernel/decode_mma.cuh) or exact (hi/lo
//                   split, fp32-like); the CUDA-core kernel is fp32 either way (bf16 pages,
//                   DenseDecodeArgs: bf16 operands, u = 2⁻⁸; exact splits hi + mid + lo)
template <Policy P, ActivationType QT, ActivationType OT>
struct DecodeArgs {
  ConstPagedCacheView<P> cache{};
  PageTableView table{};
  DecodeParams<QT, OT> params{};
  RotationParams rotation{};
  int total_q = 0;
  int max_q_per_seq = 1;
  int num_splits = 1;
  void* workspace = nullptr;  // 256-byte aligned device memory
  std::size_t workspace_bytes = 0;
  unsigned* error_flags = nullptr;
  DecodeKernel kernel = DecodeKernel::automatic;
  DecodePrecision precision = DecodePrecision::fast;

  static constexpr bool kTensorCoreOk = kTensorCoreDecode<P>;

  DecodeShape shape() const {
    return {table.batch_size, cache.layout.num_kv_heads, params.num_qo_heads, total_q, max_q_per_seq, num_splits,
            P.head_dim, kernel, kTensorCoreOk};
  }
};

// Full-precision paged decode attention of the same design (windows, BF16 baseline).
template <ActivationType T, int D, ActivationType QT, ActivationType OT>
struct DenseDecodeArgs {
  const std::byte* pool = nullptr;
  int num_pages = 0;
  DensePageLayout<T, D> layout{};
  PageTableView table{};
  DecodeParams<QT, OT> params{};
  int total_q = 0;
  int max_q_per_seq = 1;
  int num_splits = 1;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  unsigned* error_flags = nullptr;
  DecodeKernel kernel = DecodeKernel::automatic;
  DecodePrecision precision = DecodePrecision::fast;  // as in DecodeArgs (bf16 pages: bf16 operands)

  static constexpr bool kTensorCoreOk = kTensorCoreDenseDecode<T, D>;

  DecodeShape shape() const {
    return {table.batch_size, layout.num_kv_heads, params.num_qo_heads, total_q, max_q_per_seq, num_splits, D,
            kernel, kTensorCoreOk};
  }
};

// ---- host-side validation (no device memory is read) ---------------------------------

namespace detail {
inline Status validate_table_shape(const PageTableView& t, int layout_page_size, const char* who) {
  using enum StatusCode;
  KVQ_CHECK_ARG(t.batch_size >= 0, invalid_argument, std::string(who) + ": negative batch_size");
  KVQ_CHECK_ARG(t.page_size >= 1, invalid_argument, std::string(who) + ": page_size must be >= 1");
  KVQ_CHECK_ARG(t.num_indices >= -1, invalid_argument,
                std::string(who) + ": page table num_indices must be >= 0, or -1 (unknown)");
  KVQ_CHECK_ARG(t.page_size == layout_page_size, invalid_argument,
                std::string(who) + ": page table page_size differs from the cache layout's");
  KVQ_CHECK_ARG(t.batch_size == 0 || (t.indptr && t.indices && t.last_page_len), invalid_argument,
                std::string(who) + ": page table arrays must not be null");
  return {};
}

// The decode kernels address inside a page with 32-bit offsets.
inline Status validate_page_bytes(std::size_t page_bytes, const char* who) {
  KVQ_CHECK_ARG(page_bytes < (std::size_t{1} << 32), StatusCode::unsupported,
                std::string(who) + ": pages of 4 GiB or more are not supported (page_size × heads too large)");
  return {};
}

template <class Params>
Status validate_decode_shape(const Params& p, const PageTableView& t, int num_kv_heads, int total_q,
                             int max_q_per_seq, const char* who) {
  using enum StatusCode;
  KVQ_CHECK_ARG(t.batch_size == 0 || (p.q && p.out && p.q_indptr), invalid_argument,
                std::string(who) + ": q, q_indptr and out must not be null");
  KVQ_CHECK_ARG(num_kv_heads >= 1, invalid_argument, std::string(who) + ": num_kv_heads must be >= 1");
  KVQ_CHECK_ARG(p.num_qo_heads >= 1 && p.num_qo_heads % num_kv_heads == 0, invalid_argument,
                std::string(who) + ": num_qo_heads (" + std::to_string(p.num_qo_heads) +
                    ") must be a positive multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
  KVQ_CHECK_ARG(std::isfinite(p.sm_scale), invalid_argument, std::string(who) + ": sm_scale must be finite");
  KVQ_CHECK_ARG(total_q >= 0, invalid_argument, std::string(who) + ": negative total_q");
  KVQ_CHECK_ARG(max_q_per_seq >= 1, invalid_argument, std::string(who) + ": max_q_per_seq must be >= 1");
  return {};
}

inline Status validate_workspace(const DecodePlan& plan, const void* ws, std::size_t bytes, const char* who) {
  using enum StatusCode;
  if (plan.workspace_bytes() == 0) return {};
  KVQ_CHECK_ARG(ws, invalid_argument,
                std::string(who) + ": num_splits > 1 needs a workspace of " + std::to_string(plan.workspace_bytes()) +
                    " bytes");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(ws) % 256 == 0, invalid_argument,
                std::string(who) + ": workspace must be 256-byte aligned");
  KVQ_CHECK_ARG(bytes >= plan.workspace_bytes(), invalid_argument,
                std::string(who) + ": workspace_bytes " + std::to_string(bytes) + " < required " +
                    std::to_string(plan.workspace_bytes()));
  return {};
}
}  // namespace detail

template <Policy P, ActivationType T>
Status validate(const AppendArgs<P, T>& a) {
  using enum StatusCode;
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(a.num_tokens >= 0, invalid_argument, "cuda append: negative num_tokens");
  if (a.num_tokens == 0) return {};
  KVQ_CHECK_ARG(a.keys && a.values, invalid_argument, "cuda append: keys and values must not be null");
  KVQ_CHECK_ARG(a.slot_mapping || (a.batch_indices && a.positions), invalid_argument,
                "cuda append: batch_indices and positions (or a slot_mapping) must not be null");
  KVQ_CHECK_ARG(a.cache.pool && a.cache.num_pages >= 1, invalid_argument, "cuda append: empty cache pool");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.cache.pool) % 16 == 0, invalid_argument,
                "cuda append: cache pool must be 16-byte aligned");
  KVQ_CHECK_ARG(a.cache.layout.num_kv_heads >= 1, invalid_argument, "cuda append: num_kv_heads must be >= 1");
  if (a.slot_mapping) {
    KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.slot_mapping) % alignof(std::int64_t) == 0, invalid_argument,
                  "cuda append: slot_mapping must be 8-byte aligned");
    KVQ_CHECK_ARG(a.cache.layout.page_size >= 1, invalid_argument, "cuda append: page_size must be >= 1");
  } else {
    KVQ_RETURN_IF_ERROR(detail::validate_table_shape(a.table, a.cache.layout.page_size, "cuda append"));
    KVQ_CHECK_ARG(a.table.batch_size >= 1, invalid_argument, "cuda append: tokens given but batch_size is 0");
  }
  return validate_rotation_params<P>(a.rotation);
}

template <Policy P, ActivationType T>
Status validate(const DequantizeArgs<P, T>& a) {
  using enum StatusCode;
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(a.num_tokens >= 0, invalid_argument, "cuda dequantize: negative num_tokens");
  if (a.num_tokens == 0) return {};
  KVQ_CHECK_ARG(a.keys && a.values && a.batch_indices && a.positions, invalid_argument,
                "cuda dequantize: keys, values, batch_indices and positions must not be null");
  KVQ_CHECK_ARG(a.cache.pool && a.cache.num_pages >= 1, invalid_argument, "cuda dequantize: empty cache pool");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.cache.pool) % 16 == 0, invalid_argument,
                "cuda dequantize: cache pool must be 16-byte aligned");
  KVQ_CHECK_ARG(a.cache.layout.num_kv_heads >= 1, invalid_argument, "cuda dequantize: num_kv_heads must be >= 1");
  KVQ_RETURN_IF_ERROR(detail::validate_table_shape(a.table, a.cache.layout.page_size, "cuda dequantize"));
  return validate_rotation_params<P>(a.rotation);
}

template <Policy P, ActivationType T>
Status validate(const RotateArgs<P, T>& a) {
  using enum StatusCode;
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(a.num_rows >= 0 && a.num_heads >= 1 && a.heads_per_kv_head >= 1, invalid_argument,
                "cuda rotate: num_rows >= 0, num_heads >= 1 and heads_per_kv_head >= 1 required");
  KVQ_CHECK_ARG(a.num_heads % a.heads_per_kv_head == 0, invalid_argument,
                "cuda rotate: num_heads (" + std::to_string(a.num_heads) + ") must be a multiple of heads_per_kv_head (" +
                    std::to_string(a.heads_per_kv_head) + ")");
  if (a.num_rows == 0) return {};
  KVQ_CHECK_ARG(a.in && a.out, invalid_argument, "cuda rotate: null input or output");
  // Only the tensors the operation reads are required.
  const RotationParams& r = a.rotation;
  if (a.op == RotateOp::key || a.op == RotateOp::query) {
    KVQ_CHECK_ARG(a.op == RotateOp::query || !P.key.centered || r.key_mean, invalid_argument,
                  "cuda rotate: policy centers keys but RotationParams::key_mean is null");
    KVQ_CHECK_ARG(P.key.rotation != Rotation::dense || r.key_rotation, invalid_argument,
                  "cuda rotate: policy uses a dense key rotation but RotationParams::key_rotation is null");
  } else {
    KVQ_CHECK_ARG(!P.value.centered || r.value_mean, invalid_argument,
                  "cuda rotate: policy centers values but RotationParams::value_mean is null");
    KVQ_CHECK_ARG(P.value.rotation != Rotation::dense || r.value_rotation, invalid_argument,
                  "cuda rotate: policy uses a dense value rotation but RotationParams::value_rotation is null");
  }
  return {};
}

template <Policy P, ActivationType QT, ActivationType OT>
Status validate(const DecodeArgs<P, QT, OT>& a, DecodePlan& plan) {
  using enum StatusCode;
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(a.cache.pool || a.cache.num_pages == 0, invalid_argument, "cuda attention: cache pool is null");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.cache.pool) % 16 == 0, invalid_argument,
                "cuda attention: cache pool must be 16-byte aligned (128-bit loads)");
  KVQ_RETURN_IF_ERROR(detail::validate_table_shape(a.table, a.cache.layout.page_size, "cuda attention"));
  KVQ_RETURN_IF_ERROR(detail::validate_page_bytes(a.cache.layout.page_bytes(), "cuda attention"));
  KVQ_RETURN_IF_ERROR(detail::validate_decode_shape(a.params, a.table, a.cache.layout.num_kv_heads, a.total_q,
                                                    a.max_q_per_seq, "cuda attention"));
  KVQ_CHECK_ARG(!a.params.rotated_output || !P.value.centered, invalid_argument,
                "cuda attention: rotated_output needs a policy without value centering");
  KVQ_RETURN_IF_ERROR(validate_rotation_params<P>(a.rotation));
  KVQ_RETURN_IF_ERROR(make_decode_plan(a.shape(), plan));
  return detail::validate_workspace(plan, a.workspace, a.workspace_bytes, "cuda attention");
}

template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status validate(const DenseDecodeArgs<T, D, QT, OT>& a, DecodePlan& plan) {
  using enum StatusCode;
  KVQ_CHECK_ARG(a.pool || a.num_pages == 0, invalid_argument, "cuda dense attention: pool is null");
  KVQ_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.pool) % 16 == 0, invalid_argument,
                "cuda dense attention: pool must be 16-byte aligned (128-bit loads)");
  KVQ_RETURN_IF_ERROR(detail::validate_table_shape(a.table, a.layout.page_size, "cuda dense attention"));
  KVQ_RETURN_IF_ERROR(detail::validate_page_bytes(a.layout.page_bytes(), "cuda dense attention"));
  KVQ_RETURN_IF_ERROR(detail::validate_decode_shape(a.params, a.table, a.layout.num_kv_heads, a.total_q,
                                                    a.max_q_per_seq, "cuda dense attention"));
  KVQ_RETURN_IF_ERROR(make_decode_plan(a.shape(), plan));
  return detail::validate_workspace(plan, a.workspace, a.workspace_bytes, "cuda dense attention");
}

// Workspace bytes a decode call needs (0 when num_splits == 1). Pure host arithmetic.
template <class Args>
std::size_t decode_workspace_bytes(const Args& a) {
  DecodePlan plan;
  return make_decode_plan(a.shape(), plan).ok() ? plan.workspace_bytes() : 0;
}

// ---- launchers (defined in kvq/cuda/launch/launch.cuh) -------------------------------

template <Policy P, ActivationType T>
Status append_kv(const AppendArgs<P, T>& args, Stream stream, bool launch_with_pdl = false);

template <Policy P, ActivationType T>
Status dequantize_kv(const DequantizeArgs<P, T>& args, Stream stream, bool launch_with_pdl = false);

template <Policy P, ActivationType T>
Status rotate_rows(const RotateArgs<P, T>& args, Stream stream, bool launch_with_pdl = false);

template <Policy P, ActivationType QT, ActivationType OT>
Status decode_attention(const DecodeArgs<P, QT, OT>& args, Stream stream, bool launch_with_pdl = false);

template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status dense_decode_attention(const DenseDecodeArgs<T, D, QT, OT>& args, Stream stream, bool launch_with_pdl = false);

// CTAs of the kernel a decode call would launch that fit one SM of the current device
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor), for suggest_num_splits. Only the
// host-visible shape, kernel and precision of `args` are read.
template <Policy P, ActivationType QT, ActivationType OT>
Status decode_ctas_per_sm(const DecodeArgs<P, QT, OT>& args, int& ctas);
template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status decode_ctas_per_sm(const DenseDecodeArgs<T, D, QT, OT>& args, int& ctas);

// o_out, lse_out ← merge((o1, lse1), (o2, lse2)) row by row (kvq/attention/softmax.hpp).
//   o1, o2, out : [rows, dim] of T (out may alias o1 or o2); lse: [rows] fp32
template <ActivationType T>
Status merge_states(const T* o1, const float* lse1, const T* o2, const float* lse2, int rows, int dim, T* out,
                    float* lse_out, Stream stream, bool launch_with_pdl = false);

}  // namespace kvq::cuda
