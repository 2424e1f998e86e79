// Test helper: writes small GGUF files byte by byte, so tests can build well-formed
// files and then corrupt them in targeted ways.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvq_test {

struct GGUFBuilder {
  std::vector<std::byte> b;

  template <class T>
  GGUFBuilder& put(T v) {
    const auto at = b.size();
    b.resize(at + sizeof(T));
    std::memcpy(b.data() + at, &v, sizeof(T));
    return *this;
  }
  GGUFBuilder& str(const std::string& s) {
    put<std::uint64_t>(s.size());
    for (char c : s) b.push_back(static_cast<std::byte>(c));
    return *this;
  }
  GGUFBuilder& header(std::uint64_t n_tensors, std::uint64_t n_kv, std::uint32_t version = 3) {
    for (char c : std::string("GGUF")) b.push_back(static_cast<std::byte>(c));
    return put<std::uint32_t>(version).put<std::uint64_t>(n_tensors).put<std::uint64_t>(n_kv);
  }
  // key + type tag; the caller then writes the value.
  GGUFBuilder& key(const std::string& k, std::uint32_t type) { return str(k).put<std::uint32_t>(type); }
  GGUFBuilder& tensor_info(const std::string& name, std::vector<std::uint64_t> ne, std::uint32_t type,
                           std::uint64_t offset) {
    str(name).put<std::uint32_t>(static_cast<std::uint32_t>(ne.size()));
    for (auto d : ne) put<std::uint64_t>(d);
    return put<std::uint32_t>(type).put<std::uint64_t>(offset);
  }
  GGUFBuilder& align(std::size_t a) {
    while (b.size() % a) b.push_back(std::byte{0});
    return *this;
  }
  GGUFBuilder& bytes(const void* p, std::size_t n) {
    const auto at = b.size();
    b.resize(at + n);
    std::memcpy(b.data() + at, p, n);
    return *this;
  }
};

}  // namespace kvq_test
