// kvq/cuda/launch/dispatch.hpp — run-time (policy, dtype) → an instantiated launcher.
//
// kvq_add_instantiations() writes <target>_kvq_instantiations.hpp with the X-macro
// KVQ_INSTANTIATIONS(X) listing X(id, policy, dtype) for exactly what it compiled.
// KVQ_CUDA_DISPATCH walks that list and calls the generic lambda for the entry whose
// policy and dtype equal the run-time values, so nothing outside the list is ever
// instantiated; any other value returns Status::unsupported naming what *is* there:
//
//   const kvq::Policy p = kvq::presets::K4V2.with_head_dim(cfg.head_dim);
//   kvq::Status s = KVQ_CUDA_DISPATCH(KVQ_INSTANTIATIONS, p, kvq::cuda::DType::f16,
//       [&]<kvq::Policy P, class T>() {
//         kvq::cuda::DecodeArgs<P, T, T> a{...};
//         return kvq::cuda::decode_attention(a, stream);
//       });
//
// Plain C++ (no CUDA needed).
#pragma once

#include <string>
#include <type_traits>

#include "kvq/core/numeric.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

namespace kvq::cuda {

enum class DType { f16, bf16, f32 };

template <ActivationType T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, half_t>) {
    return DType::f16;
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return DType::bf16;
  } else {
    return DType::f32;
  }
}

constexpr const char* to_string(DType t) { return t == DType::f16 ? "f16" : t == DType::bf16 ? "bf16" : "f32"; }

}  // namespace kvq::cuda

#define KVQ_CUDA_DISPATCH_ENTRY_(ID, POLICY, T)                                                     \
  kvq_list_ += std::string(kvq_list_.empty() ? "" : ", ") + #ID;                                    \
  if (!kvq_found_ && kvq_policy_ == (POLICY) && kvq_dtype_ == ::kvq::cuda::dtype_of<T>()) {         \
    kvq_found_ = true;                                                                              \
    kvq_status_ = kvq_f_.template operator()<(POLICY), T>();                                        \
  }

// KVQ_CUDA_DISPATCH(LIST, policy, dtype, generic-lambda) → kvq::Status
#define KVQ_CUDA_DISPATCH(LIST, POLICY_VALUE, DTYPE_VALUE, ...)                                     \
  [&]() -> ::kvq::Status {                                                                          \
    auto&& kvq_f_ = __VA_ARGS__;                                                                    \
    const ::kvq::Policy kvq_policy_ = (POLICY_VALUE);                                               \
    const ::kvq::cuda::DType kvq_dtype_ = (DTYPE_VALUE);                                            \
    bool kvq_found_ = false;                                                                        \
    ::kvq::Status kvq_status_;                                                                      \
    std::string kvq_list_;                                                                          \
    LIST(KVQ_CUDA_DISPATCH_ENTRY_)                                                                  \
    if (!kvq_found_)                                                                                \
      return {::kvq::StatusCode::unsupported, "kvq cuda: policy (" + ::kvq::to_string(kvq_policy_) + \
                                                  ") with dtype " + ::kvq::cuda::to_string(kvq_dtype_) + \
                                                  " is not instantiated (available: " + kvq_list_ + ")"}; \
    return kvq_status_;                                                                             \
  }()
