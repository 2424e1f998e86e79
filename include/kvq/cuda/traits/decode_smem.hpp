// kvq/cuda/traits/decode_smem.hpp — the shared-memory layout of a decode CTA, in plain
// C++: the kernels carve their dynamic shared memory with it and the launchers size the
// allocation with total().
#pragma once

#include <cstddef>

#include "kvq/core/config.hpp"
#include "kvq/cuda/traits/geometry.hpp"

namespace kvq::cuda {

// Bytes from the start of dynamic shared memory.
//   per warp, `stages` stages of: K codes [32 tokens][kcb] (the CUDA-core kernel: [Ck][32]
//                          16-byte chunks), K meta [32][kmb], V codes [32][vcb], V meta [32][vmb]
//   per warp: p [32][R] fp32 (the CUDA-core kernel only: warp_weights)
//   per CTA : q' [R][D] fp32, Σq' per key group [R][NK] fp32, shift [R], limit [R],
//             then `frag_bytes` for the tensor-core kernel's query fragments
//   after the token loop the stage buffers are reused for the cross-warp merge:
//             acc [NW][R][D], m [NW][R], l [NW][R]
struct DecodeSmem {
  std::size_t kcb = 0, kmb = 0, vcb = 0, vmb = 0;  // bytes per token
  int head_dim = 128, rows = 8, key_groups = 1, warps = 4;
  std::size_t frag_bytes = 0;
  int stages = 2;
  bool warp_weights = true;  // the p buffers; the tensor-core kernel keeps p in registers

  KVQ_HOST_DEVICE constexpr std::size_t kc_off() const { return 0; }
  KVQ_HOST_DEVICE constexpr std::size_t km_off() const { return kc_off() + align_up(kcb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t vc_off() const { return km_off() + align_up(kmb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t vm_off() const { return vc_off() + align_up(vcb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t stage_bytes() const { return vm_off() + align_up(vmb * kWarpTokens, 16); }
  KVQ_HOST_DEVICE constexpr std::size_t stage_off(int warp, int stage) const {
    return (std::size_t(warp) * stages + stage) * stage_bytes();
  }
  KVQ_HOST_DEVICE constexpr std::size_t staging_bytes() const { return std::size_t(warps) * stages * stage_bytes(); }
  KVQ_HOST_DEVICE constexpr std::size_t merge_bytes() const {
    return std::size_t(warps) * rows * (head_dim + 2) * 4;
  }
  KVQ_HOST_DEVICE constexpr std::size_t loop_bytes() const {
    return staging_bytes() > merge_bytes() ? staging_bytes() : merge_bytes();
  }
  KVQ_HOST_DEVICE constexpr std::size_t p_off(int warp) const {
    return align_up(loop_bytes(), 16) + (warp_weights ? std::size_t(warp) * kWarpTokens * rows * 4 : 0);
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

}  // namespace kvq::cuda
