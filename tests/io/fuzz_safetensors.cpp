// libFuzzer target for the safetensors reader (the calibration input and the OptR
// artifact format): any input must either parse or raise kvq::Error, and every tensor
// a parsed file exposes must convert without reading out of bounds.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvq/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  try {
    const auto f = kvq::io::SafetensorsFile::from_bytes(std::move(bytes));
    for (const auto& [k, v] : f.metadata()) (void)(k.size() + v.size());
    for (const auto& name : f.names()) {
      try {
        const auto v = f.to_float(name);
        volatile float sink = v.empty() ? 0.f : v.back();
        (void)sink;
      } catch (const kvq::Error&) {
      }
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
