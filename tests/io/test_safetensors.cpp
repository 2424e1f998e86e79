// Safetensors reader/writer: round trips, dtype conversion, and malformed inputs that
// must raise kvq::Error(corrupt_data) instead of reading out of bounds.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "kvq/io/safetensors.hpp"

namespace {

using kvq::io::DType;
using kvq::io::SafetensorsFile;
using kvq::io::SafetensorsWriter;

std::vector<std::byte> raw_file(const std::string& header, std::size_t data_bytes) {
  std::vector<std::byte> out(8 + header.size() + data_bytes, std::byte{0});
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

kvq::StatusCode code_of(const std::vector<std::byte>& bytes) {
  try {
    (void)SafetensorsFile::from_bytes(bytes);
  } catch (const kvq::Error& e) {
    return e.code();
  }
  return kvq::StatusCode::ok;
}

TEST(Safetensors, RoundTripAllDtypes) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> f32(2 * 3 * 4);
  for (auto& x : f32) x = nd(rng);
  std::vector<double> f64 = {1.5, -2.25, 1e10};
  std::vector<std::int32_t> i32 = {1, -2, 3, 1 << 30};
  std::vector<std::int64_t> i64 = {-(1LL << 40), 5};
  std::vector<std::uint8_t> u8 = {0, 255, 17};
  std::vector<std::uint16_t> f16 = {kvq::half_t(1.5f).bits, kvq::half_t(-0.125f).bits};
  std::vector<std::uint16_t> bf16 = {kvq::bfloat16_t(3.0f).bits, kvq::bfloat16_t(-1e20f).bits};

  SafetensorsWriter w;
  w.add_f32("a.f32", {2, 3, 4}, f32);
  w.add("b.f64", DType::F64, {3}, f64.data());
  w.add("c.i32", DType::I32, {2, 2}, i32.data());
  w.add("d.i64", DType::I64, {2}, i64.data());
  w.add("e.u8", DType::U8, {3}, u8.data());
  w.add("f.f16", DType::F16, {2}, f16.data());
  w.add("g.bf16", DType::BF16, {1, 2}, bf16.data());
  w.add("h.empty", DType::F32, {0, 5}, nullptr);
  w.add("i.scalar", DType::F32, {}, f32.data());
  w.set_metadata("source", "unit test");
  w.set_metadata("policy", "K4V2");

  const auto bytes = w.to_bytes();
  std::uint64_t hlen;
  std::memcpy(&hlen, bytes.data(), 8);
  EXPECT_EQ((8 + hlen) % 8, 0u) << "data section must start 8-byte aligned";

  const auto f = SafetensorsFile::from_bytes(bytes);
  EXPECT_EQ(f.size(), 9u);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a.f32", "b.f64", "c.i32", "d.i64", "e.u8",
                                                 "f.f16", "g.bf16", "h.empty", "i.scalar"}));
  EXPECT_EQ(f.metadata().at("source"), "unit test");
  EXPECT_EQ(f.metadata().at("policy"), "K4V2");
  EXPECT_TRUE(f.contains("c.i32"));
  EXPECT_FALSE(f.contains("zzz"));

  EXPECT_EQ(f.tensor("a.f32").shape, (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(f.to_float("a.f32"), f32);
  EXPECT_EQ(f.to_float("b.f64"), (std::vector<float>{1.5f, -2.25f, 1e10f}));
  EXPECT_EQ(f.to_float("f.f16"), (std::vector<float>{1.5f, -0.125f}));
  EXPECT_EQ(f.to_float("g.bf16"), (std::vector<float>{3.0f, kvq::bfloat16_t(-1e20f).to_float()}));
  EXPECT_TRUE(f.to_float("h.empty").empty());
  EXPECT_EQ(f.tensor("i.scalar").numel(), 1);
  EXPECT_EQ(f.to_float("i.scalar"), std::vector<float>{f32[0]});

  const auto& ti = f.tensor("c.i32");
  ASSERT_EQ(ti.data.size(), 16u);
  std::vector<std::int32_t> back(4);
  std::memcpy(back.data(), ti.data.data(), 16);
  EXPECT_EQ(back, i32);
  const auto& tu = f.tensor("e.u8");
  EXPECT_EQ(static_cast<int>(tu.data[1]), 255);
  EXPECT_EQ(f.tensor("d.i64").dtype, DType::I64);

  EXPECT_THROW((void)f.to_float("c.i32"), kvq::Error);
  EXPECT_THROW((void)f.tensor("nope"), kvq::Error);
}

TEST(Safetensors, FileRoundTrip) {
  const auto path = std::filesystem::temp_directory_path() / "kvq_test_safetensors.safetensors";
  std::vector<float> v = {1, 2, 3, 4, 5, 6};
  SafetensorsWriter w;
  w.add_f32("x", {2, 3}, v);
  w.write(path);
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.to_float("x"), v);
  std::filesystem::remove(path);
  try {
    (void)SafetensorsFile::open(path);
    FAIL() << "opening a missing file must throw";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::StatusCode::io_error);
  }
}

