// examples/smollm2/cache_config.hpp — which policy each layer's cache gets, and where its
// run-time parameters (DESIGN §3: key means μ_K, learned rotations R_K, R_V) come from.
// Shared by every smollm2_eval subcommand that builds quantized caches.
#pragma once

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/cache/host_cache.hpp"
#include "kvq/calib/artifact.hpp"
#include "common.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace smollm2 {

// Cache options of the CLI (kvq::HostCacheOptions without the model's head counts).
struct CacheArgs {
  int sink = 64, recent = 256, flush = 16, page = 16, block = 64;
  bool int8_keys = false, int8_values = false;
  kvq::HostCacheOptions options() const {
    kvq::HostCacheOptions o;
    o.sink_tokens = sink;
    o.recent_tokens = recent;
    o.flush_block = flush;
    o.page_size = page;
    o.max_query_tokens = block;
    o.key_scoring = int8_keys ? kvq::KeyScoring::int8_query : kvq::KeyScoring::fp32_tiles;
    o.value_accumulation = int8_values ? kvq::ValueAccumulation::int8_weights : kvq::ValueAccumulation::fp32_tiles;
    return o;
  }
};

inline std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The policy a spelling names (kvq::parse_policy: a preset, optionally with :kclip=,
// :vclip=, :meta=), at head_dim 128; nothing for "fp32". Throws for other spellings.
inline std::optional<kvq::Policy> parse_policy(std::string_view spelling) {
  if (spelling == "fp32") return std::nullopt;
  kvq::Policy p{};
  kvq::throw_if_error(kvq::parse_policy(spelling, p));
  return p;
}

// Bits per cached element of the quantized part, metadata included (fp32 → 32).
inline double policy_bits(const std::string& name, int head_dim) {
  const auto p = parse_policy(name);
  return p ? p->with_head_dim(head_dim).bits_per_element() : 32.0;
}

// Centered keys whose mean is not carried by a learned-rotation artifact (the _HC presets).
inline bool policy_centers_keys(const std::string& name) {
  const auto p = parse_policy(name);
  return p && p->key.centered && p->key.rotation != kvq::Rotation::dense;
}

inline bool policy_needs_artifact(const std::string& name) {
  const auto p = parse_policy(name);
  return p && (p->key.rotation == kvq::Rotation::dense || p->value.rotation == kvq::Rotation::dense);
}

// Throws unless `name` is "fp32" or a policy spelling.
inline void require_policy_name(const std::string& name) { (void)parse_policy(name); }

// Per-layer policies of a `kvq_calib allocate` table (header, then `layer,policy,...`).
inline std::vector<std::string> read_layer_table(const std::string& path, int n_layers) {
  std::ifstream is(path);
  if (!is) throw kvq::Error(kvq::StatusCode::io_error, "cannot read layer table '" + path + "'");
  std::vector<std::string> out(n_layers);
  std::string line;
  std::getline(is, line);  // header
  while (std::getline(is, line)) {
    if (line.empty()) continue;
    const auto f = split_csv(line);
    int layer = -1;
    try {
      layer = f.size() >= 2 ? std::stoi(f[0]) : -1;
    } catch (const std::exception&) {
    }
    if (layer < 0 || layer >= n_layers || !out[layer].empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument, "layer table '" + path + "': bad or repeated row '" + line + "'");
    require_policy_name(f[1]);
    out[layer] = f[1];
  }
  for (int l = 0; l < n_layers; ++l)
    if (out[l].empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument, "layer table '" + path + "' has no row for layer " +
                                                              std::to_string(l) + " (it must cover all " +
                                                              std::to_string(n_layers) + " layers)");
  return out;
}

// Runs `tokens` through the caches (cleared first) block by block; logits [n, vocab] if wanted.
inline void run_sequence(const Model& m, const std::vector<int>& tokens, std::vector<std::unique_ptr<kvq::KVCache>>& caches,
                         int block, RowMat* logits, Capture* cap = nullptr) {
  for (auto& c : caches) c->clear();
  const int n = static_cast<int>(tokens.size());
  if (logits) logits->resize(n, m.cfg.vocab);
  RowMat part;
  for (int p = 0; p < n; p += block) {
    const int nb = std::min(block, n - p);
    m.forward(tokens.data() + p, nb, p, caches, logits ? &part : nullptr, cap);
    if (logits) logits->middleRows(p, nb) = part;
  }
}

// Per-layer key means μ_K [Hkv·d] of the fp32 cache over `tokens`, run in chunks of `ctx`
// (each with a fresh cache); only key_mean is set. Sums in fp64, in token order.
inline std::vector<kvq::LayerParams> key_means(const Model& m, const std::vector<int>& tokens, int ctx, const CacheArgs& ca) {
  if (tokens.empty() || ctx < 1) throw kvq::Error(kvq::StatusCode::invalid_argument, "key means need at least one token");
  Capture cap;
  cap.layers.assign(m.cfg.n_layers, true);
  cap.q.resize(m.cfg.n_layers);
  cap.k.resize(m.cfg.n_layers);
  cap.v.resize(m.cfg.n_layers);
  auto caches = m.make_caches("fp32", ca.options());
  const int kvd = m.cfg.n_kv_heads * m.cfg.head_dim;
  std::vector<std::vector<double>> sum(m.cfg.n_layers, std::vector<double>(kvd, 0.0));
  std::size_t count = 0;
  for (std::size_t s = 0; s < tokens.size(); s += ctx) {
    std::vector<int> seq(tokens.begin() + s, tokens.begin() + std::min(tokens.size(), s + ctx));
    for (auto& k : cap.k) k.clear();
    for (auto& q : cap.q) q.clear(), q.shrink_to_fit();
    for (auto& v : cap.v) v.clear(), v.shrink_to_fit();
    run_sequence(m, seq, caches, ca.block, nullptr, &cap);
    for (int l = 0; l < m.cfg.n_layers; ++l)
      for (std::size_t i = 0; i < cap.k[l].size(); ++i) sum[l][i % kvd] += cap.k[l][i];
    count += seq.size();
  }
  std::vector<kvq::LayerParams> params(m.cfg.n_layers);
  for (int l = 0; l < m.cfg.n_layers; ++l) {
    params[l].key_mean.resize(kvd);
    for (int i = 0; i < kvd; ++i) params[l].key_mean[i] = static_cast<float>(sum[l][i] / double(count));
  }
  return params;
}

// Tokens of the longest prefix of `text` that yields at least `want` tokens, cutting only
// after a newline followed by a non-space character (no pre-token crosses such a cut,
// so the ids equal those of encoding the whole text).
inline std::vector<int> encode_prefix(const Tokenizer& tok, const std::string& text, std::size_t want) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos < text.size() && out.size() < want) {
    std::size_t cut = pos + 65536;
    while (cut < text.size() && !(text[cut - 1] == '\n' && !std::isspace(static_cast<unsigned char>(text[cut])))) ++cut;
    cut = std::min(cut, text.size());
    const auto ids = tok.encode(std::string_view(text).substr(pos, cut - pos));
    out.insert(out.end(), ids.begin(), ids.end());
    pos = cut;
  }
  return out;
}

