// GGUF reader: every metadata type (nested arrays included), tensor infos, alignment,
// dequantization of F32/F16/BF16/Q4_0/Q4_1/Q8_0 against hand-computed values, and
// corrupt inputs (every truncation, bad magic, huge counts, overflowing sizes) that must
// raise kvq::Error rather than read out of bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "gguf_builder.hpp"
#include "gguf.hpp"

namespace {

using kvq::StatusCode;
using smollm2::GGMLType;
using smollm2::GGUFFile;
using smollm2::GGUFType;
using kvq_test::GGUFBuilder;

enum : std::uint32_t { U8 = 0, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 };

std::uint16_t h(float x) { return kvq::half_t(x).bits; }

// A file with all metadata types, alignment 64 and one tensor of each dequantizable type.
std::vector<std::byte> make_model_file() {
  GGUFBuilder g;
  g.header(6, 16);
  g.key("u8", U8).put<std::uint8_t>(200);
  g.key("i8", I8).put<std::int8_t>(-100);
  g.key("u16", U16).put<std::uint16_t>(60000);
  g.key("i16", I16).put<std::int16_t>(-30000);
  g.key("u32", U32).put<std::uint32_t>(4000000000u);
  g.key("i32", I32).put<std::int32_t>(-2000000000);
  g.key("f32", F32).put<float>(1e5f);
  g.key("bool", BOOL).put<std::uint8_t>(1);
  g.key("str", STR).str("héllo");
  g.key("u64", U64).put<std::uint64_t>(1ull << 60);
  g.key("i64", I64).put<std::int64_t>(-(1ll << 60));
  g.key("f64", F64).put<double>(-0.125);
  g.key("arr.str", ARR).put<std::uint32_t>(STR).put<std::uint64_t>(3).str("a").str("").str("Ġthe");
  g.key("arr.nested", ARR).put<std::uint32_t>(ARR).put<std::uint64_t>(2);
  g.put<std::uint32_t>(I32).put<std::uint64_t>(2).put<std::int32_t>(-1).put<std::int32_t>(7);
  g.put<std::uint32_t>(F32).put<std::uint64_t>(1).put<float>(2.5f);
  g.key("arr.empty", ARR).put<std::uint32_t>(U8).put<std::uint64_t>(0);
  g.key("general.alignment", U32).put<std::uint32_t>(64);
  // Tensors (offsets relative to the data section, multiples of 64).
  g.tensor_info("f32", {3, 2}, 0, 0);        // 24 bytes
  g.tensor_info("f16", {4}, 1, 64);          // 8 bytes
  g.tensor_info("bf16", {2}, 30, 128);       // 4 bytes
  g.tensor_info("q4_0", {32}, 2, 192);       // 18 bytes
  g.tensor_info("q4_1", {32, 2}, 3, 256);    // 40 bytes
  g.tensor_info("q8_0", {32}, 8, 320);       // 34 bytes
  g.align(64);
  const auto data0 = g.b.size();
  auto at = [&](std::size_t off) { g.b.resize(data0 + off, std::byte{0}); };
  at(0);
  for (float x : {1.f, 2.f, 3.f, -4.f, 5.5f, 6.f}) g.put<float>(x);
  at(64);
  for (float x : {0.5f, -2.f, 65504.f, 1e-7f}) g.put<std::uint16_t>(h(x));
  at(128);
  g.put<std::uint16_t>(kvq::bfloat16_t(3.0f).bits).put<std::uint16_t>(kvq::bfloat16_t(-0.75f).bits);
  at(192);  // Q4_0: d = 0.5; qs[j] = lo j%16, hi 15 - j%16
  g.put<std::uint16_t>(h(0.5f));
  for (int j = 0; j < 16; ++j) g.put<std::uint8_t>(static_cast<std::uint8_t>(j | ((15 - j) << 4)));
  at(256);  // Q4_1: two blocks, d = 0.25, m = -1 and d = 2, m = 3
  for (auto [d, m] : {std::pair{0.25f, -1.f}, std::pair{2.f, 3.f}}) {
    g.put<std::uint16_t>(h(d)).put<std::uint16_t>(h(m));
    for (int j = 0; j < 16; ++j) g.put<std::uint8_t>(static_cast<std::uint8_t>(j | ((15 - j) << 4)));
  }
  at(320);  // Q8_0: d = 0.1 (rounded to fp16), qs = -128, -127, ..., -97
  g.put<std::uint16_t>(h(0.1f));
  for (int j = 0; j < 32; ++j) g.put<std::int8_t>(static_cast<std::int8_t>(-128 + j));
  return g.b;
}

StatusCode code_of(std::vector<std::byte> bytes) {
  try {
    (void)GGUFFile::from_bytes(std::move(bytes));
  } catch (const kvq::Error& e) {
    return e.code();
  }
  return StatusCode::ok;
}

TEST(GGUF, MetadataOfEveryType) {
  const auto f = GGUFFile::from_bytes(make_model_file());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  ASSERT_EQ(f.metadata().size(), 16u);
  EXPECT_EQ(f.metadata()[0].first, "u8");
  EXPECT_EQ(f.get_int("u8"), 200);
  EXPECT_EQ(f.get_int("i8"), -100);
  EXPECT_EQ(f.get_int("u16"), 60000);
  EXPECT_EQ(f.get_int("i16"), -30000);
  EXPECT_EQ(f.get_int("u32"), 4000000000);
  EXPECT_EQ(f.get_int("i32"), -2000000000);
  EXPECT_EQ(f.get_double("f32"), 1e5);
  EXPECT_TRUE(f.get("bool").as_bool());
  EXPECT_EQ(f.get_string("str"), "héllo");
  EXPECT_EQ(f.get_int("u64"), 1ll << 60);
  EXPECT_EQ(f.get_int("i64"), -(1ll << 60));
  EXPECT_EQ(f.get_double("f64"), -0.125);
  EXPECT_EQ(f.get("u32").type, GGUFType::UINT32);
  EXPECT_EQ(f.get("arr.str").as_string_array(), (std::vector<std::string>{"a", "", "Ġthe"}));
  const auto& nested = f.get("arr.nested");
  ASSERT_TRUE(nested.is_array());
  EXPECT_EQ(nested.elem_type, GGUFType::ARRAY);
  ASSERT_EQ(nested.array.size(), 2u);
  EXPECT_EQ(nested.array[0].as_int_array(), (std::vector<std::int64_t>{-1, 7}));
  EXPECT_EQ(nested.array[1].as_double_array(), std::vector<double>{2.5});
  EXPECT_TRUE(f.get("arr.empty").array.empty());
  EXPECT_EQ(f.get_int("missing", 42), 42);
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THROW((void)f.get("missing"), kvq::Error);
  EXPECT_THROW((void)f.get("str").as_int(), kvq::Error);
  EXPECT_THROW((void)f.get("u8").as_string(), kvq::Error);
}

TEST(GGUF, TensorInfosAndDequantization) {
  const auto f = GGUFFile::from_bytes(make_model_file());
  ASSERT_EQ(f.tensors().size(), 6u);
  const auto& t = f.tensor("q4_1");
  EXPECT_EQ(t.type, GGMLType::Q4_1);
  EXPECT_EQ(t.shape, (std::vector<std::int64_t>{32, 2}));
  EXPECT_EQ(t.offset, 256u);
  EXPECT_EQ(t.data.size(), 40u);
  EXPECT_EQ(f.to_float("f32"), (std::vector<float>{1, 2, 3, -4, 5.5f, 6}));
  const auto f16 = f.to_float("f16");
  EXPECT_EQ(f16[0], 0.5f);
  EXPECT_EQ(f16[1], -2.f);
  EXPECT_EQ(f16[2], 65504.f);
  EXPECT_EQ(f16[3], kvq::half_t(1e-7f).to_float());
  EXPECT_GT(f16[3], 0.f);  // fp16 subnormal survives
  EXPECT_EQ(f.to_float("bf16"), (std::vector<float>{3.f, -0.75f}));
  const auto q40 = f.to_float("q4_0");
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(q40[j], (j - 8) * 0.5f);
    EXPECT_EQ(q40[j + 16], (15 - j - 8) * 0.5f);
  }
  const auto q41 = f.to_float("q4_1");
  ASSERT_EQ(q41.size(), 64u);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(q41[j], j * 0.25f - 1.f);
    EXPECT_EQ(q41[j + 16], (15 - j) * 0.25f - 1.f);
    EXPECT_EQ(q41[32 + j], j * 2.f + 3.f);
    EXPECT_EQ(q41[48 + j], (15 - j) * 2.f + 3.f);
  }
  const auto q80 = f.to_float("q8_0");
  const float d = kvq::half_t(0.1f).to_float();
  for (int j = 0; j < 32; ++j) EXPECT_EQ(q80[j], static_cast<float>(-128 + j) * d);
  EXPECT_THROW((void)f.tensor("nope"), kvq::Error);
}

