// examples/smollm2/gguf.hpp — GGUF (v2/v3) reader with fp32 dequantization (host only).
// The example model's file format, not part of kvq (whose artifacts are safetensors).
//
// Layout (all little-endian):
//   "GGUF" u32 version u64 n_tensors u64 n_kv
//   n_kv × { string key, u32 value_type, value }
//   n_tensors × { string name, u32 n_dims, u64 ne[n_dims] (ne0 fastest), u32 ggml_type,
//                 u64 offset (relative to the data section, multiple of the alignment) }
//   padding to `general.alignment` (default 32), then the data section.
// string = u64 length + bytes (no terminator); array = u32 elem_type, u64 count, elems.
//
// Everything is bounds- and overflow-checked while parsing, so a truncated or corrupt
// file gives kvq::Error(corrupt_data) with the offending offset, never a read past the
// buffer. Tensor types with a known block size are accepted (so metadata and other
// tensors stay readable); to_float() dequantizes F32, F16, BF16, Q4_0, Q4_1 and Q8_0
// and reports any other type as unsupported.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvq/io/file.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/core/status.hpp"

namespace smollm2 {

using kvq::Error;
using kvq::StatusCode;
using kvq::io::read_file_bytes;

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader reinterprets little-endian bytes");

// Metadata value types (GGUF spec numbering).
enum class GGUFType : std::uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

constexpr const char* gguf_type_name(GGUFType t) {
  switch (t) {
    case GGUFType::UINT8: return "UINT8";
    case GGUFType::INT8: return "INT8";
    case GGUFType::UINT16: return "UINT16";
    case GGUFType::INT16: return "INT16";
    case GGUFType::UINT32: return "UINT32";
    case GGUFType::INT32: return "INT32";
    case GGUFType::FLOAT32: return "FLOAT32";
    case GGUFType::BOOL: return "BOOL";
    case GGUFType::STRING: return "STRING";
    case GGUFType::ARRAY: return "ARRAY";
    case GGUFType::UINT64: return "UINT64";
    case GGUFType::INT64: return "INT64";
    case GGUFType::FLOAT64: return "FLOAT64";
  }
  return "?";
}

// ggml tensor types (ggml.h numbering). Only those with a known block layout are listed.
enum class GGMLType : std::uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, BF16 = 30,
};

struct GGMLTypeTraits {
  const char* name;
  std::uint32_t block_elems;  // elements per block (1 for plain types)
  std::uint32_t block_bytes;  // bytes per block
};

// Returns nullopt for type ids this reader does not know.
constexpr std::optional<GGMLTypeTraits> ggml_type_traits(std::uint32_t id) {
  switch (id) {
    case 0: return GGMLTypeTraits{"F32", 1, 4};
    case 1: return GGMLTypeTraits{"F16", 1, 2};
    case 2: return GGMLTypeTraits{"Q4_0", 32, 2 + 16};
    case 3: return GGMLTypeTraits{"Q4_1", 32, 2 + 2 + 16};
    case 6: return GGMLTypeTraits{"Q5_0", 32, 2 + 4 + 16};
    case 7: return GGMLTypeTraits{"Q5_1", 32, 2 + 2 + 4 + 16};
    case 8: return GGMLTypeTraits{"Q8_0", 32, 2 + 32};
    case 9: return GGMLTypeTraits{"Q8_1", 32, 2 + 2 + 32};
    case 10: return GGMLTypeTraits{"Q2_K", 256, 84};
    case 11: return GGMLTypeTraits{"Q3_K", 256, 110};
    case 12: return GGMLTypeTraits{"Q4_K", 256, 144};
    case 13: return GGMLTypeTraits{"Q5_K", 256, 176};
    case 14: return GGMLTypeTraits{"Q6_K", 256, 210};
    case 15: return GGMLTypeTraits{"Q8_K", 256, 292};
    case 24: return GGMLTypeTraits{"I8", 1, 1};
    case 25: return GGMLTypeTraits{"I16", 1, 2};
    case 26: return GGMLTypeTraits{"I32", 1, 4};
    case 27: return GGMLTypeTraits{"I64", 1, 8};
    case 28: return GGMLTypeTraits{"F64", 1, 8};
    case 30: return GGMLTypeTraits{"BF16", 1, 2};
    default: return std::nullopt;
  }
}

inline const char* ggml_type_name(GGMLType t) {
  auto tr = ggml_type_traits(static_cast<std::uint32_t>(t));
  return tr ? tr->name : "?";
}

