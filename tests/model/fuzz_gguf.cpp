// libFuzzer target for the GGUF reader: any input must either parse or raise
// kvq::Error, and everything a parsed file exposes (metadata accessors, tensor
// dequantization) must stay in bounds. Built with clang -fsanitize=fuzzer,address,undefined
// by the kvq_fuzz_gguf target; `.ci/kvq.sh fuzz` runs it for a bounded time.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf.hpp"

namespace {

void touch(const smollm2::GGUFValue& v) {
  try {
    if (v.is_array()) {
      for (const auto& e : v.array) touch(e);
      (void)v.as_int_array();
    } else if (v.is_string()) {
      (void)v.as_string().size();
    } else {
      (void)v.as_double();
      (void)v.as_int();
    }
  } catch (const kvq::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  try {
    const auto f = smollm2::GGUFFile::from_bytes(std::move(bytes));
    for (const auto& [key, value] : f.metadata()) touch(value);
    for (const auto& t : f.tensors()) {
      if (t.numel() > (1 << 20)) continue;  // zero-dim tricks can describe big empty tensors
      try {
        const auto v = f.to_float(t.name);
        volatile float sink = v.empty() ? 0.f : v.back();
        (void)sink;
      } catch (const kvq::Error&) {
      }
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
