// smollm2_eval — SmolLM2-135M on the CPU with a kvq KV cache.
//
//   smollm2_eval eval --text wiki.test.raw --tokens 8192 --ctx 1024 --policies fp32,K4V2,K4V2_H
//   smollm2_eval eval --text wiki.test.raw --policies K2V2_R@a,K2V2_R@b --artifact a=A.safetensors
//                     --artifact b=B.safetensors --layer-policies layers.csv   (kvq_calib outputs)
//   smollm2_eval generate --prompt "What is the capital of France?" --chat --policy K4V2_H
//   smollm2_eval capture --text wiki.test.raw --seq-len 448 --seqs 2 --layers 0,14,29 --out acts.safetensors
//   smollm2_eval logits --prompt "The capital of France is" --out logits.f32
//
// Perplexity scores every token of a chunk but its first (non-overlapping chunks of
// --ctx tokens, each with a fresh cache). KL(p_fp32 ‖ p_policy) and top-1 agreement are
// measured against the fp32 cache on the same positions. Tokens go through the model in
// blocks of --block (appended to the cache, then attended as the last --block queries),
// so the sink/recent windows behave as in block-wise decoding.
#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "common.hpp"
#include "kvq/calib/artifact.hpp"
#include "kvq/io/gguf.hpp"
#include "kvq/io/safetensors.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace {

using smollm2::Model;
using smollm2::RowMat;

struct CacheArgs {
  int sink = 64, recent = 256, flush = 16, page = 16, block = 64;
  bool int8_keys = false;
  kvq::HostCacheOptions options() const {
    kvq::HostCacheOptions o;
    o.sink_tokens = sink;
    o.recent_tokens = recent;
    o.flush_block = flush;
    o.page_size = page;
    o.max_query_tokens = block;
    o.key_scoring = int8_keys ? kvq::KeyScoring::int8_query : kvq::KeyScoring::fp32_tiles;
    return o;
  }
};

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// Bits per cached element of the quantized part, metadata included (fp32 → 32).
double policy_bits(const std::string& name, int head_dim) {
  for (const auto& p : kvq::presets::all)
    if (p.name == name) return p.policy.with_head_dim(head_dim).bits_per_element();
  return 32.0;
}

bool policy_centers_keys(const std::string& name) {
  for (const auto& p : kvq::presets::all)
    if (p.name == name) return p.policy.key.centered && p.policy.key.rotation != kvq::Rotation::dense;
  return false;
}

bool policy_needs_artifact(const std::string& name) {
  for (const auto& p : kvq::presets::all)
    if (p.name == name) return p.policy.key.rotation == kvq::Rotation::dense || p.policy.value.rotation == kvq::Rotation::dense;
  return false;
}

// Per-layer run-time parameters of a learned-rotation preset from an OptR artifact
// (kvq_calib optr); every model layer must be in it and the policy must match.
std::vector<kvq::LayerParams> artifact_params(const std::string& path, const std::string& policy, int n_layers,
                                              int head_dim) {
  if (path.empty())
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     "policy " + policy + " uses learned rotations: pass --artifact (from kvq_calib optr)");
  const auto art = kvq::calib::read_artifact(std::filesystem::path(path));
  std::vector<kvq::LayerParams> out;
  kvq::throw_if_error(kvq::dispatch_head_dim<64, 128>(head_dim, [&]<int D>() {
    kvq::throw_if_error(kvq::dispatch_preset<D>(policy, [&]<kvq::Policy P>() {
      for (int l = 0; l < n_layers; ++l) out.push_back(kvq::calib::layer_params<P>(art, l));
    }));
  }));
  return out;
}

