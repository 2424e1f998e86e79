// The online softmax step of the CPU decode (kvq/cpu/online.hpp): the block step for all
// rows (four rows folded together with AVX-512) equals the one-row step bit for bit (NaN
// payloads aside) —
// weights, running max and sum, rescaled accumulators and the "any weight" answer — on
// random logits with causal masks, rows that see nothing, rising, steady and falling
// maxima (with AVX-512, blocks that raise no row's maximum skip the max reduction), NaN
// and ±Inf.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/cpu/online.hpp"

namespace {

using kvq::detail::kMaxRowsPerPass;
using kvq::detail::kTokensPerBlock;

constexpr int D = 64;

struct State {
  alignas(64) float s[kMaxRowsPerPass][kTokensPerBlock];
  float m[kMaxRowsPerPass], l[kMaxRowsPerPass];
  alignas(64) float acc[kMaxRowsPerPass * D];
};

// Bit for bit, except that any NaN equals any NaN: the payload and sign of a NaN depend
// on operand order, which the compiler may swap in the one-row step's additions.
void expect_same_bits(const float* a, const float* b, int count, const char* what, int block) {
  for (int i = 0; i < count; ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    ASSERT_EQ(std::memcmp(a + i, b + i, 4), 0) << what << " " << i << " (block " << block << "): " << a[i] << " vs " << b[i];
  }
}

// trend: how much the logits' mean moves per block (> 0: maxima rise, rescaling).
void check_rows(int rows, std::uint32_t seed, float trend) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " seed " << seed << " trend " << trend);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int padded = kvq::detail::padded_rows(rows);
  int limit[kMaxRowsPerPass];
  for (int r = 0; r < rows; ++r) limit[r] = int(rng() % 200) - 20;  // some rows see nothing at all
  State fast, slow;
  for (int r = 0; r < kMaxRowsPerPass; ++r) {
    fast.m[r] = slow.m[r] = kvq::neg_inf_f();
    fast.l[r] = slow.l[r] = 0.f;
  }
  for (int i = 0; i < kMaxRowsPerPass * D; ++i) fast.acc[i] = slow.acc[i] = normal(rng);
  for (int block = 0; block < 6; ++block) {
    const int t0 = block * kTokensPerBlock, n = block == 5 ? 1 + int(rng() % (kTokensPerBlock - 1)) : kTokensPerBlock;
    for (int r = 0; r < kMaxRowsPerPass; ++r) {
      const bool all_minus_inf = rng() % 16 == 0;  // a visible row of −∞ logits
      for (int j = 0; j < kTokensPerBlock; ++j) {
        // Maxima that move from block to block, ties, ±0 and rare specials.
        float x = 2.f * normal(rng) + trend * float(block);
        const std::uint32_t pick = rng() % 400;
        if (pick == 0) x = NAN;
        if (pick == 1 || all_minus_inf) x = -INFINITY;
        if (pick == 2) x = rng() % 2 ? 0.f : -0.f;
        fast.s[r][j] = slow.s[r][j] = x;
      }
    }
    // Padding rows hold garbage: the step must overwrite them with zero weights.
    for (int r = rows; r < padded; ++r)
      for (int j = 0; j < kTokensPerBlock; ++j) fast.s[r][j] = slow.s[r][j] = 1e30f;
    const bool any_fast = kvq::detail::softmax_block<D>(fast.s, rows, limit, t0, n, fast.acc, fast.m, fast.l);
    bool any_slow = false;
    for (int r = 0; r < rows; ++r)
      any_slow = kvq::detail::softmax_row<D>(slow.s, r, limit, t0, n, slow.acc, slow.m, slow.l) || any_slow;
    ASSERT_EQ(any_fast, any_slow) << "block " << block;
    if (!any_slow) continue;  // the caller skips the block: its weights are not read
    for (int r = rows; r < padded; ++r) std::fill(slow.s[r], slow.s[r] + kTokensPerBlock, 0.f);
    expect_same_bits(&fast.s[0][0], &slow.s[0][0], padded * kTokensPerBlock, "weight", block);
    expect_same_bits(fast.m, slow.m, rows, "max", block);
    expect_same_bits(fast.l, slow.l, rows, "sum", block);
    expect_same_bits(fast.acc, slow.acc, rows * D, "accumulator", block);
  }
}

TEST(OnlineSoftmax, BlockStepMatchesTheOneRowStep) {
  std::uint32_t seed = 1;
  for (float trend : {3.f, 0.f, -2.f})
    for (int rows : {1, 2, 3, 4, 5, 8, 11, 16})
      for (int rep = 0; rep < 20; ++rep) check_rows(rows, seed++, trend);
}

}  // namespace
