// The CPU tile products and helpers of kvq/cpu/tile.hpp against plain fp64 loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/test_utils.hpp"
#include "kvq/cpu/tile.hpp"

namespace {

using kvq::detail::kMaxRowsPerPass;
using kvq::detail::kTokensPerBlock;

// The logits in W-lane vectors against fp64; their bits do not depend on the tile split.
template <int D, int W>
void check_logits(const std::vector<float>& q, int rows_padded, const std::vector<float>& k, int n_padded) {
  SCOPED_TRACE(testing::Message() << "logits in " << W << " lanes");
  float s[kMaxRowsPerPass][kTokensPerBlock];
  for (auto& row : s)
    for (float& x : row) x = kvq::test::kPoison;
  kvq::detail::tile_logits<D, W>(q.data(), rows_padded, k.data(), 0, n_padded, s);
  for (int r = 0; r < rows_padded; ++r)
    for (int j = 0; j < n_padded; ++j) {
      double ref = 0;
      for (int i = 0; i < D; ++i) ref += double(q[r * D + i]) * k[j * D + i];
      ASSERT_NEAR(s[r][j], ref, 1e-5 * (1 + std::sqrt(double(D)))) << "r " << r << " j " << j;
    }
  for (int r = rows_padded; r < kMaxRowsPerPass; ++r) EXPECT_EQ(s[r][0], kvq::test::kPoison) << "row " << r;
  if (n_padded < kTokensPerBlock) {
    EXPECT_EQ(s[0][n_padded], kvq::test::kPoison) << "token " << n_padded;
  }
  // The same tokens as two tiles (first > 0 for the second, as the decode's 32-token tiles
  // of a 64-token block): the same bits.
  const int split = n_padded / 8 * 4;
  float s2[kMaxRowsPerPass][kTokensPerBlock];
  kvq::detail::tile_logits<D, W>(q.data(), rows_padded, k.data(), 0, split, s2);
  kvq::detail::tile_logits<D, W>(q.data(), rows_padded, k.data() + split * D, split, n_padded - split, s2);
  for (int r = 0; r < rows_padded; ++r)
    ASSERT_EQ(std::memcmp(s[r], s2[r], n_padded * sizeof(float)), 0) << "split logits, row " << r;
}

template <int D>
void check_products(int rows_padded, int n, std::uint32_t seed) {
  const auto q = kvq::test::random_normal(std::size_t(rows_padded) * D, seed);
  const auto k = kvq::test::random_normal(std::size_t(kTokensPerBlock) * D, seed + 1);
  const auto v = kvq::test::random_normal(std::size_t(kTokensPerBlock) * D, seed + 2);
  const int n_padded = (n + 3) / 4 * 4;
  // The build's width (KVQ_CPU_FP32_LOGIT_BITS), and with AVX-512 the other one too.
  constexpr int W = kvq::detail::logit_lanes_for(D);
  check_logits<D, W>(q, rows_padded, k, n_padded);
  if constexpr (W == 8 && kvq::detail::lanes_for(D) == 16) check_logits<D, 16>(q, rows_padded, k, n_padded);
  if constexpr (W == 16) check_logits<D, 8>(q, rows_padded, k, n_padded);

  // Weights in [0, 1]; the accumulator starts from a nonzero state.
  const auto w = kvq::test::random_normal(std::size_t(kMaxRowsPerPass) * kTokensPerBlock, seed + 3);
  float p[kMaxRowsPerPass][kTokensPerBlock];
  for (int r = 0; r < kMaxRowsPerPass; ++r)
    for (int j = 0; j < kTokensPerBlock; ++j) p[r][j] = std::abs(w[r * kTokensPerBlock + j]) / 3.f;
  auto acc = kvq::test::random_normal(std::size_t(kMaxRowsPerPass) * D, seed + 4);
  const auto before = acc;
  auto acc2 = acc;
  kvq::detail::tile_accumulate<D>(p, rows_padded, v.data(), 0, n, acc.data());
  const int half = n / 2;
  kvq::detail::tile_accumulate<D>(p, rows_padded, v.data(), 0, half, acc2.data());
  kvq::detail::tile_accumulate<D>(p, rows_padded, v.data() + half * D, half, n - half, acc2.data());
  ASSERT_EQ(std::memcmp(acc.data(), acc2.data(), acc.size() * sizeof(float)), 0) << "split accumulation";
  for (int r = 0; r < kMaxRowsPerPass; ++r)
    for (int i = 0; i < D; ++i) {
      double ref = before[r * D + i];
      if (r < rows_padded)
        for (int j = 0; j < n; ++j) ref += double(p[r][j]) * v[j * D + i];
      ASSERT_NEAR(acc[r * D + i], ref, 1e-5 * (1 + n)) << "r " << r << " i " << i;
    }
}

TEST(CpuTile, ProductsMatchFp64Loops) {
  check_products<64>(1, 32, 1);
  check_products<128>(4, 64, 7);  // a whole block
  check_products<256>(16, 61, 8);
  check_products<64>(4, 5, 2);
  check_products<128>(16, 32, 3);
  check_products<128>(8, 1, 4);
  check_products<256>(12, 17, 5);
  check_products<24>(4, 7, 6);  // head_dim with no 16-float vector (dense attention allows it)
}

// The bound exp_approx states: 1.1 ulp of e^x over every float in [−87, 0] (checked
// exhaustively); here a grid and every 509th float pattern there.
TEST(CpuTile, ExpBlockIsWithinOneUlpOfExp) {
  std::vector<float> x;
  for (float t = -90.f; t <= 0.f; t += 0.0137f) x.push_back(t);
  for (std::uint32_t bits = 0x80000000u;; bits += 509) {
    float t;
    std::memcpy(&t, &bits, sizeof t);
    if (t < -87.f) break;
    x.push_back(t);
  }
  x.push_back(-0.f);
  x.push_back(-1e-30f);
  const std::vector<float> in = x;
  for (std::size_t j0 = 0; j0 < x.size(); j0 += kTokensPerBlock)
    kvq::detail::exp_block(x.data() + j0, int(std::min<std::size_t>(kTokensPerBlock, x.size() - j0)));
  for (std::size_t j = 0; j < x.size(); ++j) {
    if (in[j] < -87.f) {
      EXPECT_EQ(x[j], 0.f) << in[j];
      continue;
    }
    const double ref = std::exp(double(in[j]));
    const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);  // e^−87 is a normal float
    EXPECT_LE(std::abs(x[j] - ref), 1.1 * ulp) << "x = " << in[j];
  }
  float special[3] = {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), -87.5f};
  kvq::detail::exp_block(special, 3);
  EXPECT_EQ(special[0], 0.f);
  EXPECT_TRUE(std::isnan(special[1]));
  EXPECT_EQ(special[2], 0.f);
}