// One metadata value. Scalars live in `scalar` (unsigned ints as uint64, signed as
// int64, floats as double, BOOL as bool, STRING as std::string); ARRAY values keep
// their element type in `elem_type` and their elements (possibly arrays) in `array`.
struct GGUFValue {
  GGUFType type = GGUFType::UINT8;
  GGUFType elem_type = GGUFType::UINT8;
  std::variant<std::monostate, std::uint64_t, std::int64_t, double, bool, std::string> scalar;
  std::vector<GGUFValue> array;

  bool is_array() const { return type == GGUFType::ARRAY; }
  bool is_string() const { return type == GGUFType::STRING; }
  bool is_integer() const {
    return std::holds_alternative<std::uint64_t>(scalar) || std::holds_alternative<std::int64_t>(scalar);
  }

  // Integer value (any integer type or BOOL); throws when not representable.
  std::int64_t as_int() const {
    if (auto p = std::get_if<std::uint64_t>(&scalar)) {
      if (*p > static_cast<std::uint64_t>(INT64_MAX)) bad("does not fit int64");
      return static_cast<std::int64_t>(*p);
    }
    if (auto p = std::get_if<std::int64_t>(&scalar)) return *p;
    if (auto p = std::get_if<bool>(&scalar)) return *p ? 1 : 0;
    bad("is not an integer");
  }
  double as_double() const {
    if (auto p = std::get_if<double>(&scalar)) return *p;
    if (auto p = std::get_if<std::uint64_t>(&scalar)) return static_cast<double>(*p);
    if (auto p = std::get_if<std::int64_t>(&scalar)) return static_cast<double>(*p);
    bad("is not a number");
  }
  bool as_bool() const {
    if (auto p = std::get_if<bool>(&scalar)) return *p;
    bad("is not a bool");
  }
  const std::string& as_string() const {
    if (auto p = std::get_if<std::string>(&scalar)) return *p;
    bad("is not a string");
  }
  std::vector<std::string> as_string_array() const {
    if (!is_array() || elem_type != GGUFType::STRING) bad("is not an array of strings");
    std::vector<std::string> out;
    out.reserve(array.size());
    for (const auto& v : array) out.push_back(v.as_string());
    return out;
  }
  std::vector<std::int64_t> as_int_array() const {
    if (!is_array()) bad("is not an array");
    std::vector<std::int64_t> out;
    out.reserve(array.size());
    for (const auto& v : array) out.push_back(v.as_int());
    return out;
  }
  std::vector<double> as_double_array() const {
    if (!is_array()) bad("is not an array");
    std::vector<double> out;
    out.reserve(array.size());
    for (const auto& v : array) out.push_back(v.as_double());
    return out;
  }

 private:
  [[noreturn]] void bad(const char* what) const {
    throw Error(StatusCode::invalid_argument,
                std::string("gguf: value of type ") + gguf_type_name(type) + " " + what);
  }
};

// A tensor's description; `data` is exactly its bytes inside the file buffer.
struct GGUFTensorInfo {
  std::string name;
  GGMLType type = GGMLType::F32;
  std::vector<std::int64_t> shape;  // ne0 first (ne0 = contiguous dimension)
  std::uint64_t offset = 0;         // relative to the data section
  std::span<const std::byte> data;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

namespace gguf_detail {

[[noreturn]] inline void corrupt(const std::string& msg, std::uint64_t at) {
  throw Error(StatusCode::corrupt_data, "gguf: " + msg + " (at byte " + std::to_string(at) + ")");
}

// Bounds-checked little-endian reader over the file buffer.
class Cursor {
 public:
  explicit Cursor(std::span<const std::byte> b) : b_(b) {}
  std::uint64_t pos() const { return pos_; }
  std::uint64_t remaining() const { return b_.size() - pos_; }