// An --artifact entry PATH, POLICY=PATH or TAG=PATH as {name, path} (name empty for a
// bare PATH). Split at the last '=', since policy spellings hold '=' (K2V2_R:vclip=1000).
inline std::pair<std::string, std::string> split_artifact_entry(const std::string& e) {
  const auto eq = e.rfind('=');
  if (eq == std::string::npos) return {"", e};
  return {e.substr(0, eq), e.substr(eq + 1)};
}

// OptR artifacts (kvq_calib optr) named on the command line, each entry PATH (any
// learned-rotation policy), POLICY=PATH, or TAG=PATH (for an eval entry POLICY@TAG).
// Files are read once per (path, policy).
class Artifacts {
 public:
  Artifacts(std::vector<std::string> entries, int n_layers, int head_dim)
      : entries_(std::move(entries)), n_layers_(n_layers), head_dim_(head_dim) {}

  bool empty() const { return entries_.empty(); }

  // The file for `policy` (and `tag`, if not empty); "" when none is named.
  std::string path_for(const std::string& policy, const std::string& tag = "") const {
    std::string by_tag, by_policy, bare;
    for (const auto& e : entries_) {
      const auto [name, path] = split_artifact_entry(e);
      if (name.empty()) bare = path;
      else if (!tag.empty() && name == tag) by_tag = path;
      else if (name == policy) by_policy = path;
    }
    if (!tag.empty() && by_tag.empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument, "no --artifact " + tag + "=PATH for policy entry " + policy + "@" + tag);
    if (!by_tag.empty()) return by_tag;
    return by_policy.empty() ? bare : by_policy;
  }