TEST(Safetensors, WriterRejectsBadInput) {
  SafetensorsWriter w;
  std::vector<float> v(6);
  EXPECT_THROW(w.add_f32("x", {2, 2}, v), kvq::Error);
  EXPECT_THROW(w.add("y", DType::F32, {-1}, v.data()), kvq::Error);
  EXPECT_THROW(w.add("__metadata__", DType::F32, {1}, v.data()), kvq::Error);
  w.add_f32("x", {6}, v);
  EXPECT_THROW(w.add_f32("x", {6}, v), kvq::Error);
}

TEST(Safetensors, ReadsHandWrittenHeader) {
  // Offsets out of insertion order and a whitespace-padded header, as other writers emit.
  auto b = raw_file(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                    R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}   )", 8);
  const float one = 1.0f, two = 2.0f;
  std::memcpy(b.data() + b.size() - 8, &one, 4);
  std::memcpy(b.data() + b.size() - 4, &two, 4);
  const auto f = SafetensorsFile::from_bytes(b);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(f.to_float("b"), std::vector<float>{2.0f});
}

TEST(Safetensors, MalformedInputsAreCorruptData) {
  using kvq::StatusCode;
  const auto C = StatusCode::corrupt_data;
  EXPECT_EQ(code_of({}), C);
  EXPECT_EQ(code_of(std::vector<std::byte>(7)), C);
  // Header length past the end, including values that overflow 8 + n.
  for (std::uint64_t n : {std::uint64_t{100}, ~std::uint64_t{0}, ~std::uint64_t{0} - 7}) {
    std::vector<std::byte> b(16);
    std::memcpy(b.data(), &n, 8);
    EXPECT_EQ(code_of(b), C) << n;
  }
  const char* bad_headers[] = {
      "not json",
      "[1,2]",
      R"({"__metadata__":[1]})",
      R"({"__metadata__":{"k":1}})",
      R"({"t":5})",
      R"({"t":{"shape":[1],"data_offsets":[0,4]}})",
      R"({"t":{"dtype":"F32","data_offsets":[0,4]}})",
      R"({"t":{"dtype":"F32","shape":[1]}})",
      R"({"t":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})",
      R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
      R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})",
      R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
      R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})",
      R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
      R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",    // size mismatch
      R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",   // past the end
      R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})",
      R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
      R"({"t":{"dtype":"F64","shape":[9223372036854775807,2],"data_offsets":[0,0]}})",
      R"({"t":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})",
  };
  for (const char* h : bad_headers) EXPECT_EQ(code_of(raw_file(h, 8)), C) << h;
  // A valid file truncated anywhere must fail cleanly.
  SafetensorsWriter w;
  std::vector<float> v = {1, 2, 3};
  w.add_f32("x", {3}, v);
  w.set_metadata("k", "v");
  const auto good = w.to_bytes();
  ASSERT_EQ(code_of(good), StatusCode::ok);
  for (std::size_t n = 0; n < good.size(); ++n) {
    std::vector<std::byte> t(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_EQ(code_of(t), C) << "truncated at " << n;
  }
}

}  // namespace