  void need(std::uint64_t n, const char* what) const {
    if (n > remaining())
      corrupt(std::string("truncated while reading ") + what + " (need " + std::to_string(n) +
                  " bytes, " + std::to_string(remaining()) + " left)",
              pos_);
  }
  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const char* what) {
    const auto n = read<std::uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

 private:
  std::span<const std::byte> b_;
  std::uint64_t pos_ = 0;
};

// Smallest encoded size of one value of type t (to reject counts no file could hold
// before allocating for them).
inline std::uint64_t min_encoded_size(GGUFType t) {
  switch (t) {
    case GGUFType::UINT8: case GGUFType::INT8: case GGUFType::BOOL: return 1;
    case GGUFType::UINT16: case GGUFType::INT16: return 2;
    case GGUFType::UINT32: case GGUFType::INT32: case GGUFType::FLOAT32: return 4;
    case GGUFType::UINT64: case GGUFType::INT64: case GGUFType::FLOAT64: return 8;
    case GGUFType::STRING: return 8;
    case GGUFType::ARRAY: return 4 + 8;
  }
  return 1;
}

inline bool valid_type(std::uint32_t t) { return t <= 12; }

constexpr int kMaxArrayDepth = 8;

inline GGUFValue read_value(Cursor& c, GGUFType t, int depth) {
  GGUFValue v;
  v.type = t;
  switch (t) {
    case GGUFType::UINT8: v.scalar = std::uint64_t{c.read<std::uint8_t>("UINT8")}; break;
    case GGUFType::INT8: v.scalar = std::int64_t{c.read<std::int8_t>("INT8")}; break;
    case GGUFType::UINT16: v.scalar = std::uint64_t{c.read<std::uint16_t>("UINT16")}; break;
    case GGUFType::INT16: v.scalar = std::int64_t{c.read<std::int16_t>("INT16")}; break;
    case GGUFType::UINT32: v.scalar = std::uint64_t{c.read<std::uint32_t>("UINT32")}; break;
    case GGUFType::INT32: v.scalar = std::int64_t{c.read<std::int32_t>("INT32")}; break;
    case GGUFType::UINT64: v.scalar = c.read<std::uint64_t>("UINT64"); break;
    case GGUFType::INT64: v.scalar = c.read<std::int64_t>("INT64"); break;
    case GGUFType::FLOAT32: v.scalar = double{c.read<float>("FLOAT32")}; break;
    case GGUFType::FLOAT64: v.scalar = c.read<double>("FLOAT64"); break;
    case GGUFType::BOOL: {
      const auto at = c.pos();
      const auto b = c.read<std::uint8_t>("BOOL");
      if (b > 1) corrupt("BOOL value " + std::to_string(b) + " is neither 0 nor 1", at);
      v.scalar = b == 1;
      break;
    }
    case GGUFType::STRING: v.scalar = c.read_string("STRING"); break;
    case GGUFType::ARRAY: {
      if (depth >= kMaxArrayDepth) corrupt("arrays nested deeper than 8", c.pos());
      const auto at = c.pos();
      const auto et = c.read<std::uint32_t>("array element type");
      if (!valid_type(et)) corrupt("unknown array element type " + std::to_string(et), at);
      v.elem_type = static_cast<GGUFType>(et);
      const auto n = c.read<std::uint64_t>("array length");
      if (n > c.remaining() / min_encoded_size(v.elem_type))
        corrupt("array length " + std::to_string(n) + " exceeds the file", at);
      v.array.reserve(static_cast<std::size_t>(n));
      for (std::uint64_t i = 0; i < n; ++i) v.array.push_back(read_value(c, v.elem_type, depth + 1));
      break;
    }
  }
  return v;
}

inline float f16(const std::byte* p) {
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return kvq::half_bits_to_float(b);
}

}  // namespace gguf_detail

// A parsed GGUF file held in memory (the whole file is read; SmolLM2-135M is ~90 MB).
class GGUFFile {
 public:
  static constexpr std::uint32_t kDefaultAlignment = 32;

  static GGUFFile open(const std::filesystem::path& path) {
    try {
      return from_bytes(read_file_bytes(path));
    } catch (const Error& e) {
      if (e.code() == StatusCode::io_error) throw;
      throw Error(e.code(), std::string(e.what()) + " in '" + path.string() + "'");
    }
  }

  static GGUFFile from_bytes(std::vector<std::byte> bytes) {
    GGUFFile f;
    f.buf_ = std::move(bytes);
    f.parse();
    return f;
  }

  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  std::uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GGUFValue>>& metadata() const { return kv_; }
  const GGUFValue* find(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
  }
  const GGUFValue& get(std::string_view key) const {
    if (auto v = find(key)) return *v;
    throw Error(StatusCode::invalid_argument, "gguf: missing metadata key '" + std::string(key) + "'");
  }
  std::int64_t get_int(std::string_view key) const { return get(key).as_int(); }
  std::int64_t get_int(std::string_view key, std::int64_t dflt) const {
    auto v = find(key);
    return v ? v->as_int() : dflt;
  }
  double get_double(std::string_view key) const { return get(key).as_double(); }
  double get_double(std::string_view key, double dflt) const {
    auto v = find(key);
    return v ? v->as_double() : dflt;
  }
  const std::string& get_string(std::string_view key) const { return get(key).as_string(); }

  const std::vector<GGUFTensorInfo>& tensors() const { return tensors_; }
  const GGUFTensorInfo* find_tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  const GGUFTensorInfo& tensor(std::string_view name) const {
    if (auto t = find_tensor(name)) return *t;
    throw Error(StatusCode::invalid_argument, "gguf: no tensor named '" + std::string(name) + "'");
  }

