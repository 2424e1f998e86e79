// Tokenizer on the real SmolLM2 vocabulary: ids checked against HF `tokenizers`
// (built from the same GGUF vocab/merges with Digits + ByteLevel pre-tokenizers) and
// byte-exact round trips on UTF-8.
#include <gtest/gtest.h>

#include "model_env.hpp"

namespace {

TEST(SmolLM2Tokenizer, MatchesReferenceIds) {
  KVQ_REQUIRE_SMOLLM2(m);
  // Reference ids from HF tokenizers 0.23 (see examples/smollm2/README.md).
  EXPECT_EQ(m->tok.encode("The capital of France is"), (std::vector<int>{504, 3575, 282, 4649, 314}));
  // Digits are split one by one (smollm pre-tokenizer).
  EXPECT_EQ(m->tok.encode("In 1887,"), (std::vector<int>{788, 216, 33, 40, 40, 39, 28}));
  EXPECT_EQ(m->tok.bos(), 1);
  EXPECT_EQ(m->tok.eos(), 2);
  EXPECT_EQ(m->tok.vocab_size(), 49152);
}

TEST(SmolLM2Tokenizer, SpecialTokensOnlyWhenAsked) {
  KVQ_REQUIRE_SMOLLM2(m);
  const auto with = m->tok.encode("<|im_start|>user", true);
  ASSERT_FALSE(with.empty());
  EXPECT_EQ(m->tok.token(with[0]), "<|im_start|>");
  const auto without = m->tok.encode("<|im_start|>user", false);
  EXPECT_GT(without.size(), with.size());
  EXPECT_EQ(m->tok.decode(with), "<|im_start|>user");
}

TEST(SmolLM2Tokenizer, Utf8RoundTrip) {
  KVQ_REQUIRE_SMOLLM2(m);
  const char* texts[] = {
      "Héllo wörld! Ça va? naïve café",
      "I'm can't we'll they've he'd",
      "12345 3.14159 1,000,000 ²³ ½",
      "  multiple   spaces\tand\ttabs\n\nnew lines \n",
      "日本語のテキスト、中文文本。한국어",
      "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧",
      "a\u00a0b\u2003c\u3000d",
      "",
  };
  for (const char* t : texts) {
    const auto ids = m->tok.encode(t);
    EXPECT_EQ(m->tok.decode(ids), t) << t;
    for (int id : ids) EXPECT_NE(id, 0) << "no unknown tokens in valid text: " << t;
  }
  // Different texts give different ids (a broken encoder returning bytes would still round-trip).
  EXPECT_LT(m->tok.encode("the the the the").size(), 8u);
}

TEST(SmolLM2Tokenizer, InvalidUtf8NeverCrashes) {
  KVQ_REQUIRE_SMOLLM2(m);
  const std::string bad = std::string("ok \xff\xfe broken \xc3 tail \xe2\x82", 23);
  const auto ids = m->tok.encode(bad);
  EXPECT_FALSE(ids.empty());
  for (int id : ids) EXPECT_TRUE(id >= 0 && id < m->tok.vocab_size());
}

}  // namespace