TEST(CpuTile, RowIsFiniteAndConvertRow) {
  std::vector<float> row(128, 1.5f);
  EXPECT_TRUE(kvq::detail::rows_are_finite<128>(row.data(), 1));
  row[77] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(kvq::detail::rows_are_finite<128>(row.data(), 1));
  row[77] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(kvq::detail::rows_are_finite<128>(row.data(), 1));
  row[77] = std::numeric_limits<float>::max();
  EXPECT_TRUE(kvq::detail::rows_are_finite<128>(row.data(), 1));

  // Every fp16 and bf16 bit pattern converts exactly as the scalar conversion does.
  std::vector<kvq::half_t> h(64);
  std::vector<kvq::bfloat16_t> b(64);
  std::vector<float> out(64);
  for (std::uint32_t base = 0; base < 65536; base += 64) {
    for (int i = 0; i < 64; ++i) {
      h[i] = kvq::half_t::from_bits(std::uint16_t(base + i));
      b[i] = kvq::bfloat16_t::from_bits(std::uint16_t(base + i));
    }
    kvq::detail::convert_row<64>(h.data(), out.data());
    for (int i = 0; i < 64; ++i) {
      const float ref = kvq::half_bits_to_float(std::uint16_t(base + i));
      ASSERT_TRUE(std::isnan(ref) ? std::isnan(out[i]) : out[i] == ref && std::signbit(out[i]) == std::signbit(ref))
          << std::hex << base + i;
    }
    kvq::detail::convert_row<64>(b.data(), out.data());
    for (int i = 0; i < 64; ++i) {
      const float ref = kvq::bf16_bits_to_float(std::uint16_t(base + i));
      ASSERT_TRUE(std::isnan(ref) ? std::isnan(out[i]) : out[i] == ref) << std::hex << base + i;
    }
  }
}

// The 16 logit reductions of a 4×4 block share one transpose; every sum must keep the
// bits of sum_lanes on its own accumulator (the same additions in the same order).
template <int W>
void check_sum_lanes_16() {
  const auto x = kvq::test::random_normal(16 * W, W, 1.f);
  kvq::detail::FloatVec<W> v[16];
  for (int m = 0; m < 16; ++m)
    for (int l = 0; l < W; ++l) v[m][l] = x[m * W + l] * float(1 + (l * 7919 + m) % 1000);  // mixed magnitudes
  float sums[16];
  std::fill(sums, sums + 16, std::numeric_limits<float>::quiet_NaN());
  kvq::detail::sum_lanes_16<W>(v, sums);
  for (int m = 0; m < 16; ++m) {
    const float one = kvq::detail::sum_lanes<W>(v[m]);
    EXPECT_EQ(std::memcmp(&sums[m], &one, sizeof one), 0) << "W " << W << " m " << m << ": " << sums[m] << " vs " << one;
  }
}

TEST(CpuTile, TransposedLaneSumsKeepEachSumsBits) {
  check_sum_lanes_16<4>();
  if constexpr (kvq::detail::kNativeFloatLanes >= 8) check_sum_lanes_16<8>();
  if constexpr (kvq::detail::kNativeFloatLanes >= 16) check_sum_lanes_16<16>();
}

