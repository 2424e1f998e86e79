// kvq/io/safetensors.hpp — safetensors reader and writer (host only).
//
// Format: u64 little-endian header length N, then N bytes of UTF-8 JSON
//   { "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//     "__metadata__": {"key": "value", ...} }
// then the data section; offsets are relative to its start. Tensor data is raw
// little-endian, row-major (last dimension contiguous).
//
// This is the calibration input/output format of DESIGN §6. The reader validates every
// offset and size before handing out a view, so malformed files give kvq::Error
// (corrupt_data / io_error), never an out-of-bounds read.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/io/file.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/core/status.hpp"

namespace kvq::io {

static_assert(std::endian::native == std::endian::little,
              "kvq::io reads little-endian files by reinterpreting bytes");

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

inline bool parse_dtype(std::string_view s, DType& out) {
  static constexpr DType all[] = {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64,
                                  DType::I32, DType::I16, DType::I8,  DType::U8,   DType::BOOL};
  for (DType t : all)
    if (s == dtype_name(t)) {
      out = t;
      return true;
    }
  return false;
}

// A named tensor inside a SafetensorsFile; `data` points into the file's buffer and
// has exactly product(shape) * dtype_size(dtype) bytes.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

namespace detail {

[[noreturn]] inline void corrupt(const std::string& msg) {
  throw Error(StatusCode::corrupt_data, "safetensors: " + msg);
}

// Product of dims, or false when any dim is negative or the product overflows `limit`.
inline bool checked_numel(const std::vector<std::int64_t>& shape, std::uint64_t limit,
                          std::uint64_t& out) {
  std::uint64_t n = 1;
  for (auto d : shape) {
    if (d < 0) return false;
    const auto ud = static_cast<std::uint64_t>(d);
    if (ud != 0 && n > limit / ud) return false;
    n *= ud;
  }
  out = n;
  return true;
}

}  // namespace detail

// Read-only safetensors file held in memory. Tensor views stay valid as long as the
// SafetensorsFile object lives (moves keep them valid: the buffer is not reallocated).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path) {
    try {
      return from_bytes(read_file_bytes(path));
    } catch (const Error& e) {
      if (e.code() == StatusCode::io_error) throw;
      throw Error(e.code(), std::string(e.what()) + " (in '" + path.string() + "')");
    }
  }

  static SafetensorsFile from_bytes(std::vector<std::byte> bytes) {
    SafetensorsFile f;
    f.buf_ = std::move(bytes);
    f.parse();
    return f;
  }

  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }

  const TensorView& tensor(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end())
      throw Error(StatusCode::invalid_argument,
                  "safetensors: no tensor named '" + std::string(name) + "'");
    return tensors_[it->second];
  }

  // Converts a floating tensor (F16/BF16/F32/F64) to fp32, row-major.
  std::vector<float> to_float(std::string_view name) const {
    const TensorView& t = tensor(name);
    const std::size_t n = t.data.size() / dtype_size(t.dtype);
    std::vector<float> out(n);
    const std::byte* p = t.data.data();
    switch (t.dtype) {
      case DType::F32:
        if (n) std::memcpy(out.data(), p, n * 4);
        break;
      case DType::F64:
        for (std::size_t i = 0; i < n; ++i) {
          double d;
          std::memcpy(&d, p + 8 * i, 8);
          out[i] = static_cast<float>(d);
        }
        break;
      case DType::F16:
      case DType::BF16:
        for (std::size_t i = 0; i < n; ++i) {
          std::uint16_t b;
          std::memcpy(&b, p + 2 * i, 2);
          out[i] = t.dtype == DType::F16 ? half_bits_to_float(b) : bf16_bits_to_float(b);
        }
        break;
      default:
        throw Error(StatusCode::unsupported, std::string("safetensors: tensor '") + t.name +
                                                 "' has dtype " + dtype_name(t.dtype) +
                                                 ", to_float needs F16/BF16/F32/F64");
    }
    return out;
  }

  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Names in file-offset order (the order the writer emitted them).
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    v.reserve(tensors_.size());
    for (const auto& t : tensors_) v.push_back(t.name);
    return v;
  }

  std::size_t size() const { return tensors_.size(); }

 private:
  void parse() {
    using nlohmann::json;
    if (buf_.size() < 8) detail::corrupt("file shorter than the 8-byte header length");
    std::uint64_t hlen;
    std::memcpy(&hlen, buf_.data(), 8);
    if (hlen > buf_.size() - 8)
      detail::corrupt("header length " + std::to_string(hlen) + " exceeds file size " +
                      std::to_string(buf_.size()));
    const char* hp = reinterpret_cast<const char*>(buf_.data() + 8);
    json h;
    try {
      h = json::parse(hp, hp + hlen);
    } catch (const json::exception& e) {
      detail::corrupt(std::string("header is not valid JSON: ") + e.what());
    }
    if (!h.is_object()) detail::corrupt("header is not a JSON object");
    const std::size_t data_begin = 8 + static_cast<std::size_t>(hlen);
    const std::uint64_t data_size = buf_.size() - data_begin;

    struct Pending {
      std::uint64_t begin, end;
      std::size_t idx;
    };
    std::vector<Pending> ranges;
    for (auto it = h.begin(); it != h.end(); ++it) {
      const std::string& key = it.key();
      const json& v = it.value();
      if (key == "__metadata__") {
        if (!v.is_object()) detail::corrupt("__metadata__ is not an object");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string())
            detail::corrupt("__metadata__['" + m.key() + "'] is not a string");
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const std::string where = "tensor '" + key + "': ";
      if (!v.is_object()) detail::corrupt(where + "entry is not an object");
      auto dt = v.find("dtype");
      auto sh = v.find("shape");
      auto of = v.find("data_offsets");
      if (dt == v.end() || !dt->is_string()) detail::corrupt(where + "missing string 'dtype'");
      if (sh == v.end() || !sh->is_array()) detail::corrupt(where + "missing array 'shape'");
      if (of == v.end() || !of->is_array() || of->size() != 2)
        detail::corrupt(where + "'data_offsets' must be [begin, end]");
      TensorView t;
      t.name = key;
      if (!parse_dtype(dt->get<std::string>(), t.dtype))
        detail::corrupt(where + "unknown dtype '" + dt->get<std::string>() + "'");
      for (const auto& d : *sh) {
        if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<std::int64_t>() >= 0))
          detail::corrupt(where + "shape entries must be non-negative integers");
        const auto ud = d.get<std::uint64_t>();
        if (ud > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          detail::corrupt(where + "shape entry too large");
        t.shape.push_back(static_cast<std::int64_t>(ud));
      }
      for (const auto& o : *of)
        if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<std::int64_t>() >= 0))
          detail::corrupt(where + "data_offsets must be non-negative integers");
      const auto b = (*of)[0].get<std::uint64_t>();
      const auto e = (*of)[1].get<std::uint64_t>();
      if (b > e) detail::corrupt(where + "data_offsets begin > end");
      if (e > data_size)
        detail::corrupt(where + "data_offsets end " + std::to_string(e) +
                        " past the data section (" + std::to_string(data_size) + " bytes)");
      std::uint64_t numel = 0;
      const std::uint64_t es = dtype_size(t.dtype);
      if (!detail::checked_numel(t.shape, data_size / es + 1, numel) || numel * es != e - b)
        detail::corrupt(where + "byte size " + std::to_string(e - b) +
                        " does not match shape x dtype size");
      t.data = std::span<const std::byte>(buf_.data() + data_begin + b, static_cast<std::size_t>(e - b));
      ranges.push_back({b, e, tensors_.size()});
      tensors_.push_back(std::move(t));
    }
    // Order by offset so names() follows the writer's order.
    std::sort(ranges.begin(), ranges.end(), [](const Pending& x, const Pending& y) {
      return x.begin != y.begin ? x.begin < y.begin : x.idx < y.idx;
    });
    std::vector<TensorView> sorted;
    sorted.reserve(tensors_.size());
    for (const auto& r : ranges) sorted.push_back(std::move(tensors_[r.idx]));
    tensors_ = std::move(sorted);
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  std::vector<std::byte> buf_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file in memory. Tensors are written in insertion order and
// packed back to back; the header is padded with spaces so the data section starts
// 8-byte aligned (as the reference implementation does).
class SafetensorsWriter {
 public:
  // `data` holds product(shape) * dtype_size(dtype) bytes and is copied.
  void add(std::string name, DType dtype, std::vector<std::int64_t> shape, const void* data) {
    if (name.empty() || name == "__metadata__")
      throw Error(StatusCode::invalid_argument, "safetensors: invalid tensor name '" + name + "'");
    for (const auto& e : entries_)
      if (e.name == name)
        throw Error(StatusCode::invalid_argument, "safetensors: duplicate tensor '" + name + "'");
    std::uint64_t numel = 0;
    if (!detail::checked_numel(shape, std::numeric_limits<std::uint64_t>::max() / 8, numel))
      throw Error(StatusCode::invalid_argument, "safetensors: bad shape for '" + name + "'");
    const std::size_t bytes = static_cast<std::size_t>(numel * dtype_size(dtype));
    if (bytes && !data)
      throw Error(StatusCode::invalid_argument, "safetensors: null data for '" + name + "'");
    Entry e{std::move(name), dtype, std::move(shape), std::vector<std::byte>(bytes)};
    if (bytes) std::memcpy(e.bytes.data(), data, bytes);
    entries_.push_back(std::move(e));
  }

