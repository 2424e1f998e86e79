// examples/smollm2/model.hpp — Llama forward pass on the CPU (Eigen, fp32) for
// SmolLM2-135M read from GGUF, with a pluggable per-layer kvq::KVCache.
//
// Per layer l, for a block of n tokens x [n, D] (row-major):
//   h = RMSNorm(x)·g_attn;  q = h·W_Qᵀ [n, Hq·d];  k = h·W_Kᵀ, v = h·W_Vᵀ [n, Hkv·d]
//   RoPE on q, k with adjacent pairs (2i, 2i+1) — "NORM" mode: llama.cpp permutes the
//   Q/K rows when it writes GGUF, so adjacent pairs reproduce the HF rotate-half result
//   cache.append(k, v); o = cache.attend(q)  (the n queries are the last n positions)
//   x += o·W_Oᵀ;  h = RMSNorm(x)·g_ffn;  x += (silu(h·W_gateᵀ) ⊙ h·W_upᵀ)·W_downᵀ
// logits = RMSNorm(x)·g_out·Eᵀ (output tied to the token embedding E when the GGUF has
// no output.weight). Weights are dequantized to fp32 at load.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache/host_cache.hpp"
#include "kvq/core/status.hpp"
#include "caches.hpp"
#include "gguf.hpp"

namespace smollm2 {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Config {
  int n_layers = 0, hidden = 0, ffn = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, vocab = 0;
  int context_length = 0;
  float rope_theta = 10000.f, rms_eps = 1e-5f;
};

struct LayerWeights {
  Eigen::VectorXf attn_norm, ffn_norm;
  RowMat wq, wk, wv, wo, w_gate, w_up, w_down;  // [out, in], PyTorch convention
};

// Per-layer activations recorded during a forward pass (layers with capture[l] set).
struct Capture {
  std::vector<bool> layers;                  // [n_layers]
  std::vector<std::vector<float>> q, k, v;   // per layer: [L, Hq, d], [L, Hkv, d] post-RoPE (k, q)
};

class Model {
 public:
  Config cfg;
  RowMat tok_embd;   // [vocab, D]
  RowMat output;     // [vocab, D]; empty when tied to tok_embd
  Eigen::VectorXf out_norm;
  std::vector<LayerWeights> layers;

  static Model load(const smollm2::GGUFFile& f) {
    Model m;
    if (f.get_string("general.architecture") != "llama")
      throw kvq::Error(kvq::StatusCode::unsupported,
                       "model: architecture '" + f.get_string("general.architecture") + "' is not llama");
    Config& c = m.cfg;
    c.n_layers = static_cast<int>(f.get_int("llama.block_count"));
    c.hidden = static_cast<int>(f.get_int("llama.embedding_length"));
    c.ffn = static_cast<int>(f.get_int("llama.feed_forward_length"));
    c.n_heads = static_cast<int>(f.get_int("llama.attention.head_count"));
    c.n_kv_heads = static_cast<int>(f.get_int("llama.attention.head_count_kv", c.n_heads));
    c.context_length = static_cast<int>(f.get_int("llama.context_length", 2048));
    c.rope_theta = static_cast<float>(f.get_double("llama.rope.freq_base", 10000.0));
    c.rms_eps = static_cast<float>(f.get_double("llama.attention.layer_norm_rms_epsilon", 1e-5));
    if (c.n_layers <= 0 || c.hidden <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.hidden % c.n_heads ||
        c.n_heads % c.n_kv_heads)
      throw kvq::Error(kvq::StatusCode::corrupt_data, "model: inconsistent llama hyper-parameters");
    c.head_dim = c.hidden / c.n_heads;
    if (auto rd = f.find("llama.rope.dimension_count"); rd && rd->as_int() != c.head_dim)
      throw kvq::Error(kvq::StatusCode::unsupported, "model: partial RoPE is not implemented");

    m.tok_embd = matrix(f, "token_embd.weight", -1, c.hidden);
    c.vocab = static_cast<int>(m.tok_embd.rows());
    if (f.find_tensor("output.weight")) m.output = matrix(f, "output.weight", c.vocab, c.hidden);
    m.out_norm = vector(f, "output_norm.weight", c.hidden);
    const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      LayerWeights w;
      w.attn_norm = vector(f, p + "attn_norm.weight", c.hidden);
      w.ffn_norm = vector(f, p + "ffn_norm.weight", c.hidden);
      w.wq = matrix(f, p + "attn_q.weight", qd, c.hidden);
      w.wk = matrix(f, p + "attn_k.weight", kvd, c.hidden);
      w.wv = matrix(f, p + "attn_v.weight", kvd, c.hidden);
      w.wo = matrix(f, p + "attn_output.weight", c.hidden, qd);
      w.w_gate = matrix(f, p + "ffn_gate.weight", c.ffn, c.hidden);
      w.w_up = matrix(f, p + "ffn_up.weight", c.ffn, c.hidden);
      w.w_down = matrix(f, p + "ffn_down.weight", c.hidden, c.ffn);
      m.layers.push_back(std::move(w));
    }
    m.init_rope(c.context_length);
    return m;
  }

