// kvq_calib — offline calibration for kvq (DESIGN §6).
//
//   kvq_calib optr     -i activations.safetensors -p K2V2_R -o optr.safetensors
//   kvq_calib allocate -i activations.safetensors -b 3.0 -o layers.csv
//
// `optr` learns per-(layer, KV head) rotations and writes the artifact engines load
// with kvq::calib::load_artifact<P>(); `allocate` prints the norm-disparity report,
// measures the per-layer post-W_O error of each candidate policy, and writes the
// per-layer policy table chosen for an average bits/element budget.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "kvq/calib/activation_file.hpp"
#include "kvq/calib/artifact.hpp"
#include "kvq/calib/bit_allocation.hpp"
#include "kvq/calib/optr.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using namespace kvq::calib;

// A preset name, optionally with :kclip=, :vclip=, :meta= (kvq::parse_policy).
kvq::Policy policy_by_name(const std::string& name, int head_dim) {
  kvq::Policy p{};
  kvq::throw_if_error(kvq::parse_policy(name, p));
  return p.with_head_dim(head_dim);
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  if (s.empty() || s == "all") return out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t c = std::min(s.find(',', pos), s.size());
    const std::string tok = s.substr(pos, c - pos);
    std::size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size() || tok.empty() || v < 0)
      throw kvq::Error(kvq::StatusCode::invalid_argument, "bad layer list '" + s + "'");
    out.push_back(v);
    pos = c + 1;
  }
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t c = std::min(s.find(',', pos), s.size());
    if (c > pos) out.push_back(s.substr(pos, c - pos));
    pos = c + 1;
  }
  return out;
}

struct Common {
  std::string input, layers = "all";
  int chunk = 0, threads = 0;
  std::int64_t rope_shift = 0;  // -1: the capture's context_length (0 when it has none)
  OptRConfig cfg;
};

std::vector<LayerActivations> load(const Common& c) {
  auto ls = read_activations(c.input, parse_ints(c.layers));
  if (c.chunk > 0)
    for (auto& l : ls) split_sequences(l, c.chunk);
  const auto& a = ls.front();
  fmt::print("{}: {} layers, {} tokens in {} sequences, Hq {} Hkv {} head_dim {} hidden {}\n", c.input,
             ls.size(), a.n_tokens, a.n_seq(), a.hq, a.hkv, a.head_dim, a.hidden);
  return ls;
}

void add_windows(CLI::App* app, Common& c) {
  app->add_option("-i,--activations", c.input, "activation safetensors (kvq.activations.v1)")
      ->required()
      ->check(CLI::ExistingFile);
  app->add_option("--layers", c.layers, "comma-separated layer ids, or 'all'")->capture_default_str();
  app->add_option("--prefix", c.cfg.prefix, "exact sink tokens per sequence")->capture_default_str();
  app->add_option("--recent", c.cfg.recent, "exact recent tokens of the cache each query sees")->capture_default_str();
  app->add_option("--qwin", c.cfg.qwin, "query positions per sequence, the last at its end")->capture_default_str();
  app->add_option("--qstride", c.cfg.qstride, "spacing of the query positions (1 = the last qwin tokens, 0 = spread over those that see quantized keys)")
      ->capture_default_str();
  app->add_option("--qblock", c.cfg.qblock, "tokens appended and attended at a time (1 = token-by-token decode)")
      ->capture_default_str();
  app->add_option("--chunk", c.chunk, "split sequences into chunks of this many tokens (0 = keep)");
  app->add_option("--threads", c.threads, "OpenMP threads (0 = runtime default)");
}

