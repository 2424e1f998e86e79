// kvq/cuda/launch/launch.cuh — definitions of the launchers declared in api.hpp.
//
// Include this only from the translation units that instantiate kvq (see
// kvq/cuda/instantiate.cuh and cmake/KvqInstantiate.cmake). Each launcher validates
// the host-visible arguments, computes its plan with kvq/cuda/launch/plan.hpp, launches
// on the caller's stream and returns; it never allocates or synchronizes.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include "kvq/cuda/config.cuh"
#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/kernel/decode_mma.cuh"
#include "kvq/cuda/kernel/grid_dependency.cuh"
#include "kvq/cuda/kernel/rows.cuh"
#include "kvq/cuda/launch/api.hpp"
#include "kvq/cuda/launch/plan.hpp"

namespace kvq::cuda {

namespace detail {

inline dim3 to_dim3(Dim3 d) { return dim3(d.x, d.y, d.z); }

// The oldest PTX (cudaFuncAttributes::ptxVersion) that has what the launchers use.
inline constexpr int kPdlPtxVersion = 90;  // griddepcontrol.wait
inline constexpr int kMmaPtxVersion = 80;  // mma.sync m16n8k16

// The compute version of the PTX that the code the current device runs for `kern` was
// compiled from (cudaFuncGetAttributes' ptxVersion: 90 for sm_90 SASS or a JIT of
// compute_90 PTX). It decides what the launchers may use: the grid-dependency wait
// (kernel/grid_dependency.cuh) exists from 90, so only such kernels are launched with
// PDL (a build with sm_90 SASS and only older PTX runs a JIT of that PTX on newer
// architectures, without the wait); mma.sync m16n8k16 exists from 80, so the tensor-core
// decode of older code would trap. The answer is kept per (device, kernel) in a fixed
// lock-free table, so a launch asks the driver once (no allocation); kernels past the
// table's capacity are asked about on every launch.
inline Status kernel_ptx_version(const void* kern, int& version) {
  constexpr int kDevices = 16, kSlots = 64;
  struct Slot {
    std::atomic<const void*> kernel{nullptr};
    std::atomic<int> answer{0};  // 0: not asked yet, else ptxVersion + 1
  };
  static Slot table[kDevices][kSlots];
  auto ask = [&]() -> Status {
    cudaFuncAttributes attr{};
    KVQ_CUDA_CHECK(cudaFuncGetAttributes(&attr, kern));
    version = attr.ptxVersion;
    return {};
  };
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kDevices) return ask();
  const std::size_t home = (reinterpret_cast<std::uintptr_t>(kern) >> 4) % kSlots;
  for (int i = 0; i < kSlots; ++i) {
    Slot& slot = table[dev][(home + i) % kSlots];
    // A load first: a slot already ours (every launch after the first) is not written.
    const void* owner = slot.kernel.load(std::memory_order_acquire);
    if (!owner && slot.kernel.compare_exchange_strong(owner, kern, std::memory_order_acq_rel)) owner = kern;
    if (owner != kern) continue;
    if (const int a = slot.answer.load(std::memory_order_acquire)) {
      version = a - 1;
      return {};
    }
    KVQ_RETURN_IF_ERROR(ask());
    slot.answer.store(version + 1, std::memory_order_release);
    return {};
  }
  return ask();
}

// kern<<<grid, threads, smem, stream>>>(args...), with programmatic dependent launch when
// `launch_with_pdl` and the kernel holds the wait (ptxVersion ≥ 90, above): the grid may
// then start before the previous one in the stream has finished; kvq kernels wait for it
// before their first global access.
template <class... Params, class... Args>
Status launch_kernel(void (*kern)(Params...), dim3 grid, int threads, std::size_t smem, Stream stream,
                     bool launch_with_pdl, const Args&... args) {
  int ptx_version = 0;
  if (launch_with_pdl) KVQ_RETURN_IF_ERROR(kernel_ptx_version(reinterpret_cast<const void*>(kern), ptx_version));
  const bool pdl = ptx_version >= kPdlPtxVersion;
  if (smem > 48 * 1024)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = pdl ? attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  KVQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, args...));
  return {};
}

