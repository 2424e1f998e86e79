#include <gtest/gtest.h>

#include <vector>

#include "kvq/layout/paged.hpp"

namespace {

using namespace kvq;

// Byte counts are compile-time constants of the policy, P and Hkv.
static_assert(PageLayout<presets::K2V2>::kBytesPerTokenHead == (32 + 4 * 4) + (32 + 1 * 4));
static_assert(PageLayout<presets::K4V2>{16, 8}.page_bytes() == 8 * (16 * 64 + 16 * 16 + 16 * 32 + 16 * 4));

template <Policy P>
void check_layout(int page_size, int heads) {
  const PageLayout<P> L{page_size, heads};
  EXPECT_EQ(L.page_bytes() % 16, 0u);
  std::vector<int> owner(L.page_bytes(), -1);
  auto claim = [&](std::size_t begin, std::size_t bytes, int id) {
    EXPECT_EQ(begin % 16, 0u) << "region " << id << " not 16-byte aligned";
    ASSERT_LE(begin + bytes, L.page_bytes());
    for (std::size_t i = begin; i < begin + bytes; ++i) {
      ASSERT_EQ(owner[i], -1) << "regions overlap at byte " << i;
      owner[i] = id;
    }
  };
  for (int h = 0; h < heads; ++h) {
    claim(L.key_codes_offset(h), page_size * L.kKeyCodeBytes, 4 * h);
    claim(L.key_meta_offset(h), page_size * L.kKeyMetaBytes, 4 * h + 1);
    claim(L.value_codes_offset(h), page_size * L.kValueCodeBytes, 4 * h + 2);
    claim(L.value_meta_offset(h), page_size * L.kValueMetaBytes, 4 * h + 3);
    // Slot pointers walk inside their regions.
    std::byte* page = nullptr;
    EXPECT_EQ(L.key_codes(page + 0, h, page_size - 1) - page,
              std::ptrdiff_t(L.key_codes_offset(h) + (page_size - 1) * L.kKeyCodeBytes));
    EXPECT_EQ(L.value_meta_bytes(page + 0, h, 1) - page, std::ptrdiff_t(L.value_meta_offset(h) + L.kValueMetaBytes));
  }
  EXPECT_EQ(L.kKeyCodeBytes, std::size_t(P.head_dim * P.key.bits / 8));
  EXPECT_EQ(L.kValueMetaBytes, std::size_t(2 * (P.head_dim / P.value.group) * meta_bytes(P.value.meta)));
}

TEST(PageLayout, RegionsAreAlignedDisjointAndInsideThePage) {
  check_layout<presets::K2V2>(16, 1);
  check_layout<presets::K2V2>(17, 3);  // odd page size: alignment padding kicks in
  check_layout<presets::K4V2.with_head_dim(64)>(64, 4);
  check_layout<presets::K8V8.with_head_dim(256).with_meta(MetaType::fp32)>(256, 2);
  check_layout<presets::K2V4_H>(1, 5);
}

TEST(PageLayout, BytesPerTokenHeadMatchDesignExamples) {
  // DESIGN §9: K2V2 at d=128 with g128 keys and values is 72 bytes per token·head.
  constexpr Policy P{QuantSpec{2, 128}, QuantSpec{2, 128}, 128};
  static_assert(PageLayout<P>::kBytesPerTokenHead == 72);
  // K4V2 (K g32 + V g128) is 116 bytes.
  static_assert(PageLayout<presets::K4V2>::kBytesPerTokenHead == 116);
}

}  // namespace
