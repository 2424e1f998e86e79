// kvq/layout/dense.hpp — the page of a full-precision paged cache (the attention-sink
// and recent windows, the fp16/bf16 baseline), the same page granularity as the
// quantized layout (kvq/layout/paged.hpp). Read by the CPU attention
// (kvq/attention/dense.hpp) and the CUDA kernels alike.
#pragma once

#include <cstddef>
#include <type_traits>

#include "kvq/core/config.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/layout/paged.hpp"

namespace kvq {

// Page of P = page_size tokens for all Hkv heads: per head a K region [P][D] and a V
// region [P][D] of T, each 16-byte aligned, heads consecutive.
//   T : half_t, bfloat16_t or float (the row dtype);   D : head_dim
template <ActivationType T, int D>
struct DensePageLayout {
  int page_size = 16;
  int num_kv_heads = 1;
  KVQ_HOST_DEVICE constexpr std::size_t region_bytes() const { return align16(std::size_t(page_size) * D * sizeof(T)); }
  KVQ_HOST_DEVICE constexpr std::size_t page_bytes() const { return 2 * region_bytes() * num_kv_heads; }
  template <class Byte>
  KVQ_HOST_DEVICE auto key_row(Byte* page, int h, int slot) const {
    return reinterpret_cast<std::conditional_t<std::is_const_v<Byte>, const T*, T*>>(
        page + 2 * region_bytes() * h + std::size_t(slot) * D * sizeof(T));
  }
  template <class Byte>
  KVQ_HOST_DEVICE auto value_row(Byte* page, int h, int slot) const {
    return reinterpret_cast<std::conditional_t<std::is_const_v<Byte>, const T*, T*>>(
        page + 2 * region_bytes() * h + region_bytes() + std::size_t(slot) * D * sizeof(T));
  }
};

}  // namespace kvq