// Runs `tokens` through fresh caches block by block; logits [n, vocab] if wanted.
void run_sequence(const Model& m, const std::vector<int>& tokens, std::vector<std::unique_ptr<kvq::KVCache>>& caches,
                  int block, RowMat* logits, smollm2::Capture* cap = nullptr) {
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

// Per-layer key means [Hkv·d] over `tokens` (fp32 cache), for key-centering presets.
std::vector<kvq::LayerParams> key_means(const Model& m, const std::vector<int>& tokens, int ctx, const CacheArgs& ca) {
  smollm2::Capture cap;
  cap.layers.assign(m.cfg.n_layers, true);
  cap.q.resize(m.cfg.n_layers);
  cap.k.resize(m.cfg.n_layers);
  cap.v.resize(m.cfg.n_layers);
  auto caches = m.make_caches("fp32", ca.options());
  const int kvd = m.cfg.n_kv_heads * m.cfg.head_dim;
  std::vector<std::vector<double>> sum(m.cfg.n_layers, std::vector<double>(kvd, 0.0));
  std::size_t count = 0;
  for (std::size_t s = 0; s + 1 < tokens.size(); s += ctx) {
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

struct Loaded {
  kvq::io::GGUFFile file;
  Model model;
  smollm2::Tokenizer tok;
};

std::unique_ptr<Loaded> load(const std::string& path_arg) {
  std::filesystem::path path = path_arg.empty() ? smollm2::default_model_path() : std::filesystem::path(path_arg);
  if (!std::filesystem::is_regular_file(path))
    throw kvq::Error(kvq::StatusCode::io_error, "model file '" + path.string() + "' is missing. " + smollm2::kFetchHint);
  auto f = kvq::io::GGUFFile::open(path);
  auto m = Model::load(f);
  smollm2::Tokenizer t(f);
  return std::unique_ptr<Loaded>(new Loaded{std::move(f), std::move(m), std::move(t)});
}

// Tokens of the longest prefix of `text` that yields at least `want` tokens, cutting only
// after a newline followed by a non-space character (no pre-token crosses such a cut,
// so the ids equal those of encoding the whole text).
std::vector<int> encode_prefix(const smollm2::Tokenizer& tok, const std::string& text, std::size_t want) {
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- eval -------------------------------------------------------------------------------

struct EvalArgs {
  std::string text, policies = "fp32,K8V8,K4V4,K4V2,K2V4,K2V2", csv;
  std::vector<std::string> artifacts;       // PATH (all *_R policies), POLICY=PATH or TAG=PATH
  std::vector<std::string> layer_policies;  // per-layer tables (kvq_calib allocate)
  int tokens = 8192, ctx = 1024, calib_tokens = 4096;
};

// One evaluated cache configuration: per layer a policy and its run-time parameters.
struct Run {
  std::string label;
  std::vector<std::string> policy;       // [n_layers]
  std::vector<kvq::LayerParams> params;  // [n_layers]
  std::string tag;                       // artifact key of learned-rotation layers ("": by policy)
  double bits = 32;                      // mean bits/element over layers
  bool is_fp() const { return label == "fp32"; }
};

// Per-layer policies of a `kvq_calib allocate` table (header, then `layer,policy,...`).
std::vector<std::string> read_layer_table(const std::string& path, int n_layers) {
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
    out[layer] = f[1];
  }
  for (int l = 0; l < n_layers; ++l)
    if (out[l].empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       fmt::format("layer table '{}' has no row for layer {} (it must cover all {} layers)", path, l, n_layers));
  return out;
}

int cmd_eval(const std::string& model_path, const EvalArgs& a, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const int n_layers = m.cfg.n_layers;
  const auto all = encode_prefix(L->tok, smollm2::read_text(a.text), std::size_t(a.tokens) + a.calib_tokens);
  if (static_cast<int>(all.size()) < a.tokens + 2)
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     fmt::format("text has {} tokens, fewer than --tokens {}", all.size(), a.tokens));
  const std::vector<int> eval(all.begin(), all.begin() + a.tokens);

  // Runs: fp32 first, then the --policies entries (NAME or NAME@TAG), then the tables.
  std::vector<Run> runs;
  auto add_run = [&](std::string label, std::vector<std::string> policy, std::string tag) {
    Run r;
    r.label = std::move(label);
    r.policy = std::move(policy);
    r.tag = std::move(tag);
    r.bits = 0;
    for (const auto& p : r.policy) r.bits += policy_bits(p, m.cfg.head_dim) / n_layers;
    runs.push_back(std::move(r));
  };
  add_run("fp32", std::vector<std::string>(n_layers, "fp32"), "");
  for (const auto& entry : split_csv(a.policies)) {
    if (entry == "fp32") continue;
    const auto at = entry.find('@');
    add_run(entry, std::vector<std::string>(n_layers, entry.substr(0, at)), at == std::string::npos ? "" : entry.substr(at + 1));
  }
  for (const auto& path : a.layer_policies)
    add_run("table:" + std::filesystem::path(path).stem().string(), read_layer_table(path, n_layers), "");

  // Key means for centering presets: from the tokens that follow the evaluated ones.
  std::vector<kvq::LayerParams> means;
  const bool any_centered = std::any_of(runs.begin(), runs.end(), [](const Run& r) {
    return std::any_of(r.policy.begin(), r.policy.end(), policy_centers_keys);
  });
  if (any_centered) {
    const int n = std::min<int>(a.calib_tokens, static_cast<int>(all.size()) - a.tokens);
    const std::vector<int> calib(all.begin() + a.tokens, all.begin() + a.tokens + n);
    fmt::print(stderr, "key means from {} tokens after the evaluated span\n", calib.size());
    means = key_means(m, calib, a.ctx, ca);
  }
  // Learned rotations: the artifact named by the run's tag, else by the policy, else the bare path.
  std::map<std::string, std::vector<kvq::LayerParams>> learned;  // by "path|policy"
  auto artifact_for = [&](const std::string& tag, const std::string& pol) -> const std::vector<kvq::LayerParams>& {
    std::string path, by_policy, bare;
    for (const auto& art : a.artifacts) {
      const auto eq = art.find('=');
      if (eq == std::string::npos) bare = art;
      else if (!tag.empty() && art.substr(0, eq) == tag) path = art.substr(eq + 1);
      else if (art.substr(0, eq) == pol) by_policy = art.substr(eq + 1);
    }
    if (!tag.empty() && path.empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument, "no --artifact " + tag + "=PATH for policy entry " + pol + "@" + tag);
    if (path.empty()) path = by_policy.empty() ? bare : by_policy;
    const std::string key = path + "|" + pol;
    if (!learned.count(key)) learned[key] = artifact_params(path, pol, n_layers, m.cfg.head_dim);
    return learned[key];
  };
  for (Run& run : runs) {
    run.params.resize(n_layers);
    for (int l = 0; l < n_layers; ++l) {
      const std::string& pol = run.policy[l];
      if (policy_needs_artifact(pol)) run.params[l] = artifact_for(run.tag, pol)[l];
      else if (policy_centers_keys(pol)) run.params[l] = means[l];
    }
  }

  struct Acc {
    double nll = 0, kl = 0, kl_far = 0;
    long long scored = 0, agree = 0, far = 0;
    double bytes_per_token = 0;
    double secs = 0;
  };
  std::vector<Acc> acc(runs.size());
  const int n_chunks = a.tokens / a.ctx;
  RowMat logits;
  std::vector<std::vector<double>> fp_logp;  // [ctx][vocab] of the fp32 run
  std::vector<int> fp_top;
  std::vector<double> lp;
  const auto t_start = std::chrono::steady_clock::now();
  for (int c = 0; c < n_chunks; ++c) {
    const std::vector<int> chunk(eval.begin() + c * a.ctx, eval.begin() + (c + 1) * a.ctx);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const Run& run = runs[r];
      const auto t0 = std::chrono::steady_clock::now();
      auto caches = m.make_caches(run.policy, ca.options(), &run.params);
      run_sequence(m, chunk, caches, ca.block, &logits);
      Acc& A = acc[r];
      std::size_t bytes = 0;
      for (const auto& cc : caches) bytes += cc->bytes();
      A.bytes_per_token += double(bytes) / a.ctx / n_chunks;
      if (run.is_fp()) {
        fp_logp.resize(a.ctx);
        fp_top.resize(a.ctx);
      }
      for (int t = 0; t + 1 < a.ctx; ++t) {
        smollm2::log_softmax(logits.row(t).data(), m.cfg.vocab, lp);
        A.nll -= lp[chunk[t + 1]];
        ++A.scored;
        const int top = static_cast<int>(std::max_element(lp.begin(), lp.end()) - lp.begin());
        if (run.is_fp()) {
          fp_logp[t] = lp;
          fp_top[t] = top;
          continue;
        }
        double kl = 0;
        const auto& P = fp_logp[t];
        for (int i = 0; i < m.cfg.vocab; ++i) kl += std::exp(P[i]) * (P[i] - lp[i]);
        A.kl += kl;
        A.agree += top == fp_top[t];
        if (t >= ca.sink + ca.recent) {  // positions whose context includes quantized tokens
          A.kl_far += kl;
          ++A.far;
        }
      }
      A.secs += seconds_since(t0);
      fmt::print(stderr, "[chunk {}/{}] {:<8} ppl so far {:8.4f}  ({:.1f}s, {:.0f}s total)\n", c + 1, n_chunks,
                 run.label, std::exp(A.nll / double(A.scored)), seconds_since(t0), seconds_since(t_start));
    }
  }

  std::FILE* csv = a.csv.empty() ? nullptr : std::fopen(a.csv.c_str(), "w");
  if (!a.csv.empty() && !csv) throw kvq::Error(kvq::StatusCode::io_error, "cannot write '" + a.csv + "'");
  if (csv) fmt::print(csv, "policy,bits_per_element,cache_bytes_per_token,ppl,kl,kl_far,top1\n");
  fmt::print("SmolLM2-135M, {} tokens of {} in {} chunks of {} (block {}, sink {}, recent {})\n", a.tokens, a.text,
             n_chunks, a.ctx, ca.block, ca.sink, ca.recent);
  fmt::print("{:<16} {:>9} {:>12} {:>10} {:>11} {:>11} {:>8}\n", "policy", "bits/elem", "bytes/token", "ppl", "KL",
             "KL(t>=W)", "top1");
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const Acc& A = acc[r];
    const double ppl = std::exp(A.nll / double(A.scored));
    const bool fp = runs[r].is_fp();
    const double kl = fp ? 0 : A.kl / double(A.scored), klf = fp || !A.far ? 0 : A.kl_far / double(A.far);
    const double top1 = fp ? 1 : double(A.agree) / double(A.scored);
    fmt::print("{:<16} {:>9.3f} {:>12.0f} {:>10.4f} {:>11.3e} {:>11.3e} {:>8.4f}\n", runs[r].label, runs[r].bits,
               A.bytes_per_token, ppl, kl, klf, top1);
    if (csv)
      fmt::print(csv, "{},{:.4f},{:.1f},{:.5f},{:.6e},{:.6e},{:.5f}\n", runs[r].label, runs[r].bits, A.bytes_per_token,
                 ppl, kl, klf, top1);
  }
  if (csv) std::fclose(csv);
  return 0;
}