// Launches one decode kernel over plan.grid, then the split merge when there are splits
// that the kernel does not merge itself (with PDL as well: it waits for the decode grid).
template <class KP>
Status launch_decode_kernel(void (*kern)(KP), int threads, std::size_t smem, const KP& kp, const DecodePlan& plan,
                            Stream stream, bool launch_with_pdl) {
  KVQ_RETURN_IF_ERROR(launch_kernel(kern, to_dim3(plan.grid), threads, smem, stream, launch_with_pdl, kp));
  if (kp.num_splits > 1 && !kp.split_counters)
    return launch_kernel(&kernel::split_merge_kernel<KP>, to_dim3(plan.merge_grid), plan.merge_block, 0, stream,
                         launch_with_pdl, kp);
  return {};
}

// The decode kernel a plan resolves to, with its block size and dynamic shared memory
// (kernel == nullptr when no kernel exists for plan.rows at this head_dim).
template <class KP>
struct DecodeLaunch {
  void (*kernel)(KP) = nullptr;
  int threads = 0;
  std::size_t smem = 0;
};

// The tensor-core kernel in precision Prec with pipeline Pipeline (kernel::MmaPipeline).
template <class KP, DecodePrecision Prec, class Pipeline = kernel::MmaPipeline<>>
DecodeLaunch<KP> mma_decode_launch() {
  using Cfg = kernel::MmaDecodeConfig<typename KP::source_type, Pipeline>;
  return {&kernel::decode_mma_kernel<KP, Prec, Pipeline>, Cfg::NW * 32, Cfg::smem.total()};
}

template <class KP, bool kTensorCoreOk>
DecodeLaunch<KP> select_decode_kernel(const DecodePlan& plan, DecodePrecision precision) {
  using Src = typename KP::source_type;
  if constexpr (kTensorCoreOk) {
    if (plan.kernel == DecodeKernel::tensor_core)
      return precision == DecodePrecision::exact ? mma_decode_launch<KP, DecodePrecision::exact>()
                                                 : mma_decode_launch<KP, DecodePrecision::fast>();
  }
  auto rows = [&]<int R>() -> DecodeLaunch<KP> {
    using Cfg = kernel::DecodeConfig<Src, R>;
    return {&kernel::decode_kernel<KP, R>, Cfg::NW * 32, Cfg::smem.total()};
  };
  constexpr int cap = max_rows_per_cta(Src::D);
  switch (plan.rows) {
    case 4: return rows.template operator()<4>();
    case 8:
      if constexpr (cap >= 8) return rows.template operator()<8>();
      break;
    case 16:
      if constexpr (cap >= 16) return rows.template operator()<16>();
      break;
    default: break;
  }
  return {};
}

template <class KP, bool kTensorCoreOk>
Status launch_decode(const KP& kp, const DecodePlan& plan, DecodePrecision precision, Stream stream,
                     bool launch_with_pdl) {
  const DecodeLaunch<KP> l = select_decode_kernel<KP, kTensorCoreOk>(plan, precision);
  if (!l.kernel)
    return {StatusCode::unsupported, "cuda attention: no kernel for " + std::to_string(plan.rows) + " rows per CTA"};
  return launch_decode_kernel(l.kernel, l.threads, l.smem, kp, plan, stream, launch_with_pdl);
}

// Resident CTAs per SM of one decode kernel (occupancy API).
template <class KP>
Status ctas_per_sm(const DecodeLaunch<KP>& l, int& ctas) {
  if (l.smem > 48 * 1024)
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(l.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(l.smem)));
  KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, l.kernel, l.threads, l.smem));
  return {};
}

template <class KP, bool kTensorCoreOk>
Status ctas_per_sm(const DecodePlan& plan, DecodePrecision precision, int& ctas) {
  const DecodeLaunch<KP> l = select_decode_kernel<KP, kTensorCoreOk>(plan, precision);
  if (!l.kernel)
    return {StatusCode::unsupported, "cuda attention: no kernel for " + std::to_string(plan.rows) + " rows per CTA"};
  return ctas_per_sm(l, ctas);
}

// One warp per item (row_grid).
template <class... Params, class... Args>
Status launch_rows(void (*kern)(Params...), long long items, Stream stream, bool launch_with_pdl, const Args&... args) {
  if (items == 0) return {};
  return launch_kernel(kern, to_dim3(row_grid(items)), kRowWarpsPerBlock * 32, 0, stream, launch_with_pdl, args...);
}

}  // namespace detail