  // Dequantizes a tensor to fp32 in storage order (ne0 fastest): a 2-D weight with
  // shape {ne0, ne1} becomes a row-major [ne1][ne0] matrix.
  std::vector<float> to_float(std::string_view name) const { return dequantize(tensor(name)); }

  static std::vector<float> dequantize(const GGUFTensorInfo& t) {
    const auto tr = ggml_type_traits(static_cast<std::uint32_t>(t.type));
    for (auto d : t.shape)
      if (d < 0) throw Error(StatusCode::invalid_argument, "gguf: tensor '" + t.name + "' has a negative dim");
    const auto n = static_cast<std::size_t>(t.numel());
    if (!tr || n % tr->block_elems != 0 || t.data.size() != n / tr->block_elems * tr->block_bytes)
      throw Error(StatusCode::invalid_argument,
                  "gguf: tensor '" + t.name + "' data size does not match its shape and type");
    std::vector<float> out(n);
    const std::byte* p = t.data.data();
    switch (t.type) {
      case GGMLType::F32:
        if (n) std::memcpy(out.data(), p, n * 4);
        break;
      case GGMLType::F16:
        for (std::size_t i = 0; i < n; ++i) out[i] = gguf_detail::f16(p + 2 * i);
        break;
      case GGMLType::BF16:
        for (std::size_t i = 0; i < n; ++i) {
          std::uint16_t b;
          std::memcpy(&b, p + 2 * i, 2);
          out[i] = kvq::bf16_bits_to_float(b);
        }
        break;
      case GGMLType::Q4_0:  // {f16 d; u8 qs[16]}: x[j] = (lo nibble - 8)·d, x[j+16] = (hi - 8)·d
        for (std::size_t blk = 0; blk < n / 32; ++blk) {
          const std::byte* b = p + blk * 18;
          const float d = gguf_detail::f16(b);
          float* o = out.data() + blk * 32;
          for (int j = 0; j < 16; ++j) {
            const auto q = static_cast<std::uint8_t>(b[2 + j]);
            o[j] = static_cast<float>((q & 0xF) - 8) * d;
            o[j + 16] = static_cast<float>((q >> 4) - 8) * d;
          }
        }
        break;
      case GGMLType::Q4_1:  // {f16 d; f16 m; u8 qs[16]}: x = nibble·d + m
        for (std::size_t blk = 0; blk < n / 32; ++blk) {
          const std::byte* b = p + blk * 20;
          const float d = gguf_detail::f16(b);
          const float m = gguf_detail::f16(b + 2);
          float* o = out.data() + blk * 32;
          for (int j = 0; j < 16; ++j) {
            const auto q = static_cast<std::uint8_t>(b[4 + j]);
            o[j] = static_cast<float>(q & 0xF) * d + m;
            o[j + 16] = static_cast<float>(q >> 4) * d + m;
          }
        }
        break;
      case GGMLType::Q8_0:  // {f16 d; i8 qs[32]}: x = q·d
        for (std::size_t blk = 0; blk < n / 32; ++blk) {
          const std::byte* b = p + blk * 34;
          const float d = gguf_detail::f16(b);
          float* o = out.data() + blk * 32;
          for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(static_cast<std::int8_t>(b[2 + j])) * d;
        }
        break;
      default:
        throw Error(StatusCode::unsupported,
                    "gguf: tensor '" + t.name + "' has type " + ggml_type_name(t.type) +
                        "; only F32, F16, BF16, Q4_0, Q4_1 and Q8_0 can be dequantized");
    }
    return out;
  }

 private:
  void parse() {
    using gguf_detail::corrupt;
    gguf_detail::Cursor c(buf_);
    c.need(4, "magic");
    if (std::memcmp(buf_.data(), "GGUF", 4) != 0) corrupt("bad magic (not a GGUF file)", 0);
    (void)c.read<std::uint32_t>("magic");
    version_ = c.read<std::uint32_t>("version");
    if (version_ != 2 && version_ != 3)
      throw Error(StatusCode::unsupported,
                  "gguf: version " + std::to_string(version_) + " is not supported (only 2 and 3)");
    const auto n_tensors = c.read<std::uint64_t>("tensor count");
    const auto n_kv = c.read<std::uint64_t>("metadata count");
    // Each metadata entry takes >= 8+1+4+1 bytes and each tensor info >= 8+1+4+4+8.
    if (n_kv > c.remaining() / 14) corrupt("metadata count " + std::to_string(n_kv) + " exceeds the file", 16);
    if (n_tensors > c.remaining() / 25)
      corrupt("tensor count " + std::to_string(n_tensors) + " exceeds the file", 8);

    kv_.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      const auto at = c.pos();
      std::string key = c.read_string("metadata key");
      const auto tpos = c.pos();
      const auto t = c.read<std::uint32_t>("metadata value type");
      if (!gguf_detail::valid_type(t))
        corrupt("metadata '" + key + "' has unknown value type " + std::to_string(t), tpos);
      GGUFValue v = gguf_detail::read_value(c, static_cast<GGUFType>(t), 0);
      if (!kv_index_.emplace(key, kv_.size()).second) corrupt("duplicate metadata key '" + key + "'", at);
      kv_.emplace_back(std::move(key), std::move(v));
    }