// ---- generate -----------------------------------------------------------------------------

int cmd_generate(const std::string& model_path, const std::string& prompt, bool chat, int n_new,
                 const std::string& policy, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const std::string text =
      chat ? "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n" : prompt;
  std::vector<int> ids = L->tok.encode(text, /*parse_special=*/true);
  if (ids.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "empty prompt");
  auto caches = m.make_caches(policy, ca.options());
  RowMat logits;
  int pos = 0;
  for (int p = 0; p < static_cast<int>(ids.size()); p += ca.block) {
    const int nb = std::min<int>(ca.block, static_cast<int>(ids.size()) - p);
    m.forward(ids.data() + p, nb, p, caches, &logits);
    pos += nb;
  }
  const int im_end = [&] {
    for (int i = 0; i < L->tok.vocab_size(); ++i)
      if (L->tok.token(i) == "<|im_end|>") return i;
    return -1;
  }();
  fmt::print("{}", text);
  std::fflush(stdout);
  for (int i = 0; i < n_new; ++i) {
    Eigen::Index next;
    logits.row(logits.rows() - 1).maxCoeff(&next);
    const int id = static_cast<int>(next);
    if (id == L->tok.eos() || id == im_end) break;
    fmt::print("{}", L->tok.decode_token(id));
    std::fflush(stdout);
    m.forward(&id, 1, pos++, caches, &logits);
  }
  fmt::print("\n");
  return 0;
}