template <Policy P, ActivationType T>
Status append_kv(const AppendArgs<P, T>& a, Stream stream, bool launch_with_pdl) {
  KVQ_RETURN_IF_ERROR(validate(a));
  const int parts = append_parts(a.num_tokens, a.cache.layout.num_kv_heads);
  return detail::launch_rows(&kernel::append_kernel<AppendArgs<P, T>>,
                             append_items(a.num_tokens, a.cache.layout.num_kv_heads, parts), stream, launch_with_pdl,
                             a, parts);
}

template <Policy P, ActivationType T>
Status dequantize_kv(const DequantizeArgs<P, T>& a, Stream stream, bool launch_with_pdl) {
  KVQ_RETURN_IF_ERROR(validate(a));
  return detail::launch_rows(&kernel::dequantize_kernel<DequantizeArgs<P, T>>,
                             static_cast<long long>(a.num_tokens) * a.cache.layout.num_kv_heads, stream,
                             launch_with_pdl, a);
}

template <Policy P, ActivationType T>
Status rotate_rows(const RotateArgs<P, T>& a, Stream stream, bool launch_with_pdl) {
  KVQ_RETURN_IF_ERROR(validate(a));
  return detail::launch_rows(&kernel::rotate_kernel<RotateArgs<P, T>>,
                             static_cast<long long>(a.num_rows) * a.num_heads, stream, launch_with_pdl, a);
}

namespace detail {

// The kernel parameters of a validated decode call (quantized or 16-bit pages).
template <Policy P, ActivationType QT, ActivationType OT>
auto decode_kernel_params(const DecodeArgs<P, QT, OT>& a, const DecodePlan& plan) {
  const kernel::QuantSource<P> src{a.cache.pool, a.cache.num_pages, a.cache.layout};
  return kernel::make_decode_params(src, a.table, a.params, a.rotation, a.num_splits, plan.row_tiles, plan.rows,
                                    a.total_q, a.workspace, a.error_flags, plan.merge_grid.x == 0);
}
template <ActivationType T, int D, ActivationType QT, ActivationType OT>
auto decode_kernel_params(const DenseDecodeArgs<T, D, QT, OT>& a, const DecodePlan& plan) {
  const kernel::DenseSource<T, D> src{a.pool, a.num_pages, a.layout};
  return kernel::make_decode_params(src, a.table, a.params, RotationParams{}, a.num_splits, plan.row_tiles,
                                    plan.rows, a.total_q, a.workspace, a.error_flags, plan.merge_grid.x == 0);
}
template <class Args>
using decode_kernel_params_t = decltype(decode_kernel_params(std::declval<const Args&>(), DecodePlan{}));

// `plan` made for the device: a tensor-core plan whose kernel the current device runs
// from code older than compute_80 (kernel_ptx_version) is made again with
// DecodeShape::tensor_core_runs = false: `automatic` then takes the CUDA-core kernel, an
// explicit tensor_core is `unsupported`. The workspace validated for the first plan stays
// right: both kernels take the same (CudaPlan.TensorCoreKernelChoice).
template <class Args>
Status plan_for_device(const Args& a, DecodePlan& plan) {
  if constexpr (Args::kTensorCoreOk) {
    if (plan.kernel != DecodeKernel::tensor_core) return {};
    const auto l = select_decode_kernel<decode_kernel_params_t<Args>, true>(plan, a.precision);
    int version = 0;
    KVQ_RETURN_IF_ERROR(kernel_ptx_version(reinterpret_cast<const void*>(l.kernel), version));
    if (version >= kMmaPtxVersion) return {};
    DecodeShape s = a.shape();
    s.tensor_core_runs = false;
    return make_decode_plan(s, plan);
  } else {
    return {};
  }
}

template <class Args>
Status decode_any(const Args& a, Stream stream, bool launch_with_pdl) {
  DecodePlan plan;
  KVQ_RETURN_IF_ERROR(validate(a, plan));
  if (a.table.batch_size == 0 || a.total_q == 0) return {};
  KVQ_RETURN_IF_ERROR(plan_for_device(a, plan));
  return launch_decode<decode_kernel_params_t<Args>, Args::kTensorCoreOk>(decode_kernel_params(a, plan), plan,
                                                                         a.precision, stream, launch_with_pdl);
}

template <class Args>
Status decode_ctas_per_sm_any(const Args& a, int& ctas) {
  DecodePlan plan;
  KVQ_RETURN_IF_ERROR(make_decode_plan(a.shape(), plan));
  KVQ_RETURN_IF_ERROR(plan_for_device(a, plan));
  return ctas_per_sm<decode_kernel_params_t<Args>, Args::kTensorCoreOk>(plan, a.precision, ctas);
}

}  // namespace detail