  const RowMat& output_matrix() const { return output.size() ? output : tok_embd; }

  // Runs n tokens at positions [pos0, pos0 + n) through every layer. caches[l] must
  // already hold exactly pos0 tokens; it gets this block's K/V. logits (optional)
  // receives [n, vocab]; cap (optional) records the selected layers' Q/K/V.
  void forward(const int* tokens, int n, int pos0, std::vector<std::unique_ptr<kvq::KVCache>>& caches,
               RowMat* logits, Capture* cap = nullptr) const {
    const Config& c = cfg;
    if (n < 1 || static_cast<int>(caches.size()) != c.n_layers)
      throw kvq::Error(kvq::StatusCode::invalid_argument, "model: forward needs n >= 1 and one cache per layer");
    RowMat x(n, c.hidden);
    for (int i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= c.vocab)
        throw kvq::Error(kvq::StatusCode::out_of_range, "model: token id " + std::to_string(tokens[i]) + " out of range");
      x.row(i) = tok_embd.row(tokens[i]);
    }
    const int hd = c.head_dim;
    RowMat h(n, c.hidden), q, k, v, o(n, c.n_heads * hd), g, u;
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& w = layers[l];
      auto& cache = *caches[l];
      if (cache.size() != pos0)
        throw kvq::Error(kvq::StatusCode::invalid_argument, "model: cache of layer " + std::to_string(l) + " holds " +
                                                                std::to_string(cache.size()) + " tokens, expected " +
                                                                std::to_string(pos0));
      rms_norm(x, w.attn_norm, h);
      q.noalias() = h * w.wq.transpose();
      k.noalias() = h * w.wk.transpose();
      v.noalias() = h * w.wv.transpose();
      rope(q, c.n_heads, pos0);
      rope(k, c.n_kv_heads, pos0);
      cache.append(k.data(), v.data(), n);
      cache.attend(q.data(), n, o.data());
      if (cap && l < static_cast<int>(cap->layers.size()) && cap->layers[l]) {
        cap->q[l].insert(cap->q[l].end(), q.data(), q.data() + q.size());
        cap->k[l].insert(cap->k[l].end(), k.data(), k.data() + k.size());
        cap->v[l].insert(cap->v[l].end(), v.data(), v.data() + v.size());
      }
      x.noalias() += o * w.wo.transpose();
      rms_norm(x, w.ffn_norm, h);
      g.noalias() = h * w.w_gate.transpose();
      u.noalias() = h * w.w_up.transpose();
      g = g.array() / (1.f + (-g.array()).exp());  // SiLU
      g.array() *= u.array();
      x.noalias() += g * w.w_down.transpose();
    }
    if (logits) {
      rms_norm(x, out_norm, h);
      logits->noalias() = h * output_matrix().transpose();
    }
  }

  // One cache per layer for a policy name ("fp32" or a kvq preset), head_dim 64 or 128.
  std::vector<std::unique_ptr<kvq::KVCache>> make_caches(const std::string& policy, kvq::HostCacheOptions opt,
                                                         const std::vector<kvq::LayerParams>* params = nullptr) const {
    return make_caches(std::vector<std::string>(cfg.n_layers, policy), opt, params);
  }

  // Per-layer policies (a bit-allocation table): layer_policy[l] for layer l.
  std::vector<std::unique_ptr<kvq::KVCache>> make_caches(const std::vector<std::string>& layer_policy,
                                                         kvq::HostCacheOptions opt,
                                                         const std::vector<kvq::LayerParams>* params = nullptr) const {
    if (static_cast<int>(layer_policy.size()) != cfg.n_layers || (params && static_cast<int>(params->size()) != cfg.n_layers))
      throw kvq::Error(kvq::StatusCode::invalid_argument, "model: need one policy (and parameter set) per layer");
    opt.num_kv_heads = cfg.n_kv_heads;
    opt.num_qo_heads = cfg.n_heads;
    std::vector<std::unique_ptr<kvq::KVCache>> caches;
    for (int l = 0; l < cfg.n_layers; ++l)
      caches.push_back(make_kv_cache(layer_policy[l], cfg.head_dim, opt, params ? (*params)[l] : kvq::LayerParams{}));
    return caches;
  }

 private:
  static RowMat matrix(const smollm2::GGUFFile& f, const std::string& name, int rows, int cols) {
    const auto& t = f.tensor(name);
    if (t.shape.size() != 2 || t.shape[0] != cols || (rows >= 0 && t.shape[1] != rows))
      throw kvq::Error(kvq::StatusCode::corrupt_data, "model: tensor '" + name + "' has an unexpected shape");
    const auto data = smollm2::GGUFFile::dequantize(t);
    return Eigen::Map<const RowMat>(data.data(), t.shape[1], t.shape[0]);
  }
  static Eigen::VectorXf vector(const smollm2::GGUFFile& f, const std::string& name, int n) {
    const auto& t = f.tensor(name);
    if (t.shape.size() != 1 || t.shape[0] != n)
      throw kvq::Error(kvq::StatusCode::corrupt_data, "model: tensor '" + name + "' has an unexpected shape");
    const auto data = smollm2::GGUFFile::dequantize(t);
    return Eigen::Map<const Eigen::VectorXf>(data.data(), n);
  }

  void rms_norm(const RowMat& x, const Eigen::VectorXf& g, RowMat& out) const {
    out.resize(x.rows(), x.cols());
    for (Eigen::Index i = 0; i < x.rows(); ++i) {
      const float ms = x.row(i).squaredNorm() / static_cast<float>(x.cols());
      out.row(i) = x.row(i).cwiseProduct(g.transpose()) * (1.f / std::sqrt(ms + cfg.rms_eps));
    }
  }

  // cos/sin tables [pos][d/2]; θ_i = base^(−2i/d), computed in double then rounded.
  void init_rope(int n_pos) {
    const int half = cfg.head_dim / 2;
    cos_.resize(std::size_t(n_pos) * half);
    sin_.resize(cos_.size());
    for (int p = 0; p < n_pos; ++p)
      for (int i = 0; i < half; ++i) {
        const double ang = p * std::pow(double(cfg.rope_theta), -2.0 * i / cfg.head_dim);
        cos_[std::size_t(p) * half + i] = static_cast<float>(std::cos(ang));
        sin_[std::size_t(p) * half + i] = static_cast<float>(std::sin(ang));
      }
    rope_positions_ = n_pos;
  }

  // Rotates adjacent pairs of each head's [d] slice of rows [n, heads·d]. Positions
  // past the table (longer than context_length) are computed on the fly.
  void rope(RowMat& m, int heads, int pos0) const {
    const int hd = cfg.head_dim, half = hd / 2;
    std::vector<float> extra_c, extra_s;
    for (Eigen::Index t = 0; t < m.rows(); ++t) {
      const int pos = pos0 + static_cast<int>(t);
      const float* cs;
      const float* sn;
      if (pos < rope_positions_) {
        cs = cos_.data() + std::size_t(pos) * half;
        sn = sin_.data() + std::size_t(pos) * half;
      } else {
        extra_c.resize(half);
        extra_s.resize(half);
        for (int i = 0; i < half; ++i) {
          const double ang = pos * std::pow(double(cfg.rope_theta), -2.0 * i / hd);
          extra_c[i] = static_cast<float>(std::cos(ang));
          extra_s[i] = static_cast<float>(std::sin(ang));
        }
        cs = extra_c.data();
        sn = extra_s.data();
      }
      float* row = m.row(t).data();
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < half; ++i) {
          float& a = row[h * hd + 2 * i];
          float& b = row[h * hd + 2 * i + 1];
          const float x0 = a, x1 = b;
          a = x0 * cs[i] - x1 * sn[i];
          b = x0 * sn[i] + x1 * cs[i];
        }
    }
  }

  std::vector<float> cos_, sin_;
  int rope_positions_ = 0;
};

// log-softmax of one logits row, in double for the sums.
inline void log_softmax(const float* logits, int n, std::vector<double>& out) {
  out.resize(static_cast<std::size_t>(n));
  double mx = logits[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, double(logits[i]));
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(s);
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = double(logits[i]) - lse;
}

}  // namespace smollm2
