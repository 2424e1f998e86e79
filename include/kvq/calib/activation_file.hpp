// kvq/calib/activation_file.hpp — reads calibration activations (DESIGN §6 input).
//
// Format "kvq.activations.v1" (written by activations_writer, e.g. smollm2_eval capture), safetensors:
//   layers.<l>.q    [L, Hq, d]    queries (post-RoPE)       F32 / F16 / BF16
//   layers.<l>.k    [L, Hkv, d]   keys (post-RoPE)
//   layers.<l>.v    [L, Hkv, d]   values
//   layers.<l>.w_o  [D, Hq·d]     output projection (PyTorch convention)
//   seq_offsets     [n_seq + 1]   I64 (or I32) CSR sequence boundaries into L
//   layers.<l>.k_mean [Hkv, d]    optional: key mean over tokens beyond the sequences
//                                 (capture --mean-seqs); OptR centers keys with it
// Metadata "layers" lists the captured layer ids; optional "rope_theta", "rope" (the pair
// layout, "adjacent …" or "half …") and the model's "context_length" let OptR move
// sequences in position (rope_shift.hpp). Every shape and offset is checked;
// missing or misshapen tensors are kvq::Error naming the tensor.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/io/safetensors.hpp"

namespace kvq::calib {

namespace detail {
[[noreturn]] inline void bad_activations(const std::string& m) {
  throw Error(StatusCode::invalid_argument, "activations: " + m);
}

inline std::vector<int> parse_layer_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok.empty()) continue;
    std::size_t pos = 0;
    int v = -1;
    try {
      v = std::stoi(tok, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos != tok.size() || v < 0) bad_activations("bad layer id '" + tok + "'");
    out.push_back(v);
  }
  return out;
}

// Metadata `key` as a positive number (an integer when `integer`), 0 when absent; anything
// else is rejected.
inline double positive_metadata(const io::SafetensorsFile& f, const std::string& key, bool integer) {
  const auto it = f.metadata().find(key);
  if (it == f.metadata().end()) return 0;
  std::size_t used = 0;
  double v = 0;
  try {
    v = integer ? static_cast<double>(std::stoll(it->second, &used)) : std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != it->second.size() || !(v > 0) || !std::isfinite(v))
    bad_activations("metadata '" + key + "' must be a positive " + (integer ? "integer" : "number"));
  return v;
}
}  // namespace detail

// Layer ids present in the file (from metadata "layers", else from tensor names).
inline std::vector<int> activation_layers(const io::SafetensorsFile& f) {
  auto it = f.metadata().find("layers");
  if (it != f.metadata().end()) return detail::parse_layer_list(it->second);
  std::vector<int> ids;
  for (const std::string& n : f.names())
    if (n.rfind("layers.", 0) == 0 && n.size() > 2 && n.compare(n.size() - 2, 2, ".k") == 0)
      ids.push_back(detail::parse_layer_list(n.substr(7, n.size() - 9)).at(0));
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Reads layers `which` (empty = all) from an activation file.
inline std::vector<LayerActivations> read_activations(const io::SafetensorsFile& f, std::vector<int> which = {}) {
  if (which.empty()) which = activation_layers(f);
  if (which.empty()) detail::bad_activations("the file holds no layers");
  // Sequence boundaries are shared by all layers.
  if (!f.contains("seq_offsets")) detail::bad_activations("tensor 'seq_offsets' is missing");
  // How many tokens the optional k_mean tensors average.
  const auto key_mean_tokens = static_cast<std::int64_t>(detail::positive_metadata(f, "key_mean_tokens", true));
  // optional: "rope_theta" (> 0), "rope" ("adjacent …" or "half …"), "context_length"
  RopeSpec rope;
  if (f.metadata().count("rope_theta")) {
    rope.theta = detail::positive_metadata(f, "rope_theta", false);
    rope.context = static_cast<std::int64_t>(detail::positive_metadata(f, "context_length", true));
    const auto r = f.metadata().find("rope");
    if (r != f.metadata().end() && r->second.rfind("half", 0) == 0) rope.pairs = RopePairs::half;
    else if (r == f.metadata().end() || r->second.rfind("adjacent", 0) != 0)
      detail::bad_activations("metadata 'rope' must start with 'adjacent' or 'half' when 'rope_theta' is given");
  }
  const io::TensorView& so = f.tensor("seq_offsets");
  if (so.shape.size() != 1 || so.shape[0] < 2) detail::bad_activations("'seq_offsets' must be [n_seq + 1], n_seq >= 1");
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(so.shape[0]));
  if (so.dtype == io::DType::I64) {
    std::memcpy(offsets.data(), so.data.data(), offsets.size() * 8);
  } else if (so.dtype == io::DType::I32) {
    for (std::size_t i = 0; i < offsets.size(); ++i) {
      std::int32_t x;
      std::memcpy(&x, so.data.data() + 4 * i, 4);
      offsets[i] = x;
    }
  } else {
    detail::bad_activations("'seq_offsets' must be I64 or I32");
  }
  std::vector<LayerActivations> out;
  for (int l : which) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* t : {"q", "k", "v", "w_o"})
      if (!f.contains(p + t)) detail::bad_activations("tensor '" + p + t + "' is missing");
    const auto& qs = f.tensor(p + "q").shape;
    const auto& ks = f.tensor(p + "k").shape;
    const auto& vs = f.tensor(p + "v").shape;
    const auto& ws = f.tensor(p + "w_o").shape;
    if (qs.size() != 3 || ks.size() != 3 || ws.size() != 2)
      detail::bad_activations("layer " + std::to_string(l) + ": q/k/v must be 3-D and w_o 2-D");
    if (vs != ks) detail::bad_activations("layer " + std::to_string(l) + ": v and k shapes differ");
    if (qs[0] != ks[0] || qs[2] != ks[2])
      detail::bad_activations("layer " + std::to_string(l) + ": q and k disagree on L or head_dim");
    if (qs[0] > (1 << 26) || qs[1] > 4096 || ks[1] > 4096 || qs[2] > 1024 || ws[0] > (1 << 20))
      detail::bad_activations("layer " + std::to_string(l) + ": dimensions out of range");
    LayerActivations a;
    a.layer = l;
    a.n_tokens = static_cast<int>(qs[0]);
    a.hq = static_cast<int>(qs[1]);
    a.hkv = static_cast<int>(ks[1]);
    a.head_dim = static_cast<int>(qs[2]);
    a.hidden = static_cast<int>(ws[0]);
    if (ws[1] != qs[1] * qs[2])
      detail::bad_activations("layer " + std::to_string(l) + ": w_o must be [D, Hq*d]");
    a.q = f.to_float(p + "q");
    a.k = f.to_float(p + "k");
    a.v = f.to_float(p + "v");
    a.w_o = f.to_float(p + "w_o");
    if (f.contains(p + "k_mean")) {
      if (f.tensor(p + "k_mean").shape != std::vector<std::int64_t>{ks[1], ks[2]})
        detail::bad_activations("layer " + std::to_string(l) + ": k_mean must be [Hkv, d]");
      a.key_mean = f.to_float(p + "k_mean");
      a.key_mean_tokens = key_mean_tokens;
    }
    a.seq_offsets = offsets;
    a.rope = rope;
    a.validate();
    for (const auto* x : {&a.q, &a.k, &a.v, &a.w_o, &a.key_mean})
      for (float e : *x)
        if (!std::isfinite(e)) detail::bad_activations("layer " + std::to_string(l) + " has non-finite values");
    out.push_back(std::move(a));
  }
  return out;
}