// ---- capture ------------------------------------------------------------------------------

struct CaptureArgs {
  std::string text, out, layers = "all", dtype = "f32";
  int seq_len = 512, seqs = 4, skip = 0;
  bool save_ids = false, save_kv_weights = false;
};

int cmd_capture(const std::string& model_path, const CaptureArgs& a, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const auto& c = m.cfg;
  const long long need = static_cast<long long>(a.skip) + static_cast<long long>(a.seq_len) * a.seqs;
  const auto all = encode_prefix(L->tok, smollm2::read_text(a.text), static_cast<std::size_t>(std::max(need, 0LL)));
  if (a.seq_len < 1 || a.seqs < 1 || static_cast<long long>(all.size()) < need)
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     fmt::format("capture needs {} tokens, the text has {}", need, all.size()));
  smollm2::Capture cap;
  cap.layers.assign(c.n_layers, a.layers == "all");
  std::vector<int> chosen;
  if (a.layers != "all")
    for (const auto& s : split_csv(a.layers)) {
      const int l = std::stoi(s);
      if (l < 0 || l >= c.n_layers) throw kvq::Error(kvq::StatusCode::out_of_range, "layer " + s + " out of range");
      cap.layers[l] = true;
    }
  for (int l = 0; l < c.n_layers; ++l)
    if (cap.layers[l]) chosen.push_back(l);
  cap.q.resize(c.n_layers);
  cap.k.resize(c.n_layers);
  cap.v.resize(c.n_layers);
  auto caches = m.make_caches("fp32", ca.options());
  std::vector<std::int64_t> offsets{0};
  for (int s = 0; s < a.seqs; ++s) {
    const auto b = all.begin() + a.skip + static_cast<std::ptrdiff_t>(s) * a.seq_len;
    run_sequence(m, std::vector<int>(b, b + a.seq_len), caches, ca.block, nullptr, &cap);
    offsets.push_back(offsets.back() + a.seq_len);
    fmt::print(stderr, "captured sequence {}/{}\n", s + 1, a.seqs);
  }
  kvq::io::SafetensorsWriter w;
  kvq::io::DType dt = kvq::io::DType::F32;
  if (a.dtype == "f16") dt = kvq::io::DType::F16;
  else if (a.dtype == "bf16") dt = kvq::io::DType::BF16;
  else if (a.dtype != "f32") throw kvq::Error(kvq::StatusCode::invalid_argument, "--dtype must be f32, f16 or bf16");
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, const float* x, std::size_t n) {
    if (dt == kvq::io::DType::F32) return w.add(name, dt, std::move(shape), x);
    std::vector<std::uint16_t> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = dt == kvq::io::DType::F16 ? kvq::half_t(x[i]).bits : kvq::bfloat16_t(x[i]).bits;
    w.add(name, dt, std::move(shape), h.data());
  };
  const std::int64_t Ltot = offsets.back(), d = c.head_dim;
  std::string layer_list;
  for (int l : chosen) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "q", {Ltot, c.n_heads, d}, cap.q[l].data(), cap.q[l].size());
    add(p + "k", {Ltot, c.n_kv_heads, d}, cap.k[l].data(), cap.k[l].size());
    add(p + "v", {Ltot, c.n_kv_heads, d}, cap.v[l].data(), cap.v[l].size());
    const RowMat& wo = m.layers[l].wo;  // [D, Hq·d]
    add(p + "w_o", {c.hidden, c.n_heads * d}, wo.data(), static_cast<std::size_t>(wo.size()));
    if (a.save_kv_weights) {  // [Hkv·d, D] (GGUF row order) for the norm-disparity report
      const RowMat& wk = m.layers[l].wk;
      const RowMat& wv = m.layers[l].wv;
      add(p + "w_k", {c.n_kv_heads * d, c.hidden}, wk.data(), static_cast<std::size_t>(wk.size()));
      add(p + "w_v", {c.n_kv_heads * d, c.hidden}, wv.data(), static_cast<std::size_t>(wv.size()));
    }
    layer_list += (layer_list.empty() ? "" : ",") + std::to_string(l);
  }
  w.add("seq_offsets", kvq::io::DType::I64, {static_cast<std::int64_t>(offsets.size())}, offsets.data());
  if (a.save_ids) {  // off by default: ids reproduce the text, which may not be redistributable
    std::vector<std::int32_t> ids(all.begin() + a.skip, all.begin() + a.skip + Ltot);
    w.add("token_ids", kvq::io::DType::I32, {Ltot}, ids.data());
  }
  w.set_metadata("format", "kvq.activations.v1");
  w.set_metadata("model", "SmolLM2-135M-Instruct.Q4_1.gguf");
  w.set_metadata("layers", layer_list);
  w.set_metadata("n_layers", std::to_string(c.n_layers));
  w.set_metadata("num_qo_heads", std::to_string(c.n_heads));
  w.set_metadata("num_kv_heads", std::to_string(c.n_kv_heads));
  w.set_metadata("head_dim", std::to_string(c.head_dim));
  w.set_metadata("hidden", std::to_string(c.hidden));
  w.set_metadata("rope_theta", fmt::format("{}", c.rope_theta));
  w.set_metadata("rope", "adjacent pairs (GGUF/NORM); K is post-RoPE as cached");
  w.set_metadata("source", fmt::format("{} tokens [{}, {}) of {}", Ltot, a.skip, a.skip + Ltot,
                                       std::filesystem::path(a.text).filename().string()));
  w.write(a.out);
  fmt::print(stderr, "wrote {} (layers {}, {} tokens in {} sequences)\n", a.out, layer_list, Ltot, a.seqs);
  return 0;
}