  // Per-layer μ_K, R_K, R_V of a learned-rotation policy; every model layer must be in
  // the artifact, and the artifact's policy must be `policy` at the model's head_dim.
  const std::vector<kvq::LayerParams>& learned(const std::string& policy, const std::string& tag = "") {
    const std::string path = path_for(policy, tag);
    if (path.empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       "policy " + policy + " uses learned rotations: pass --artifact PATH (from kvq_calib optr)");
    const std::string key = path + "|" + policy;
    auto it = learned_.find(key);
    if (it != learned_.end()) return it->second;
    const auto art = kvq::calib::read_artifact(std::filesystem::path(path));
    const kvq::Policy p = parse_policy(policy).value().with_head_dim(head_dim_);
    std::vector<kvq::LayerParams> out;
    for (int l = 0; l < n_layers_; ++l) out.push_back(kvq::calib::layer_params(art, p, l));
    return learned_.emplace(key, std::move(out)).first->second;
  }

  // μ_K of every layer from the one artifact named without a tag, if its policy centers
  // keys; the means live in the original (post-RoPE) basis, so any centering policy can
  // use them. Empty when no such artifact is named.
  std::vector<kvq::LayerParams> key_means(std::string* source = nullptr) const {
    std::string path;
    for (const auto& e : entries_) {
      const std::string p = split_artifact_entry(e).second;
      if (!path.empty() && p != path)
        throw kvq::Error(kvq::StatusCode::invalid_argument,
                         "key means: several --artifact files are named; pass --calib-text to choose the means");
      path = p;
    }
    if (path.empty()) return {};
    const auto art = kvq::calib::read_artifact(std::filesystem::path(path));
    if (!art.policy.key.centered)
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       "artifact '" + path + "' was calibrated without key centering, so it has no key means; "
                       "pass --calib-text for them");
    if (art.policy.head_dim != head_dim_)
      throw kvq::Error(kvq::StatusCode::invalid_argument, "artifact '" + path + "' is for head_dim " +
                                                              std::to_string(art.policy.head_dim) + ", the model has " +
                                                              std::to_string(head_dim_));
    std::vector<kvq::LayerParams> out(n_layers_);
    std::vector<bool> seen(n_layers_, false);
    for (const auto& L : art.layers)
      if (L.layer >= 0 && L.layer < n_layers_) {
        out[L.layer].key_mean = L.mu_k;
        seen[L.layer] = true;
      }
    for (int l = 0; l < n_layers_; ++l)
      if (!seen[l])
        throw kvq::Error(kvq::StatusCode::invalid_argument,
                         "artifact '" + path + "' has no layer " + std::to_string(l) + "; it must cover every layer");
    if (source) *source = "the key means μ_K of artifact " + path;
    return out;
  }

 private:
  std::vector<std::string> entries_;
  int n_layers_, head_dim_;
  std::map<std::string, std::vector<kvq::LayerParams>> learned_;
};