int run_optr(Common& c, const std::string& policy_name, const std::string& out, const std::string& base,
             const std::string& param, bool zero_key_mean, bool train_key_mean) {
  auto ls = load(c);
  const kvq::Policy P = policy_by_name(policy_name, ls.front().head_dim);
  // --zero-key-mean calibrates without key centering and stores μ_K = 0: subtracting a
  // zero mean is exact, so the artifact still loads into the (centering) preset and
  // deploys as "no key centering".
  kvq::Policy calibrated = P;
  if (zero_key_mean) calibrated.key.centered = false;
  if (train_key_mean)  // ignore the capture's k_mean: μ_K from the training tokens
    for (auto& l : ls) l.key_mean.clear();
  c.cfg.rope_shift = c.rope_shift >= 0 ? c.rope_shift : ls.front().rope.theta > 0 ? ls.front().rope.context : 0;
  if (base == "hadamard") c.cfg.base = BaseKind::hadamard;
  else if (base == "covariance") c.cfg.base = BaseKind::covariance;
  else if (base == "identity") c.cfg.base = BaseKind::identity;
  else throw kvq::Error(kvq::StatusCode::invalid_argument, "--base must be hadamard, covariance or identity");
  if (param == "exp") c.cfg.param = Parameterization::exp_map;
  else if (param == "riemannian") c.cfg.param = Parameterization::riemannian;
  else throw kvq::Error(kvq::StatusCode::invalid_argument, "--param must be exp or riemannian");
  fmt::print("policy {} = {}\nOptR: base {}, {}, {} steps ({} for V), lr {}, lambda {}, k-token {}, v-token {}, "
             "v-uniform {}, margin {}, windows {}/{}/{}x{}/{}, rope-shift {}\n",
             policy_name, kvq::to_string(P), base, param, c.cfg.steps, c.cfg.v_steps >= 0 ? c.cfg.v_steps : c.cfg.steps,
             c.cfg.lr, c.cfg.lambda, c.cfg.k_token, c.cfg.v_token, c.cfg.v_uniform, c.cfg.margin, c.cfg.prefix,
             c.cfg.recent, c.cfg.qwin, c.cfg.qstride, c.cfg.qblock, c.cfg.rope_shift);
  const auto t0 = std::chrono::steady_clock::now();
  const auto res = calibrate(ls, calibrated, c.cfg, [](const LayerResult& l) {
    int kk = 0, vk = 0;
    for (const auto& h : l.heads) kk += h.k.kept, vk += h.v.kept;
    fmt::print("  layer {:3d} done in {:6.2f}s  kept K {}/{}  V {}/{}\n", l.layer, l.seconds, kk, l.heads.size(),
               vk, l.heads.size());
    std::fflush(stdout);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("\n{:>5} {:>4}  {:>11} {:>11} {:>7} {:>5}  {:>11} {:>11} {:>7} {:>5}\n", "layer", "head", "K base",
             "K best", "K gain", "kept", "V base", "V best", "V gain", "kept");
  int heads = 0, kbetter = 0, vbetter = 0;
  for (const auto& l : res)
    for (std::size_t h = 0; h < l.heads.size(); ++h) {
      const auto& r = l.heads[h];
      auto gain = [](const RotationFit& f) { return f.base_loss > 0 ? 100.0 * (1 - f.best_loss / f.base_loss) : 0.0; };
      fmt::print("{:5d} {:4d}  {:11.4e} {:11.4e} {:6.1f}% {:>5}  {:11.4e} {:11.4e} {:6.1f}% {:>5}\n", l.layer, h,
                 r.k.base_loss, r.k.best_loss, gain(r.k), r.k.kept ? "yes" : "no", r.v.base_loss, r.v.best_loss,
                 gain(r.v), r.v.kept ? "yes" : "no");
      ++heads;
      kbetter += r.k.best_loss < r.k.base_loss;
      vbetter += r.v.best_loss < r.v.base_loss;
    }
  fmt::print("\nheld-out loss lowered on K {}/{} heads, V {}/{} heads; calibration {:.1f}s\n", kbetter, heads,
             vbetter, heads, secs);
  Artifact art = make_artifact(res, P, c.cfg, c.input);
  art.info["key_mean"] = !calibrated.key.centered ? "zero"
                         : ls.front().key_mean.empty()
                             ? "measured"
                             : fmt::format("measured over {} tokens outside the sequences", ls.front().key_mean_tokens);
  write_artifact(art, out);
  fmt::print("wrote {}\n", out);
  return 0;
}

int run_allocate(Common& c, double budget, const std::string& cand_list, const std::string& out,
                 const std::string& artifact_path) {
  const auto ls = load(c);
  const int d = ls.front().head_dim;
  std::vector<Candidate> cands;
  for (const auto& n : split(cand_list)) cands.push_back({n, policy_by_name(n, d)});
  if (cands.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "--candidates is empty");
  // Dense-rotation candidates are measured with the calibrated rotations of an artifact
  // made for exactly that policy.
  Artifact art;
  if (!artifact_path.empty()) art = read_artifact(artifact_path);
  std::vector<std::vector<std::vector<HeadTransform>>> dense(cands.size());
  for (std::size_t ci = 0; ci < cands.size(); ++ci) {
    const kvq::Policy& P = cands[ci].policy;
    if (P.key.rotation != kvq::Rotation::dense && P.value.rotation != kvq::Rotation::dense) continue;
    if (artifact_path.empty())
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       "candidate " + cands[ci].name + " uses learned rotations: pass --artifact");
    if (!(art.policy == P))
      throw kvq::Error(kvq::StatusCode::invalid_argument, "--artifact was calibrated for " +
                                                              kvq::to_string(art.policy) + ", candidate " +
                                                              cands[ci].name + " is " + kvq::to_string(P));
    for (const auto& a : ls) dense[ci].push_back(head_transforms(art, a.layer));
  }

  fmt::print("\nnorm-disparity report (W_K/W_V norms need layers.<l>.w_k / w_v in the input)\n");
  fmt::print("{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n", "layer", "|WK|_F", "|WK|_2", "|WV|_F",
             "|WV|_2", "K rms", "V rms", "K absmax", "V absmax");
  const kvq::io::SafetensorsFile f = kvq::io::SafetensorsFile::open(c.input);
  for (const auto& a : ls) {
    const std::string p = "layers." + std::to_string(a.layer) + ".";
    NormReport r;
    if (f.contains(p + "w_k") && f.contains(p + "w_v") && f.tensor(p + "w_k").shape.size() == 2 &&
        f.tensor(p + "w_k").shape == f.tensor(p + "w_v").shape) {
      const auto wk = f.to_float(p + "w_k"), wv = f.to_float(p + "w_v");
      const auto& s = f.tensor(p + "w_k").shape;
      r = norm_report(a, wk.data(), wv.data(), static_cast<int>(s[0]), static_cast<int>(s[1]));
    } else {
      r = norm_report(a);
    }
    auto num = [](double x) { return std::isfinite(x) ? fmt::format("{:9.3f}", x) : fmt::format("{:>9}", "-"); };
    fmt::print("{:5d} {} {} {} {} {:9.3f} {:9.3f} {:9.3f} {:9.3f}\n", a.layer, num(r.wk_fro), num(r.wk_spec),
               num(r.wv_fro), num(r.wv_spec), r.k_rms, r.v_rms, r.k_absmax, r.v_absmax);
  }

  std::vector<std::vector<double>> err(ls.size(), std::vector<double>(cands.size()));
  std::vector<int> ids;
  for (const auto& a : ls) ids.push_back(a.layer);
  for (std::size_t ci = 0; ci < cands.size(); ++ci)
    for (std::size_t l = 0; l < dense[ci].size(); ++l)
      if (static_cast<int>(dense[ci][l].size()) != ls[l].hkv)
        throw kvq::Error(kvq::StatusCode::invalid_argument, "--artifact has a different number of KV heads");
  std::string first_error;  // exceptions must not leave the OpenMP region
  KVQ_CALIB_OMP(parallel for collapse(2) schedule(dynamic, 1))
  for (std::size_t l = 0; l < ls.size(); ++l)
    for (std::size_t ci = 0; ci < cands.size(); ++ci) {
      try {
        // Held-out sequences only (the split of `optr`), so learned rotations get no
        // in-sample advantage.
        const int ns = ls[l].n_seq(), nh = heldout_count(ns, c.cfg);
        err[l][ci] = layer_output_error(ls[l], cands[ci].policy, c.cfg, dense[ci].empty() ? nullptr : &dense[ci][l],
                                        ns - nh, ns);
      } catch (const std::exception& e) {
        KVQ_CALIB_OMP(critical(kvq_calib_cli))
        if (first_error.empty()) first_error = e.what();
      }
    }
  if (!first_error.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, first_error);
  fmt::print("\nmeasured post-W_O error per layer (held-out sequences)\n{:>5}", "layer");
  for (const auto& cd : cands) fmt::print(" {:>11}", cd.name);
  fmt::print("\n");
  for (std::size_t l = 0; l < ls.size(); ++l) {
    fmt::print("{:5d}", ids[l]);
    for (double e : err[l]) fmt::print(" {:11.4e}", e);
    fmt::print("\n");
  }
  const Allocation a = allocate_bits(ids, cands, err, budget);
  fmt::print("\nallocation at {:.3f} bits/element: achieved {:.3f}, total error {:.4e}\n", budget, a.mean_bits,
             a.total_error);
  for (std::size_t ci = 0; ci < cands.size(); ++ci) {
    double tot = 0;
    for (std::size_t l = 0; l < ls.size(); ++l) tot += err[l][ci];
    fmt::print("  uniform {:<8} {:.3f} bits/element, total error {:.4e}\n", cands[ci].name,
               cands[ci].policy.bits_per_element(), tot);
  }
  for (std::size_t l = 0; l < ls.size(); ++l) fmt::print("  layer {:3d} -> {}\n", ids[l], cands[a.choice[l]].name);
  std::ofstream os(out);
  if (!os) throw kvq::Error(kvq::StatusCode::io_error, "cannot write '" + out + "'");
  write_allocation_csv(os, a, cands, err);
  fmt::print("wrote {}\n", out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__GLIBC__)
  // Each OptR step allocates and frees fp64 temporaries of 0.1–2 MB. Keep them in the heap:
  // as fresh mmaps their page faults took ~8% of a calibration's samples (perf).
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  CLI::App app{"kvq offline calibration: OptR rotations and key-prioritized bit allocation (DESIGN §6)"};
  app.require_subcommand(1);

  Common oc;
  std::string policy = "K2V2_R", out = "optr.safetensors", base = "hadamard", param = "exp";
  auto* optr = app.add_subcommand("optr", "learn per-head rotations and write the artifact");
  add_windows(optr, oc);
  optr->add_option("-p,--policy", policy, "preset name, optionally with :kclip=N, :vclip=N, :meta=T (its bits, groups, clip and centering are used)")
      ->capture_default_str();
  optr->add_option("-o,--out", out, "artifact path")->capture_default_str();
  optr->add_option("--base", base, "base rotation: hadamard, covariance or identity")->capture_default_str();
  optr->add_option("--param", param, "exp (R0·exp(A−Aᵀ)) or riemannian")->capture_default_str();
  optr->add_option("--steps", oc.cfg.steps, "Adam steps per phase (0 = base only)")->capture_default_str();
  optr->add_option("--v-steps", oc.cfg.v_steps,
                   "Adam steps of the V phase (-1 = --steps; 0 = base V rotations, learned keys only)")
      ->capture_default_str();
  optr->add_option("--lr", oc.cfg.lr, "Adam learning rate")->capture_default_str();
  optr->add_option("--lambda", oc.cfg.lambda, "weight of the K-phase post-W_O term")->capture_default_str();
  optr->add_option("--k-token", oc.cfg.k_token,
                   "weight of the K phase's mean squared logit error of every key (0 = DESIGN 6.3's loss)")
      ->capture_default_str();
  optr->add_option("--rope-shift", oc.rope_shift,
                   "move each sequence to a pseudo-random position below this (0: as captured; -1: the capture's "
                   "context_length)")
      ->capture_default_str();
  optr->add_option("--v-token", oc.cfg.v_token,
                   "weight of the V phase's attention-weighted per-token error (0 = DESIGN 6.3's loss)")
      ->capture_default_str();
  optr->add_option("--v-uniform", oc.cfg.v_uniform,
                   "weight of the V phase's per-token error, every quantized token alike (0 = DESIGN 6.3's loss)")
      ->capture_default_str();
  optr->add_option("--margin", oc.cfg.margin, "keep a learned R only if it beats the base by this fraction")
      ->capture_default_str();
  optr->add_option("--eval-every", oc.cfg.eval_every, "held-out evaluation period")->capture_default_str();
  optr->add_option("--heldout", oc.cfg.heldout_fraction, "fraction of sequences held out")->capture_default_str();
  optr->add_flag("--cosine-lr", oc.cfg.cosine_lr, "decay the learning rate to 0 by a half cosine (default: constant)");
  bool zero_key_mean = false, train_key_mean = false;
  optr->add_flag("--train-key-mean", train_key_mean,
                 "center keys with the training tokens' mean even when the capture has k_mean (--mean-seqs)");
  optr->add_flag("--zero-key-mean", zero_key_mean,
                 "calibrate without key centering and store mu_K = 0 (deploys as no centering)");

  Common ac;
  double budget = 3.0;
  std::string cands = "K2V2,K2V4,K4V2,K4V4,K8V8", table = "layer_policies.csv";
  auto* alloc = app.add_subcommand("allocate", "norm report, measured errors and per-layer bit allocation");
  add_windows(alloc, ac);
  alloc->add_option("-b,--budget", budget, "average bits/element, metadata included")->capture_default_str();
  alloc->add_option("-c,--candidates", cands, "comma-separated preset names")->capture_default_str();
  alloc->add_option("-o,--out", table, "per-layer table (CSV)")->capture_default_str();
  std::string artifact;
  alloc->add_option("--artifact", artifact, "OptR artifact for dense-rotation (_R) candidates")
      ->check(CLI::ExistingFile);

  CLI11_PARSE(app, argc, argv);
  try {
    Common& c = optr->parsed() ? oc : ac;
#if defined(_OPENMP)
    if (c.threads > 0) omp_set_num_threads(c.threads);
#endif
    c.cfg.validate();
    if (optr->parsed()) return run_optr(oc, policy, out, base, param, zero_key_mean, train_key_mean);
    return run_allocate(ac, budget, cands, table, artifact);
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvq_calib: error: {}\n", e.what());
    return 1;
  }
}