// ---- logits -------------------------------------------------------------------------------

int cmd_logits(const std::string& model_path, const std::string& prompt, const std::string& ids_arg,
               const std::string& out, const std::string& policy, const CacheArgs& ca) {
  auto L = load(model_path);
  std::vector<int> ids;
  if (!ids_arg.empty()) {
    for (const auto& s : split_csv(ids_arg)) ids.push_back(std::stoi(s));
  } else {
    ids = L->tok.encode(prompt);
  }
  if (ids.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "no tokens");
  auto caches = L->model.make_caches(policy, ca.options());
  RowMat logits;
  run_sequence(L->model, ids, caches, ca.block, &logits);
  fmt::print("ids: {}\n", fmt::join(ids, ","));
  Eigen::Index top;
  logits.row(logits.rows() - 1).maxCoeff(&top);
  fmt::print("next token: {} {:?}\n", top, L->tok.decode_token(static_cast<int>(top)));
  if (!out.empty()) {
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
    fmt::print("wrote [{}, {}] float32 logits to {}\n", logits.rows(), logits.cols(), out);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"SmolLM2-135M (GGUF) on the CPU with a kvq KV cache: perplexity, KL vs fp32, generation, capture"};
  app.require_subcommand(1);
  std::string model_path;
  CacheArgs ca;
  app.add_option("--model", model_path, "GGUF file (default: $KVQ_SMOLLM2_GGUF or ~/.cache/kvq/...; fetch with examples/smollm2/fetch_model.sh)");
  app.add_option("--sink", ca.sink, "full-precision attention-sink tokens")->check(CLI::NonNegativeNumber);
  app.add_option("--recent", ca.recent, "full-precision recent-window tokens")->check(CLI::NonNegativeNumber);
  app.add_option("--flush-block", ca.flush, "tokens quantized at a time when leaving the recent window")->check(CLI::PositiveNumber);
  app.add_option("--page-size", ca.page, "tokens per quantized page")->check(CLI::PositiveNumber);
  app.add_option("--block", ca.block, "tokens per forward step (append, then attend as the last block)")->check(CLI::Range(1, 512));
  app.add_flag("--int8-keys", ca.int8_keys,
               "score quantized keys with integer dot products on an int8 query (kvq::KeyScoring::int8_query)");

  EvalArgs ea;
  auto* eval = app.add_subcommand("eval", "perplexity, KL vs fp32 and top-1 agreement for a list of policies");
  eval->add_option("--text", ea.text, "UTF-8 text file (e.g. wikitext-2-raw/wiki.test.raw)")->required()->check(CLI::ExistingFile);
  eval->add_option("--tokens", ea.tokens, "tokens evaluated (a multiple of --ctx is used)")->check(CLI::PositiveNumber);
  eval->add_option("--ctx", ea.ctx, "context length of each chunk")->check(CLI::Range(2, 8192));
  eval->add_option("--policies", ea.policies,
                   "comma-separated: fp32 and kvq preset names (K4V2, K4V2_H, K4V2_HC, K2V2_R@TAG, ...)");
  eval->add_option("--calib-tokens", ea.calib_tokens, "tokens after the evaluated span used for key means (*_HC presets)");
  eval->add_option("--csv", ea.csv, "also write the table as CSV");
  eval->add_option("--artifact", ea.artifacts,
                   "OptR artifact (kvq_calib optr) for learned-rotation presets: PATH, POLICY=PATH, or TAG=PATH for "
                   "a --policies entry POLICY@TAG (repeatable)");
  eval->add_option("--layer-policies", ea.layer_policies,
                   "per-layer policy table (CSV from kvq_calib allocate) evaluated as one more run (repeatable)")
      ->check(CLI::ExistingFile);

  std::string prompt, policy = "fp32";
  int n_new = 48;
  bool chat = false;
  auto* gen = app.add_subcommand("generate", "greedy generation");
  gen->add_option("--prompt", prompt, "prompt text")->required();
  gen->add_flag("--chat", chat, "wrap the prompt in the ChatML template");
  gen->add_option("-n,--max-new", n_new, "tokens to generate")->check(CLI::PositiveNumber);
  gen->add_option("--policy", policy, "fp32 or a kvq preset name");

  CaptureArgs cpa;
  auto* capc = app.add_subcommand("capture", "dump per-layer Q, K, V (post-RoPE) and W_O to safetensors (DESIGN §6 input)");
  capc->add_option("--text", cpa.text, "UTF-8 text file")->required()->check(CLI::ExistingFile);
  capc->add_option("--out", cpa.out, "output .safetensors")->required();
  capc->add_option("--layers", cpa.layers, "comma-separated layer indices or 'all'");
  capc->add_option("--seq-len", cpa.seq_len, "tokens per sequence")->check(CLI::PositiveNumber);
  capc->add_option("--seqs", cpa.seqs, "number of sequences")->check(CLI::PositiveNumber);
  capc->add_option("--skip", cpa.skip, "tokens skipped at the start of the text")->check(CLI::NonNegativeNumber);
  capc->add_option("--dtype", cpa.dtype, "storage dtype: f32, f16 or bf16");
  capc->add_flag("--save-ids", cpa.save_ids, "also store the token ids (I32 [L]) as 'token_ids'");
  capc->add_flag("--kv-weights", cpa.save_kv_weights,
                 "also store W_K and W_V ([Hkv·d, D]) for kvq_calib allocate's norm-disparity report");

  std::string ids_arg, out;
  auto* lg = app.add_subcommand("logits", "logits of a prompt (for checking against a reference)");
  lg->add_option("--prompt", prompt, "prompt text");
  lg->add_option("--ids", ids_arg, "comma-separated token ids instead of a prompt");
  lg->add_option("--out", out, "write all logits as raw float32 [n, vocab]");
  lg->add_option("--policy", policy, "fp32 or a kvq preset name");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*eval) return cmd_eval(model_path, ea, ca);
    if (*gen) return cmd_generate(model_path, prompt, chat, n_new, policy, ca);
    if (*capc) return cmd_capture(model_path, cpa, ca);
    if (*lg) return cmd_logits(model_path, prompt, ids_arg, out, policy, ca);
  } catch (const kvq::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