TEST(GGUF, UnsupportedTypesAreClearErrors) {
  // A Q6_K tensor parses (its size is known) but cannot be dequantized.
  GGUFBuilder g;
  g.header(1, 0).tensor_info("k", {256}, 14, 0).align(32);
  g.b.resize(g.b.size() + 210);
  const auto f = GGUFFile::from_bytes(g.b);
  try {
    (void)f.to_float("k");
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), StatusCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("Q6_K"), std::string::npos) << e.what();
  }
  // Unknown type ids and versions are rejected at open.
  GGUFBuilder u;
  u.header(1, 0).tensor_info("k", {32}, 99, 0).align(32);
  u.b.resize(u.b.size() + 64);
  EXPECT_EQ(code_of(u.b), StatusCode::unsupported);
  GGUFBuilder v1;
  v1.header(0, 0, 1);
  EXPECT_EQ(code_of(v1.b), StatusCode::unsupported);
}

TEST(GGUF, EveryTruncationIsCorruptData) {
  const auto good = make_model_file();
  ASSERT_EQ(code_of(good), StatusCode::ok);
  for (std::size_t n = 0; n < good.size(); ++n) {
    // Cutting inside the final padding of the last tensor is still invalid because the
    // Q8_0 tensor ends exactly at the file end.
    EXPECT_EQ(code_of({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)}), StatusCode::corrupt_data)
        << "prefix of " << n << " bytes";
  }
}

