// kvq/layout/paged.hpp — the paged quantized cache layout (DESIGN §5).
//
// A page holds `page_size` (P) tokens of all `num_kv_heads` (Hkv) heads of one layer.
// Inside a page, head h owns one contiguous block of four regions, each starting on a
// 16-byte boundary so that 128-bit loads are always possible:
//
//   page ─┬─ head 0 ─┬─ K codes : [P][D·bk/8]            bytes, little-endian packed
//         │          ├─ K meta  : [P][D/Gk][2]            {scale, lo} in key MetaType
//         │          ├─ V codes : [P][D·bv/8]
//         │          └─ V meta  : [P][D/Gv][2]            {scale, lo} in value MetaType
//         ├─ head 1 ─ ...
//         └─ (page_bytes is a multiple of 16)
//
// All offsets are constexpr functions of the policy, P and Hkv. The engine owns the
// pool (`num_pages · page_bytes()` bytes, 16-byte aligned) and the page table.
#pragma once

#include <cstddef>

#include "kvq/core/config.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/quantizer.hpp"

namespace kvq {

KVQ_HOST_DEVICE constexpr std::size_t align16(std::size_t n) { return (n + 15u) & ~std::size_t{15}; }

template <Policy P>
struct PageLayout {
  static_assert(check_policy<P>());
  static constexpr int kHeadDim = P.head_dim;
  using KeyMeta = meta_storage_t<P.key.meta>;
  using ValueMeta = meta_storage_t<P.value.meta>;

  // Per-token sizes of one head.
  static constexpr std::size_t kKeyCodeBytes = std::size_t(kHeadDim) * P.key.bits / 8;
  static constexpr std::size_t kValueCodeBytes = std::size_t(kHeadDim) * P.value.bits / 8;
  static constexpr int kKeyGroups = kHeadDim / P.key.group;
  static constexpr int kValueGroups = kHeadDim / P.value.group;
  static constexpr std::size_t kKeyMetaBytes = 2u * kKeyGroups * sizeof(KeyMeta);
  static constexpr std::size_t kValueMetaBytes = 2u * kValueGroups * sizeof(ValueMeta);
  // Packed bytes that one token of one KV head costs (K and V, codes and metadata).
  static constexpr std::size_t kBytesPerTokenHead =
      kKeyCodeBytes + kKeyMetaBytes + kValueCodeBytes + kValueMetaBytes;

  int page_size = 16;    // P tokens per page
  int num_kv_heads = 1;  // Hkv heads per page

  KVQ_HOST_DEVICE constexpr std::size_t key_codes_region() const { return align16(page_size * kKeyCodeBytes); }
  KVQ_HOST_DEVICE constexpr std::size_t key_meta_region() const { return align16(page_size * kKeyMetaBytes); }
  KVQ_HOST_DEVICE constexpr std::size_t value_codes_region() const { return align16(page_size * kValueCodeBytes); }
  KVQ_HOST_DEVICE constexpr std::size_t value_meta_region() const { return align16(page_size * kValueMetaBytes); }
  KVQ_HOST_DEVICE constexpr std::size_t head_bytes() const {
    return key_codes_region() + key_meta_region() + value_codes_region() + value_meta_region();
  }
  KVQ_HOST_DEVICE constexpr std::size_t page_bytes() const { return head_bytes() * num_kv_heads; }

  // Byte offsets inside a page of head h's regions.
  KVQ_HOST_DEVICE constexpr std::size_t key_codes_offset(int h) const { return head_bytes() * h; }
  KVQ_HOST_DEVICE constexpr std::size_t key_meta_offset(int h) const { return key_codes_offset(h) + key_codes_region(); }
  KVQ_HOST_DEVICE constexpr std::size_t value_codes_offset(int h) const { return key_meta_offset(h) + key_meta_region(); }
  KVQ_HOST_DEVICE constexpr std::size_t value_meta_offset(int h) const { return value_codes_offset(h) + value_codes_region(); }

  // Pointers to token `slot` (0 ≤ slot < P) of head h in `page` (page start address).
  template <class Byte>
  KVQ_HOST_DEVICE Byte* key_codes(Byte* page, int h, int slot) const {
    return page + key_codes_offset(h) + std::size_t(slot) * kKeyCodeBytes;
  }
  template <class Byte>
  KVQ_HOST_DEVICE Byte* key_meta_bytes(Byte* page, int h, int slot) const {
    return page + key_meta_offset(h) + std::size_t(slot) * kKeyMetaBytes;
  }
  template <class Byte>
  KVQ_HOST_DEVICE Byte* value_codes(Byte* page, int h, int slot) const {
    return page + value_codes_offset(h) + std::size_t(slot) * kValueCodeBytes;
  }
  template <class Byte>
  KVQ_HOST_DEVICE Byte* value_meta_bytes(Byte* page, int h, int slot) const {
    return page + value_meta_offset(h) + std::size_t(slot) * kValueMetaBytes;
  }
};

// Non-owning view of an engine's page pool for one layer.
template <Policy P>
struct PagedCacheView {
  std::byte* pool = nullptr;  // num_pages · layout.page_bytes() bytes, 16-byte aligned
  int num_pages = 0;
  PageLayout<P> layout{};

  KVQ_HOST_DEVICE std::byte* page(int index) const { return pool + layout.page_bytes() * std::size_t(index); }
};

template <Policy P>
struct ConstPagedCacheView {
  const std::byte* pool = nullptr;
  int num_pages = 0;
  PageLayout<P> layout{};

  ConstPagedCacheView() = default;
  KVQ_HOST_DEVICE ConstPagedCacheView(const std::byte* p, int n, PageLayout<P> l) : pool(p), num_pages(n), layout(l) {}
  KVQ_HOST_DEVICE ConstPagedCacheView(const PagedCacheView<P>& v) : pool(v.pool), num_pages(v.num_pages), layout(v.layout) {}
  KVQ_HOST_DEVICE const std::byte* page(int index) const { return pool + layout.page_bytes() * std::size_t(index); }
};

}  // namespace kvq