template <Policy P, ActivationType QT, ActivationType OT>
Status decode_attention(const DecodeArgs<P, QT, OT>& a, Stream stream, bool launch_with_pdl) {
  return detail::decode_any(a, stream, launch_with_pdl);
}

template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status dense_decode_attention(const DenseDecodeArgs<T, D, QT, OT>& a, Stream stream, bool launch_with_pdl) {
  return detail::decode_any(a, stream, launch_with_pdl);
}

template <Policy P, ActivationType QT, ActivationType OT>
Status decode_ctas_per_sm(const DecodeArgs<P, QT, OT>& a, int& ctas) {
  return detail::decode_ctas_per_sm_any(a, ctas);
}

template <ActivationType T, int D, ActivationType QT, ActivationType OT>
Status decode_ctas_per_sm(const DenseDecodeArgs<T, D, QT, OT>& a, int& ctas) {
  return detail::decode_ctas_per_sm_any(a, ctas);
}

// ---- tuning: the tensor-core kernel with another pipeline --------------------------------
// For benchmark sweeps that choose kernel::MmaDecodeConfig's default warps and stages by
// measurement (bench_cuda_decode, BM_DecodePipe*): the validation, plan and launch of
// decode_attention / dense_decode_attention, through decode_mma_kernel<KP, Precision,
// Pipeline>. Args = DecodeArgs or DenseDecodeArgs with kTensorCoreOk whose plan chooses
// the tensor-core kernel on a device that runs it (decode_attention returns `unsupported`
// otherwise; decode_ctas_per_sm does not check); args.precision is ignored. Only TUs
// that include this header can call them (they instantiate the kernel).
namespace tuning {

template <class Pipeline, DecodePrecision Precision, class Args>
Status decode_ctas_per_sm(const Args&, int& ctas) {
  static_assert(Args::kTensorCoreOk, "kvq: no tensor-core decode kernel for these arguments");
  return detail::ctas_per_sm(detail::mma_decode_launch<detail::decode_kernel_params_t<Args>, Precision, Pipeline>(),
                             ctas);
}

template <class Pipeline, DecodePrecision Precision, class Args>
Status decode_attention(const Args& a, Stream stream) {
  static_assert(Args::kTensorCoreOk, "kvq: no tensor-core decode kernel for these arguments");
  DecodePlan plan;
  KVQ_RETURN_IF_ERROR(validate(a, plan));
  if (a.table.batch_size == 0 || a.total_q == 0) return {};
  if (plan.kernel != DecodeKernel::tensor_core)
    return {StatusCode::unsupported, "cuda tuning::decode_attention: the plan did not choose the tensor-core kernel"};
  const auto l = detail::mma_decode_launch<detail::decode_kernel_params_t<Args>, Precision, Pipeline>();
  int version = 0;
  KVQ_RETURN_IF_ERROR(detail::kernel_ptx_version(reinterpret_cast<const void*>(l.kernel), version));
  if (version < detail::kMmaPtxVersion)
    return {StatusCode::unsupported,
            "cuda tuning::decode_attention: the device runs the tensor-core kernel from code compiled for below sm_80"};
  return detail::launch_decode_kernel(l.kernel, l.threads, l.smem, detail::decode_kernel_params(a, plan), plan, stream,
                                      false);
}

}  // namespace tuning

template <ActivationType T>
Status merge_states(const T* o1, const float* lse1, const T* o2, const float* lse2, int rows, int dim, T* out,
                    float* lse_out, Stream stream, bool launch_with_pdl) {
  using enum StatusCode;
  KVQ_CHECK_ARG(rows >= 0 && dim >= 1, invalid_argument, "cuda merge_states: rows >= 0 and dim >= 1 required");
  if (rows == 0) return {};
  KVQ_CHECK_ARG(o1 && lse1 && o2 && lse2 && out && lse_out, invalid_argument, "cuda merge_states: null pointer");
  return detail::launch_rows(&kernel::merge_states_kernel<T>, rows, stream, launch_with_pdl, o1, lse1, o2, lse2, rows,
                             dim, out, lse_out);
}

}  // namespace kvq::cuda