inline std::vector<LayerActivations> read_activations(const std::filesystem::path& path, std::vector<int> which = {}) {
  return read_activations(io::SafetensorsFile::open(path), std::move(which));
}

// Writes layers in the same format, Q/K/V/W_O stored as `stored` (F32, F16 or BF16), with
// the metadata "format", "layers", "num_qo_heads", "num_kv_heads", "head_dim", "hidden" and,
// when layers[0].rope is known, "rope_theta", "rope" and "context_length".
// Callers (smollm2_eval capture) may add tensors and metadata before writing.
inline io::SafetensorsWriter activations_writer(const std::vector<LayerActivations>& layers,
                                                io::DType stored = io::DType::F32) {
  io::SafetensorsWriter w;
  if (layers.empty()) throw Error(StatusCode::invalid_argument, "activations: nothing to write");
  std::string ids;
  for (const LayerActivations& a : layers) {
    a.validate();
    if (a.seq_offsets != layers[0].seq_offsets)
      throw Error(StatusCode::invalid_argument, "activations: layers must share sequence offsets");
    const std::string p = "layers." + std::to_string(a.layer) + ".";
    const std::int64_t L = a.n_tokens, d = a.head_dim;
    if (a.hq != layers[0].hq || a.hkv != layers[0].hkv || a.head_dim != layers[0].head_dim ||
        a.hidden != layers[0].hidden)
      throw Error(StatusCode::invalid_argument, "activations: layers must share head counts, head_dim and hidden");
    w.add_f32(p + "q", {L, a.hq, d}, a.q, stored);
    w.add_f32(p + "k", {L, a.hkv, d}, a.k, stored);
    w.add_f32(p + "v", {L, a.hkv, d}, a.v, stored);
    w.add_f32(p + "w_o", {a.hidden, a.hq * d}, a.w_o, stored);
    if (!a.key_mean.empty()) w.add_f32(p + "k_mean", {a.hkv, d}, a.key_mean, io::DType::F32);
    if (!ids.empty()) ids += ',';
    ids += std::to_string(a.layer);
  }
  w.add("seq_offsets", io::DType::I64, {static_cast<std::int64_t>(layers[0].seq_offsets.size())},
        layers[0].seq_offsets.data());
  w.set_metadata("format", "kvq.activations.v1");
  w.set_metadata("layers", ids);
  w.set_metadata("num_qo_heads", std::to_string(layers[0].hq));
  w.set_metadata("num_kv_heads", std::to_string(layers[0].hkv));
  w.set_metadata("head_dim", std::to_string(layers[0].head_dim));
  w.set_metadata("hidden", std::to_string(layers[0].hidden));
  if (!layers[0].key_mean.empty()) w.set_metadata("key_mean_tokens", std::to_string(layers[0].key_mean_tokens));
  if (layers[0].rope.theta > 0) {
    char theta[32];
    std::snprintf(theta, sizeof theta, "%.17g", layers[0].rope.theta);
    w.set_metadata("rope_theta", theta);
    w.set_metadata("rope", layers[0].rope.pairs == RopePairs::adjacent
                               ? "adjacent pairs (2i, 2i+1), GGUF/NORM; q and k post-RoPE"
                               : "half pairs (i, i+d/2), NeoX/HF; q and k post-RoPE");
    if (layers[0].rope.context > 0) w.set_metadata("context_length", std::to_string(layers[0].rope.context));
  }
  return w;
}

}  // namespace kvq::calib
