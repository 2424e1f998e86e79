// kvq/cuda/launch/launch.cuh — definitions of the launchers declared in api.hpp.
//
// Include this only from the translation units that instantiate kvq (see
// kvq/cuda/instantiate.cuh and cmake/KvqInstantiate.cmake). Each launcher validates
// the host-visible arguments, computes its plan with kvq/cuda/launch/plan.hpp, launches
// on the caller's stream and returns; it never allocates or synchronizes.
#pragma once

#include "kvq/cuda/config.cuh"
#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/kernel/decode_mma.cuh"
#include "kvq/cuda/kernel/rows.cuh"
#include "kvq/cuda/launch/api.hpp"
#include "kvq/cuda/launch/plan.hpp"

namespace kvq::cuda {

namespace detail {

inline dim3 to_dim3(Dim3 d) { return dim3(d.x, d.y, d.z); }

// Launches one decode kernel over plan.grid, then the split merge when there are splits.
template <class KP>
Status launch_decode_kernel(void (*kern)(KP), int threads, std::size_t smem, const KP& kp, const DecodePlan& plan,
                            Stream stream) {
  if (smem > 48 * 1024)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kern<<<to_dim3(plan.grid), threads, smem, stream>>>(kp);
  KVQ_CUDA_CHECK(cudaGetLastError());
  if (kp.num_splits > 1) {
    kernel::split_merge_kernel<KP><<<to_dim3(plan.merge_grid), plan.merge_block, 0, stream>>>(kp);
    KVQ_CUDA_CHECK(cudaGetLastError());
  }
  return {};
}

template <class Src, int R, ActivationType QT, ActivationType OT>
Status launch_decode_rows(const kernel::DecodeKernelParams<Src, QT, OT>& kp, const DecodePlan& plan, Stream stream) {
  using Cfg = kernel::DecodeConfig<Src, R>;
  return launch_decode_kernel(&kernel::decode_kernel<kernel::DecodeKernelParams<Src, QT, OT>, R>, Cfg::NW * 32,
                              Cfg::smem.total(), kp, plan, stream);
}

template <class Src, ActivationType QT, ActivationType OT>
Status launch_decode_mma(const kernel::DecodeKernelParams<Src, QT, OT>& kp, const DecodePlan& plan,
                         DecodePrecision precision, Stream stream) {
  using KP = kernel::DecodeKernelParams<Src, QT, OT>;
  using Cfg = kernel::MmaDecodeConfig<Src>;
  return launch_decode_kernel(precision == DecodePrecision::exact
                                  ? &kernel::decode_mma_kernel<KP, DecodePrecision::exact>
                                  : &kernel::decode_mma_kernel<KP, DecodePrecision::fast>,
                              Cfg::NW * 32, Cfg::smem.total(), kp, plan, stream);
}

// Picks the kernel for plan.rows; only row counts allowed at this head_dim exist.
template <class Src, ActivationType QT, ActivationType OT>
Status launch_decode(const kernel::DecodeKernelParams<Src, QT, OT>& kp, const DecodePlan& plan, Stream stream) {
  constexpr int cap = max_rows_per_cta(Src::D);
  switch (plan.rows) {
    case 4: return launch_decode_rows<Src, 4>(kp, plan, stream);
    case 8:
      if constexpr (cap >= 8) return launch_decode_rows<Src, 8>(kp, plan, stream);
      break;
    case 16:
      if constexpr (cap >= 16) return launch_decode_rows<Src, 16>(kp, plan, stream);
      break;
    default: break;
  }
  return {StatusCode::unsupported, "cuda attention: no kernel for " + std::to_string(plan.rows) + " rows per CTA"};
}

}  // namespace detail

template <Policy P, ActivationType T>
Status append_kv(const AppendArgs<P, T>& a, Stream stream) {
  KVQ_RETURN_IF_ERROR(validate(a));
  const long long items = static_cast<long long>(a.num_tokens) * a.cache.layout.num_kv_heads;
  if (items == 0) return {};
  kernel::append_kernel<std::decay_t<decltype(a)>><<<detail::to_dim3(row_grid(items)), kRowWarpsPerBlock * 32, 0, stream>>>(a);
  KVQ_CUDA_CHECK(cudaGetLastError());
  return {};
}

template <Policy P, ActivationType T>
Status dequantize_kv(const DequantizeArgs<P, T>& a, Stream stream) {
  KVQ_RETURN_IF_ERROR(validate(a));
  const long long items = static_cast<long long>(a.num_tokens) * a.cache.layout.num_kv_heads;
  if (items == 0) return {};
  kernel::dequantize_kernel<std::decay_t<decltype(a)>><<<detail::to_dim3(row_grid(items)), kRowWarpsPerBlock * 32, 0, stream>>>(a);
  KVQ_CUDA_CHECK(cudaGetLastError());
  return {};
}

template <Policy P, ActivationType T>
Status rotate_rows(const RotateArgs<P, T>& a, Stream stream) {
  KVQ_RETURN_IF_ERROR(validate(a));
  const long long items = static_cast<long long>(a.num_rows) * a.num_heads;
  if (items == 0) return {};
  kernel::rotate_kernel<std::decay_t<decltype(a)>><<<detail::to_dim3(row_grid(items)), kRowWarpsPerBlock * 32, 0, stream>>>(a);
  KVQ_CUDA_CHECK(cudaGetLastError());
  return {};
}

template <Policy P, ActivationType QT, ActivationType OT>
Status decode_attention(const DecodeArgs<P, QT, OT>& a, Stream stream) {
  DecodePlan plan;
  KVQ_RETURN_IF_ERROR(validate(a, plan));
  if (a.table.batch_size == 0 || a.total_q == 0) return {};
  const kernel::QuantSource<P> src{a.cache.pool, a.cache.num_pages, a.cache.layout};
  const auto kp = kernel::make_decode_params(src, a.table, a.params, a.rotation, a.num_splits, plan.row_tiles,
                                             a.total_q, a.workspace, a.error_flags);
  if constexpr (DecodeArgs<P, QT, OT>::kTensorCoreOk) {
    if (plan.kernel == DecodeKernel::tensor_core) return detail::launch_decode_mma(kp, plan, a.precision, stream);
  }
  return detail::launch_decode(kp, plan, stream);
}

template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status dense_decode_attention(const DenseDecodeArgs<T, D, QT, OT>& a, Stream stream) {
  DecodePlan plan;
  KVQ_RETURN_IF_ERROR(validate(a, plan));
  if (a.table.batch_size == 0 || a.total_q == 0) return {};
  const kernel::DenseSource<T, D> src{a.pool, a.num_pages, a.layout};
  const auto kp = kernel::make_decode_params(src, a.table, a.params, RotationParams{}, a.num_splits,
                                             plan.row_tiles, a.total_q, a.workspace, a.error_flags);
  if constexpr (DenseDecodeArgs<T, D, QT, OT>::kTensorCoreOk) {
    if (plan.kernel == DecodeKernel::tensor_core) return detail::launch_decode_mma(kp, plan, a.precision, stream);
  }
  return detail::launch_decode(kp, plan, stream);
}

template <ActivationType T>
Status merge_states(const T* o1, const float* lse1, const T* o2, const float* lse2, int rows, int dim, T* out,
                    float* lse_out, Stream stream) {
  using enum StatusCode;
  KVQ_CHECK_ARG(rows >= 0 && dim >= 1, invalid_argument, "cuda merge_states: rows >= 0 and dim >= 1 required");
  if (rows == 0) return {};
  KVQ_CHECK_ARG(o1 && lse1 && o2 && lse2 && out && lse_out, invalid_argument, "cuda merge_states: null pointer");
  kernel::merge_states_kernel<T><<<detail::to_dim3(row_grid(rows)), kRowWarpsPerBlock * 32, 0, stream>>>(
      o1, lse1, o2, lse2, rows, dim, out, lse_out);
  KVQ_CUDA_CHECK(cudaGetLastError());
  return {};
}

}  // namespace kvq::cuda