  // fp32 values stored as `stored`: F32 as they are, F16 or BF16 rounded to nearest even
  // (kvq::half_t / bfloat16_t, saturating as they do).
  void add_f32(std::string name, std::vector<std::int64_t> shape, std::span<const float> values,
               DType stored = DType::F32) {
    std::uint64_t numel = 0;
    if (!detail::checked_numel(shape, std::numeric_limits<std::uint64_t>::max() / 8, numel) ||
        numel != values.size())
      throw Error(StatusCode::invalid_argument,
                  "safetensors: '" + name + "' has " + std::to_string(values.size()) +
                      " values, shape needs " + std::to_string(numel));
    if (stored == DType::F32) return add(std::move(name), DType::F32, std::move(shape), values.data());
    if (stored != DType::F16 && stored != DType::BF16)
      throw Error(StatusCode::invalid_argument, "safetensors: fp32 values can be stored as F32, F16 or BF16 only");
    std::vector<std::uint16_t> bits(values.size());
    for (std::size_t i = 0; i < values.size(); ++i)
      bits[i] = stored == DType::F16 ? half_t(values[i]).bits : bfloat16_t(values[i]).bits;
    add(std::move(name), stored, std::move(shape), bits.data());
  }

  void set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

  std::vector<std::byte> to_bytes() const {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      nlohmann::ordered_json m = nlohmann::ordered_json::object();
      for (const auto& [k, v] : metadata_) m[k] = v;
      h["__metadata__"] = m;
    }
    std::uint64_t off = 0;
    for (const auto& e : entries_) {
      const std::uint64_t begin = off;
      off += e.bytes.size();
      h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {begin, off}}};
    }
    std::string hs = h.dump();
    while ((8 + hs.size()) % 8 != 0) hs.push_back(' ');
    std::vector<std::byte> out(8 + hs.size() + off);
    const std::uint64_t hlen = hs.size();
    std::memcpy(out.data(), &hlen, 8);
    std::memcpy(out.data() + 8, hs.data(), hs.size());
    std::size_t pos = 8 + hs.size();
    for (const auto& e : entries_) {
      if (!e.bytes.empty()) std::memcpy(out.data() + pos, e.bytes.data(), e.bytes.size());
      pos += e.bytes.size();
    }
    return out;
  }

  void write(const std::filesystem::path& path) const {
    const auto bytes = to_bytes();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(StatusCode::io_error, "cannot create '" + path.string() + "'");
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!f) throw Error(StatusCode::io_error, "write failed for '" + path.string() + "'");
  }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvq::io