    if (auto a = find("general.alignment")) {
      if (a->type != GGUFType::UINT32) corrupt("general.alignment must be UINT32", 0);
      const auto al = static_cast<std::uint64_t>(a->as_int());
      if (al == 0 || (al & (al - 1)) != 0)
        corrupt("general.alignment " + std::to_string(al) + " is not a power of two", 0);
      alignment_ = al;
    }

    struct Raw {
      std::uint64_t nbytes;
    };
    std::vector<Raw> raw;
    tensors_.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      const auto at = c.pos();
      GGUFTensorInfo t;
      t.name = c.read_string("tensor name");
      const auto n_dims = c.read<std::uint32_t>("tensor n_dims");
      if (n_dims > 4) corrupt("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dims (max 4)", at);
      std::uint64_t numel = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const auto ne = c.read<std::uint64_t>("tensor dim");
        if (ne > static_cast<std::uint64_t>(INT64_MAX) || (ne != 0 && numel > static_cast<std::uint64_t>(INT64_MAX) / ne))
          corrupt("tensor '" + t.name + "' has an element count that overflows int64", at);
        numel *= ne;
        t.shape.push_back(static_cast<std::int64_t>(ne));
      }
      const auto tpos = c.pos();
      const auto type = c.read<std::uint32_t>("tensor type");
      const auto tr = ggml_type_traits(type);
      if (!tr)
        throw Error(StatusCode::unsupported, "gguf: tensor '" + t.name + "' has unknown ggml type " +
                                                 std::to_string(type) + " (at byte " + std::to_string(tpos) + ")");
      t.type = static_cast<GGMLType>(type);
      if (!t.shape.empty() && static_cast<std::uint64_t>(t.shape[0]) % tr->block_elems != 0)
        corrupt("tensor '" + t.name + "': ne0 " + std::to_string(t.shape[0]) + " is not a multiple of the " +
                    tr->name + " block size " + std::to_string(tr->block_elems), at);
      if (t.shape.empty() && tr->block_elems != 1)
        corrupt("tensor '" + t.name + "': a 0-dim tensor cannot be block-quantized", at);
      const std::uint64_t blocks = numel / tr->block_elems;
      if (blocks > UINT64_MAX / tr->block_bytes) corrupt("tensor '" + t.name + "' byte size overflows", at);
      t.offset = c.read<std::uint64_t>("tensor offset");
      if (t.offset % alignment_ != 0)
        corrupt("tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not aligned to " +
                    std::to_string(alignment_), at);
      if (!tensor_index_.emplace(t.name, tensors_.size()).second)
        corrupt("duplicate tensor name '" + t.name + "'", at);
      raw.push_back({blocks * tr->block_bytes});
      tensors_.push_back(std::move(t));
    }

    // Data section begins at the next multiple of the alignment.
    const std::uint64_t pos = c.pos();
    const std::uint64_t pad = (alignment_ - pos % alignment_) % alignment_;
    if (n_tensors > 0 && pad > c.remaining()) corrupt("truncated before the data section", pos);
    data_offset_ = pos + (n_tensors > 0 ? pad : 0);
    const std::uint64_t data_size = buf_.size() - data_offset_;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto& t = tensors_[i];
      if (t.offset > data_size || raw[i].nbytes > data_size - t.offset)
        corrupt("tensor '" + t.name + "' data [" + std::to_string(t.offset) + ", +" +
                    std::to_string(raw[i].nbytes) + ") lies past the end of the data section (" +
                    std::to_string(data_size) + " bytes)",
                data_offset_);
      t.data = std::span<const std::byte>(buf_.data() + data_offset_ + t.offset,
                                          static_cast<std::size_t>(raw[i].nbytes));
    }
  }

  std::vector<std::byte> buf_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = kDefaultAlignment;
  std::uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GGUFValue>> kv_;
  std::map<std::string, std::size_t, std::less<>> kv_index_;
  std::vector<GGUFTensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

}  // namespace smollm2