TEST(GGUF, CorruptHeadersAndCounts) {
  const auto C = StatusCode::corrupt_data;
  {
    auto b = make_model_file();
    b[0] = std::byte{'X'};
    EXPECT_EQ(code_of(b), C);
  }
  auto with_header = [](std::uint64_t nt, std::uint64_t nkv) {
    GGUFBuilder g;
    g.header(nt, nkv);
    g.b.resize(g.b.size() + 64);
    return g.b;
  };
  EXPECT_EQ(code_of(with_header(0, ~0ull)), C);
  EXPECT_EQ(code_of(with_header(~0ull, 0)), C);
  EXPECT_EQ(code_of(with_header(1ull << 40, 1ull << 40)), C);
  {  // array count larger than the file
    GGUFBuilder g;
    g.header(0, 1).key("a", ARR).put<std::uint32_t>(U64).put<std::uint64_t>(1ull << 61);
    EXPECT_EQ(code_of(g.b), C);
  }
  {  // string length larger than the file, and one that overflows pos + n
    GGUFBuilder g;
    g.header(0, 1).key("s", STR).put<std::uint64_t>(~0ull);
    EXPECT_EQ(code_of(g.b), C);
  }
  {  // unknown metadata and array element types
    GGUFBuilder g;
    g.header(0, 1).key("x", 13).put<std::uint32_t>(0);
    EXPECT_EQ(code_of(g.b), C);
    GGUFBuilder a;
    a.header(0, 1).key("x", ARR).put<std::uint32_t>(77).put<std::uint64_t>(0);
    EXPECT_EQ(code_of(a.b), C);
  }
  {  // BOOL that is neither 0 nor 1
    GGUFBuilder g;
    g.header(0, 1).key("b", BOOL).put<std::uint8_t>(2);
    EXPECT_EQ(code_of(g.b), C);
  }
  {  // arrays nested too deep
    GGUFBuilder g;
    g.header(0, 1).key("n", ARR);
    for (int i = 0; i < 20; ++i) g.put<std::uint32_t>(ARR).put<std::uint64_t>(1);
    g.put<std::uint32_t>(U8).put<std::uint64_t>(0);
    EXPECT_EQ(code_of(g.b), C);
  }
  {  // duplicate key
    GGUFBuilder g;
    g.header(0, 2).key("k", U8).put<std::uint8_t>(1).key("k", U8).put<std::uint8_t>(2);
    EXPECT_EQ(code_of(g.b), C);
  }
  {  // alignment not a power of two, and of the wrong type
    GGUFBuilder g;
    g.header(0, 1).key("general.alignment", U32).put<std::uint32_t>(24);
    EXPECT_EQ(code_of(g.b), C);
    GGUFBuilder z;
    z.header(0, 1).key("general.alignment", U32).put<std::uint32_t>(0);
    EXPECT_EQ(code_of(z.b), C);
    GGUFBuilder t;
    t.header(0, 1).key("general.alignment", U64).put<std::uint64_t>(32);
    EXPECT_EQ(code_of(t.b), C);
  }
  auto one_tensor = [](std::vector<std::uint64_t> ne, std::uint32_t type, std::uint64_t off, std::size_t data) {
    GGUFBuilder g;
    g.header(1, 0).tensor_info("t", std::move(ne), type, off).align(32);
    g.b.resize(g.b.size() + data);
    return g.b;
  };
  EXPECT_EQ(code_of(one_tensor({4}, 0, 0, 16)), StatusCode::ok);
  EXPECT_EQ(code_of(one_tensor({4}, 0, 0, 15)), C);                          // data past the end
  EXPECT_EQ(code_of(one_tensor({4}, 0, 8, 64)), C);                          // misaligned offset
  EXPECT_EQ(code_of(one_tensor({4}, 0, ~0ull - 31, 64)), C);                 // offset + size overflows
  EXPECT_EQ(code_of(one_tensor({1ull << 32, 1ull << 32}, 0, 0, 64)), C);     // numel overflows
  EXPECT_EQ(code_of(one_tensor({1ull << 62}, 0, 0, 64)), C);                 // bytes overflow
  EXPECT_EQ(code_of(one_tensor({1ull << 63}, 0, 0, 64)), C);                 // dim > INT64_MAX
  EXPECT_EQ(code_of(one_tensor({1, 1, 1, 1, 1}, 0, 0, 64)), C);              // too many dims
  EXPECT_EQ(code_of(one_tensor({16}, 2, 0, 64)), C);                         // not whole Q4_0 blocks
  {  // duplicate tensor names
    GGUFBuilder g;
    g.header(2, 0).tensor_info("t", {4}, 0, 0).tensor_info("t", {4}, 0, 32).align(32);
    g.b.resize(g.b.size() + 64);
    EXPECT_EQ(code_of(g.b), C);
  }
}

TEST(GGUF, RandomByteFlipsNeverEscapeAsOtherErrors) {
  // Parsing mutated files must either succeed or throw kvq::Error; dequantizing every
  // tensor of a file that parsed must stay in bounds (checked under ASan in CI).
  const auto good = make_model_file();
  std::mt19937 rng(1234);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<std::byte>(rng() & 0xFF);
    try {
      const auto f = GGUFFile::from_bytes(std::move(b));
      ++parsed;
      for (const auto& t : f.tensors()) {
        try {
          (void)f.to_float(t.name);
        } catch (const kvq::Error& e) {
          EXPECT_EQ(e.code(), StatusCode::unsupported);
        }
      }
    } catch (const kvq::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