// Fills params [n_layers] for per-layer `policy`: learned rotations (and their μ_K) from
// the artifacts, key means of the other centering layers from `means` (which must then
// hold n_layers entries).
inline std::vector<kvq::LayerParams> layer_params(const std::vector<std::string>& policy, const std::string& tag,
                                                  Artifacts& artifacts, const std::vector<kvq::LayerParams>& means) {
  std::vector<kvq::LayerParams> params(policy.size());
  for (std::size_t l = 0; l < policy.size(); ++l) {
    if (policy_needs_artifact(policy[l])) {
      params[l] = artifacts.learned(policy[l], tag)[l];
    } else if (policy_centers_keys(policy[l])) {
      if (means.size() != policy.size())
        throw kvq::Error(kvq::StatusCode::invalid_argument, "policy " + policy[l] + " centers keys but no key means were measured");
      params[l].key_mean = means[l].key_mean;
    }
  }
  return params;
}

inline bool any_centers_keys(const std::vector<std::string>& policy) {
  return std::any_of(policy.begin(), policy.end(), policy_centers_keys);
}

// One cache configuration a subcommand compares: per layer a policy and its parameters.
struct Run {
  std::string label;
  std::vector<std::string> policy;       // [n_layers]
  std::vector<kvq::LayerParams> params;  // [n_layers], filled by layer_params()
  std::string tag;                       // artifact key of learned-rotation layers ("": by policy)
  double bits = 32;                      // mean bits/element over layers
  bool is_fp() const { return label == "fp32"; }
};

// Width of the policy column of a report: the longest label, at least 16.
inline int label_width(const std::vector<Run>& runs) {
  std::size_t w = 16;
  for (const Run& r : runs) w = std::max(w, r.label.size());
  return int(w);
}

// fp32 first, then the `policies` entries (NAME or NAME@TAG; "fp32" is skipped), then one
// run per per-layer table.
inline std::vector<Run> make_runs(const std::string& policies, const std::vector<std::string>& tables, int n_layers,
                                  int head_dim) {
  std::vector<Run> runs;
  auto add = [&](std::string label, std::vector<std::string> policy, std::string tag) {
    Run r;
    r.label = std::move(label);
    r.policy = std::move(policy);
    r.tag = std::move(tag);
    r.bits = 0;
    for (const auto& p : r.policy) r.bits += policy_bits(p, head_dim) / n_layers;
    runs.push_back(std::move(r));
  };
  add("fp32", std::vector<std::string>(n_layers, "fp32"), "");
  for (const auto& entry : split_csv(policies)) {
    if (entry == "fp32") continue;
    const auto at = entry.find('@');
    require_policy_name(entry.substr(0, at));
    add(entry, std::vector<std::string>(n_layers, entry.substr(0, at)), at == std::string::npos ? "" : entry.substr(at + 1));
  }
  for (const auto& path : tables)
    add("table:" + std::filesystem::path(path).stem().string(), read_layer_table(path, n_layers), "");
  return runs;
}

// Key means for the centered-key (_HC) layers when no span after an evaluated text is at
// hand (generate, passkey), from the first source present: `calib_text` (its first
// `calib_tokens` tokens through the fp32 cache), the μ_K of the one named artifact, or
// `fallback` tokens (described by `fallback_name`). `source` says which.
inline std::vector<kvq::LayerParams> resolve_key_means(const Model& m, const Tokenizer& tok, const std::string& calib_text,
                                                       int calib_tokens, const Artifacts& artifacts,
                                                       const std::vector<int>& fallback, const std::string& fallback_name,
                                                       const CacheArgs& ca, std::string& source) {
  constexpr int kChunk = 1024;  // fresh fp32 cache per chunk, as eval's key means
  if (!calib_text.empty()) {
    auto ids = encode_prefix(tok, read_text(calib_text), std::size_t(calib_tokens));
    ids.resize(std::min<std::size_t>(ids.size(), std::size_t(calib_tokens)));
    source = std::to_string(ids.size()) + " tokens of " + calib_text;
    return key_means(m, ids, kChunk, ca);
  }
  if (!artifacts.empty()) return artifacts.key_means(&source);
  source = fallback_name + " (" + std::to_string(fallback.size()) +
           " tokens; --calib-text or --artifact give calibrated means)";
  return key_means(m, fallback, kChunk, ca);
}

}  // namespace smollm2
