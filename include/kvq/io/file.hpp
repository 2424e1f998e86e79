// kvq/io/file.hpp — whole-file reads shared by the GGUF and safetensors readers.
#pragma once

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/core/status.hpp"

namespace kvq::io {

// The bytes of file `p`; kvq::Error(io_error) when it cannot be opened or read.
inline std::vector<std::byte> read_file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary | std::ios::ate);
  if (!f) throw Error(StatusCode::io_error, "cannot open '" + p.string() + "'");
  const std::streamoff n = f.tellg();
  if (n < 0) throw Error(StatusCode::io_error, "cannot size '" + p.string() + "'");
  std::vector<std::byte> buf(static_cast<std::size_t>(n));
  f.seekg(0);
  if (n > 0 && !f.read(reinterpret_cast<char*>(buf.data()), n))
    throw Error(StatusCode::io_error, "short read from '" + p.string() + "'");
  return buf;
}

}  // namespace kvq::io