// strided_rows writes base + u·stride for u < count, and nothing past count rounded up
// to a whole store of kRowPointersPerStore (the pointer arrays have kRowPointerSlots for
// that): runs of 1..64 rows, strides of a row of 16-, 32- and 64-byte codes and of a
// page's fp16 rows, starting anywhere in the array.
TEST(CpuTile, StridedRowsWritesEachRunsPointersAndNoMore) {
  using kvq::detail::kRowPointerSlots, kvq::detail::kRowPointersPerStore;
  static_assert(kRowPointerSlots >= kTokensPerBlock + kRowPointersPerStore - 1);
  alignas(64) static const std::uint8_t pool[66 * 512] = {};  // base + 63 rows of 512 bytes
  const std::uint8_t* poison = pool + 1;  // never a row start below
  for (const std::size_t stride : {16, 32, 64, 256, 512})
    for (int first = 0; first < kTokensPerBlock; first += 7)
      for (int count = 1; first + count <= kTokensPerBlock; ++count) {
        const std::uint8_t* rows[kRowPointerSlots];
        std::fill(rows, rows + kRowPointerSlots, poison);
        const std::uint8_t* base = pool + 2 * stride;
        kvq::detail::strided_rows(rows + first, base, stride, count);
        const int written_end =
            first + (count + kRowPointersPerStore - 1) / kRowPointersPerStore * kRowPointersPerStore;
        for (int j = 0; j < kRowPointerSlots; ++j) {
          if (j >= first && j < first + count) {
            ASSERT_EQ(rows[j], base + (j - first) * stride) << "stride " << stride << " first " << first << " count " << count;
          } else if (j < first || j >= written_end) {
            ASSERT_EQ(rows[j], poison) << "stride " << stride << " first " << first << " count " << count << " slot " << j;
          }
        }
      }
}

// The queue's accounting: each line that holds a queued byte is counted once, pace(n)
// spends them over n shares of steps, a full queue drops what comes after (prefetches are hints;
// what they ask for is checked by the codegen tests, cpu.prefetch_emitted.*).
TEST(CpuTile, PrefetchQueueSpendsEachQueuedLineOverThePacedSteps) {
  using kvq::detail::PrefetchQueue;
  alignas(64) static char bytes[64 * (PrefetchQueue::kMaxRuns + 8)];
  PrefetchQueue queue;
  queue.clear();
  queue.push(bytes + 10, 100);  // lines 0, 1
  queue.push(bytes + 128, 64);  // line 2
  queue.push(bytes + 200, 0);   // nothing
  queue.push(bytes + 255, 2);   // lines 3, 4
  EXPECT_EQ(queue.lines_left(), 5);
  queue.pace(2);  // 3 lines a step
  queue.step();
  EXPECT_EQ(queue.lines_left(), 2);
  queue.step();
  EXPECT_EQ(queue.lines_left(), 0);
  queue.step();
  EXPECT_EQ(queue.lines_left(), 0);

  queue.clear();
  for (int i = 0; i < PrefetchQueue::kMaxRuns + 7; ++i) queue.push(bytes + 64 * i, 1);
  EXPECT_EQ(queue.lines_left(), PrefetchQueue::kMaxRuns);
  queue.pace(PrefetchQueue::kMaxRuns / 2);  // 2 a share
  for (int i = 0; i < PrefetchQueue::kMaxRuns / 8; ++i) queue.step(2);
  EXPECT_EQ(queue.lines_left(), PrefetchQueue::kMaxRuns / 2);
  queue.pace(0);  // everything at the next step
  queue.step();
  EXPECT_EQ(queue.lines_left(), 0);
  queue.clear();
  queue.push(bytes, 4096);
  EXPECT_EQ(queue.lines_left(), 64);
  queue.flush();
  EXPECT_EQ(queue.lines_left(), 0);
}

// touch_os_span leaves its state at the OS page of the span's last byte (so the next span
// does not ask for that page again), whether the span crosses pages or not.
TEST(CpuTile, TouchOsSpanEndsOnTheOsPageOfItsLastByte) {
  using kvq::detail::kOsPageBytes;
  alignas(4096) static char bytes[5 * 4096];
  const auto page_of = [](const char* p) { return reinterpret_cast<std::uintptr_t>(p) / kOsPageBytes + 1; };
  std::uintptr_t page = 0;
  kvq::detail::touch_os_span(bytes + 100, bytes + 3 * 4096 + 5, page);
  EXPECT_EQ(page, page_of(bytes + 3 * 4096));
  kvq::detail::touch_os_span(bytes + 3 * 4096 + 64, bytes + 3 * 4096 + 4000, page);
  EXPECT_EQ(page, page_of(bytes + 3 * 4096));
  kvq::detail::touch_os_span(bytes + 4096 + 1, bytes + 4096 + 2, page);
  EXPECT_EQ(page, page_of(bytes + 4096));
  kvq::detail::touch_os_span(bytes + 4095, bytes + 4 * 4096, page);
  EXPECT_EQ(page, page_of(bytes + 4 * 4096));
}

}  // namespace
