// kvq/cuda/instantiate.cuh — explicit instantiation of the CUDA launchers.
//
// Headers instantiate nothing. An engine compiles one translation unit per
// (policy, head_dim, dtype) it serves — cmake/KvqInstantiate.cmake writes them — each
// containing, e.g.
//
//   #include "kvq/cuda/instantiate.cuh"
//   KVQ_CUDA_INSTANTIATE_POLICY(kvq::presets::K4V2.with_head_dim(128), kvq::half_t)
//   KVQ_CUDA_INSTANTIATE_DENSE(128, kvq::half_t)   // once per (head_dim, dtype)
//
// and calls the launchers of kvq/cuda/launch/api.hpp from any other translation unit.
// Queries and outputs use the same dtype as the rows (the usual engine setup).
#pragma once

#include "kvq/cuda/launch/launch.cuh"

#define KVQ_CUDA_INSTANTIATE_POLICY(POLICY, T)                                                          \
  template ::kvq::Status kvq::cuda::append_kv<(POLICY), T>(const ::kvq::cuda::AppendArgs<(POLICY), T>&, \
                                                           ::kvq::cuda::Stream, bool);                  \
  template ::kvq::Status kvq::cuda::dequantize_kv<(POLICY), T>(                                         \
      const ::kvq::cuda::DequantizeArgs<(POLICY), T>&, ::kvq::cuda::Stream, bool);                      \
  template ::kvq::Status kvq::cuda::rotate_rows<(POLICY), T>(const ::kvq::cuda::RotateArgs<(POLICY), T>&, \
                                                             ::kvq::cuda::Stream, bool);                \
  template ::kvq::Status kvq::cuda::decode_attention<(POLICY), T, T>(                                   \
      const ::kvq::cuda::DecodeArgs<(POLICY), T, T>&, ::kvq::cuda::Stream, bool);                       \
  template ::kvq::Status kvq::cuda::decode_ctas_per_sm<(POLICY), T, T>(const ::kvq::cuda::DecodeArgs<(POLICY), T, T>&, \
                                                                       int&);

#define KVQ_CUDA_INSTANTIATE_DENSE(D, T)                                                                \
  template ::kvq::Status kvq::cuda::dense_decode_attention<T, D, T, T>(                                 \
      const ::kvq::cuda::DenseDecodeArgs<T, D, T, T>&, ::kvq::cuda::Stream, bool);                      \
  template ::kvq::Status kvq::cuda::decode_ctas_per_sm<T, D, T, T>(                                     \
      const ::kvq::cuda::DenseDecodeArgs<T, D, T, T>&, int&);                                           \
  template ::kvq::Status kvq::cuda::merge_states<T>(const T*, const float*, const T*, const float*, int, int, \
                                                    T*, float*, ::kvq::cuda::Stream, bool);
