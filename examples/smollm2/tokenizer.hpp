// examples/smollm2/tokenizer.hpp — GPT-2 byte-level BPE from GGUF metadata.
//
// Vocabulary and merges come from tokenizer.ggml.{tokens,merges,token_type}. Encoding:
//   1. control tokens (token_type 3, e.g. "<|im_start|>") are split off when
//      parse_special is set;
//   2. pre-tokenization, `smollm` flavour: every digit becomes its own piece, then the
//      GPT-2 pattern splits each remaining span (PCRE2 in UTF + UCP mode, because the
//      pattern needs Unicode classes and a lookahead, which std::regex lacks);
//   3. each piece's bytes are mapped through the GPT-2 byte→unicode table and merged by
//      BPE rank.
// Decoding concatenates token strings and maps the characters back to bytes.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/core/status.hpp"
#include "gguf.hpp"

namespace smollm2 {

// Appends the UTF-8 encoding of code point cp (< 0x110000) to s.
inline void append_utf8(std::string& s, std::uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the UTF-8 sequence starting with byte b (1 for invalid lead bytes, so a
// malformed string still advances).
inline int utf8_len(unsigned char b) {
  if (b < 0x80) return 1;
  if ((b >> 5) == 0x6) return 2;
  if ((b >> 4) == 0xE) return 3;
  if ((b >> 3) == 0x1E) return 4;
  return 1;
}

class Tokenizer {
 public:
  static constexpr int kControlType = 3;

  explicit Tokenizer(const smollm2::GGUFFile& f) {
    if (f.get_string("tokenizer.ggml.model") != "gpt2")
      throw kvq::Error(kvq::StatusCode::unsupported,
                       "tokenizer: only the gpt2 (byte-level BPE) model is implemented, file has '" +
                           f.get_string("tokenizer.ggml.model") + "'");
    if (auto pre = f.find("tokenizer.ggml.pre"); pre && pre->as_string() != "smollm")
      throw kvq::Error(kvq::StatusCode::unsupported,
                       "tokenizer: pre-tokenizer '" + pre->as_string() + "' is not implemented (only smollm)");
    tokens_ = f.get("tokenizer.ggml.tokens").as_string_array();
    for (std::size_t i = 0; i < tokens_.size(); ++i) token_id_.emplace(tokens_[i], static_cast<int>(i));
    const auto merges = f.get("tokenizer.ggml.merges").as_string_array();
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const auto sp = merges[r].find(' ', 1);  // the left part is never empty
      if (sp == std::string::npos)
        throw kvq::Error(kvq::StatusCode::corrupt_data, "tokenizer: merge '" + merges[r] + "' has no space");
      merge_rank_.emplace(merges[r], static_cast<int>(r));
    }
    if (auto tt = f.find("tokenizer.ggml.token_type")) {
      const auto types = tt->as_int_array();
      for (std::size_t i = 0; i < types.size() && i < tokens_.size(); ++i)
        if (types[i] == kControlType) specials_.emplace_back(tokens_[i], static_cast<int>(i));
    }
    bos_ = static_cast<int>(f.get_int("tokenizer.ggml.bos_token_id", -1));
    eos_ = static_cast<int>(f.get_int("tokenizer.ggml.eos_token_id", -1));
    add_bos_ = f.find("tokenizer.ggml.add_bos_token") && f.get("tokenizer.ggml.add_bos_token").as_bool();

    // GPT-2 byte→unicode: printable bytes map to themselves, the rest to 256, 257, ...
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const std::uint32_t cp = printable ? static_cast<std::uint32_t>(b) : static_cast<std::uint32_t>(next++);
      append_utf8(byte_char_[b], cp);
      char_byte_.emplace(byte_char_[b], static_cast<unsigned char>(b));
    }
    // SmolLM2's vocabulary lacks a few byte tokens (some control bytes and bytes that
    // never occur in valid UTF-8); such bytes encode as the unknown token.
    unk_ = static_cast<int>(f.get_int("tokenizer.ggml.unknown_token_id", -1));

    digit_re_ = compile("\\p{N}");
    gpt2_re_ = compile("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
    md_.reset(pcre2_match_data_create(64, nullptr));
  }

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int bos() const { return bos_; }
  int eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  const std::string& token(int id) const { return tokens_.at(static_cast<std::size_t>(id)); }

  // Token ids of `text` (UTF-8). Invalid UTF-8 is encoded byte by byte (bytes with no
  // token in the vocabulary become the unknown token).
  std::vector<int> encode(std::string_view text, bool parse_special = false) const {
    std::vector<int> out;
    if (!parse_special || specials_.empty()) {
      encode_plain(text, out);
      return out;
    }
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t best = std::string_view::npos, best_len = 0;
      int best_id = -1;
      for (const auto& [s, id] : specials_) {
        const auto at = text.find(s, pos);
        if (at != std::string_view::npos && (at < best || (at == best && s.size() > best_len))) {
          best = at;
          best_len = s.size();
          best_id = id;
        }
      }
      if (best == std::string_view::npos) break;
      encode_plain(text.substr(pos, best - pos), out);
      out.push_back(best_id);
      pos = best + best_len;
    }
    if (pos < text.size()) encode_plain(text.substr(pos), out);
    return out;
  }

  // Bytes of a token sequence; control tokens are emitted as their literal text.
  std::string decode(const std::vector<int>& ids) const {
    std::string out;
    for (int id : ids) out += decode_token(id);
    return out;
  }

  std::string decode_token(int id) const {
    const std::string& t = token(id);
    std::string out;
    for (std::size_t i = 0; i < t.size();) {
      const int n = utf8_len(static_cast<unsigned char>(t[i]));
      const std::string ch = t.substr(i, static_cast<std::size_t>(n));
      auto it = char_byte_.find(ch);
      if (it != char_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        out += ch;  // not a byte-level character (special tokens): keep verbatim
      }
      i += static_cast<std::size_t>(n);
    }
    return out;
  }

 private:
  struct CodeFree {
    void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  };
  struct MatchFree {
    void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
  };
  using Code = std::unique_ptr<pcre2_code, CodeFree>;

  static Code compile(const char* pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
    if (!c) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof buf);
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       std::string("tokenizer: regex error: ") + reinterpret_cast<const char*>(buf));
    }
    return Code(c);
  }

  // Splits s into [match | gap] pieces of `re` (gaps between matches are kept as pieces
  // too, so nothing is lost); calls f(piece, is_match).
  template <class F>
  void split(const Code& re, std::string_view s, F&& f) const {
    std::size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(re.get(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md_.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) throw kvq::Error(kvq::StatusCode::invalid_argument, "tokenizer: regex match failed");
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md_.get());
      const std::size_t b = ov[0], e = ov[1];
      if (b > last) f(s.substr(last, b - last), false);
      if (e > b) {
        f(s.substr(b, e - b), true);
        pos = e;
      } else {
        pos = e + 1;  // empty match: step over one byte (never happens with these patterns)
      }
      last = std::max(last, e);
    }
    if (last < s.size()) f(s.substr(last), false);
  }

  void encode_plain(std::string_view text, std::vector<int>& out) const {
    split(digit_re_, text, [&](std::string_view piece, bool is_digit) {
      if (is_digit) {
        bpe(piece, out);
        return;
      }
      split(gpt2_re_, piece, [&](std::string_view word, bool) { bpe(word, out); });
    });
  }

  // BPE of one pre-token: start from one symbol per byte, merge the lowest-rank pair.
  void bpe(std::string_view word, std::vector<int>& out) const {
    if (word.empty()) return;
    if (auto it = cache_.find(std::string(word)); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    std::vector<std::string> sym;
    sym.reserve(word.size());
    for (unsigned char b : word) sym.push_back(byte_char_[b]);
    std::string key;
    while (sym.size() > 1) {
      int best_rank = std::numeric_limits<int>::max();
      std::size_t best_i = 0;
      for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
        key.assign(sym[i]).append(" ").append(sym[i + 1]);
        auto it = merge_rank_.find(key);
        if (it != merge_rank_.end() && it->second < best_rank) {
          best_rank = it->second;
          best_i = i;
        }
      }
      if (best_rank == std::numeric_limits<int>::max()) break;
      sym[best_i] += sym[best_i + 1];
      sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best_i) + 1);
    }
    std::vector<int> ids;
    for (const auto& s : sym) {
      auto it = token_id_.find(s);
      if (it != token_id_.end()) {
        ids.push_back(it->second);
      } else {  // a merged symbol with no token (inconsistent vocab): fall back to bytes
        for (std::size_t i = 0; i < s.size();) {
          const int n = utf8_len(static_cast<unsigned char>(s[i]));
          auto bt = token_id_.find(s.substr(i, static_cast<std::size_t>(n)));
          if (bt != token_id_.end()) {
            ids.push_back(bt->second);
          } else if (unk_ >= 0) {
            ids.push_back(unk_);
          }
          i += static_cast<std::size_t>(n);
        }
      }
    }
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache_.size() < (1u << 18)) cache_.emplace(std::string(word), std::move(ids));
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> token_id_;
  std::unordered_map<std::string, int> merge_rank_;
  std::vector<std::pair<std::string, int>> specials_;
  std::array<std::string, 256> byte_char_;
  std::unordered_map<std::string, unsigned char> char_byte_;
  int bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = false;
  Code digit_re_, gpt2_re_;
  std::unique_ptr<pcre2_match_data, MatchFree> md_;  // not thread-safe: one tokenizer per thread
  mutable std::unordered_map<std::string, std::vector<int>> cache_;
};

}  // namespace smollm2
