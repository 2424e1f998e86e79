// calib_compare — base rotations vs OptR on real activations (issue 5 comparison).
//
// For K2V2 and K4V2 (OptR clipping 0.96 K / 0.92 V) and each rotation variant —
// (a) none, (b) Hadamard, (c) covariance base, (d) OptR on Hadamard, (e) OptR on the
// covariance base — with and without key centering, it measures the post-W_O attention
// error on the held-out sequences with keys and values quantized as deployed (exact
// 64-token sink and 256-token recent windows; OptRConfig's 64 query positions, spread
// over the positions that see quantized keys, each seeing the cache as token-by-token
// decode leaves it):
//   error = mean over layers, KV heads, query heads and positions of ‖Δo·W_jᵀ‖²/D.
// Writes a markdown table (stdout and <out>/calib_compare.md), a CSV and an SVG plot of
// error versus bits/element. Default input: the committed SmolLM2-135M fixture.
//
//   calib_compare [activations.safetensors] [out_dir]
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/os.h>

#include "kvq/calib/activation_file.hpp"
#include "kvq/calib/bit_allocation.hpp"
#include "kvq/calib/optr.hpp"

using namespace kvq::calib;

namespace {

struct Row {
  std::string policy, variant;
  bool centered = false;
  double bits = 0, error = 0, rel = 0, seconds = 0;
};

// Held-out error of every head for one policy and rotation variant.
Row evaluate(const std::vector<LayerActivations>& layers, const kvq::Policy& P, const std::string& pname,
             const std::string& variant, BaseKind base, bool optr, OptRConfig cfg) {
  Row r{pname, variant, P.key.centered, P.bits_per_element(), 0, 0, 0};
  cfg.base = base;
  if (!optr) cfg.steps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<LayerResult> res;
  if (base != BaseKind::identity || optr) res = calibrate(layers, P, cfg);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int n = 0;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const auto& a = layers[l];
    const int ns = a.n_seq(), nh = heldout_count(ns, cfg);
    for (int h = 0; h < a.hkv; ++h) {
      const HeadData train = extract_head(a, h, 0, ns - nh), held = extract_head(a, h, ns - nh, ns);
      HeadTransform t;
      if (res.empty()) {
        t = {MatD::Identity(a.head_dim, a.head_dim), MatD::Identity(a.head_dim, a.head_dim),
             P.key.centered ? VecD(train.K.colwise().mean().transpose()) : VecD(VecD::Zero(a.head_dim)),
             VecD::Zero(a.head_dim)};
      } else {
        const HeadResult& hr = res[l].heads[h];
        t = {hr.RK, hr.RV, hr.mu_k, hr.nu_v};
      }
      r.error += head_output_error(held, P, t, cfg);
      ++n;
    }
  }
  r.error /= n;
  return r;
}

std::string svg_plot(const std::vector<Row>& rows) {
  // log10(error) vs bits/element, one marker per (variant, centering).
  double lo = 1e300, hi = -1e300, bmin = 1e300, bmax = -1e300;
  for (const Row& r : rows) {
    lo = std::min(lo, std::log10(r.error));
    hi = std::max(hi, std::log10(r.error));
    bmin = std::min(bmin, r.bits);
    bmax = std::max(bmax, r.bits);
  }
  if (hi - lo < 1e-9) hi = lo + 1;
  if (bmax - bmin < 1e-9) bmax = bmin + 1;
  const double W = 640, H = 420, L = 70, B = 50, R = 200, T = 20;
  auto X = [&](double b) { return L + (b - bmin) / (bmax - bmin) * (W - L - R) * 0.8 + (W - L - R) * 0.1; };
  auto Y = [&](double e) { return T + (hi - std::log10(e)) / (hi - lo) * (H - T - B); };
  const char* colors[] = {"#444", "#1f77b4", "#2ca02c", "#d62728", "#9467bd"};
  std::map<std::string, int> vid;
  std::string s = fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' "
                              "font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n",
                              W, H);
  s += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='black'/>\n", L, H - B, W - R, H - B);
  s += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='black'/>\n", L, T, L, H - B);
  s += fmt::format("<text x='{}' y='{}' text-anchor='middle'>bits/element (metadata included)</text>\n",
                   (L + W - R) / 2, H - 12);
  s += fmt::format("<text x='14' y='{}' transform='rotate(-90 14 {})' text-anchor='middle'>held-out post-W_O error "
                   "(log)</text>\n",
                   (T + H - B) / 2, (T + H - B) / 2);
  for (const Row& r : rows) {
    if (!vid.count(r.variant)) vid[r.variant] = static_cast<int>(vid.size());
    const int v = vid[r.variant];
    const double x = X(r.bits) + (v - 2) * 6, y = Y(r.error);
    if (r.centered)
      s += fmt::format("<circle cx='{:.1f}' cy='{:.1f}' r='5' fill='{}'/>\n", x, y, colors[v % 5]);
    else
      s += fmt::format("<circle cx='{:.1f}' cy='{:.1f}' r='5' fill='none' stroke='{}' stroke-width='2'/>\n", x, y,
                       colors[v % 5]);
  }
  std::map<double, std::string> ticks;
  for (const Row& r : rows) ticks[r.bits] = r.policy;
  for (const auto& [b, name] : ticks)
    s += fmt::format("<text x='{:.1f}' y='{}' text-anchor='middle'>{} ({:.3g})</text>\n", X(b), H - B + 16, name, b);
  for (int e = static_cast<int>(std::floor(lo)); e <= static_cast<int>(std::ceil(hi)); ++e)
    if (e >= lo - 1e-9 && e <= hi + 1e-9)
      s += fmt::format("<text x='{}' y='{:.1f}' text-anchor='end'>1e{}</text>\n", L - 4, Y(std::pow(10.0, e)) + 4, e);
  int k = 0;
  for (const auto& [name, v] : vid) {
    s += fmt::format("<circle cx='{}' cy='{}' r='5' fill='{}'/><text x='{}' y='{}'>{}</text>\n", W - R + 20,
                     T + 20 + 18 * k, colors[v % 5], W - R + 30, T + 24 + 18 * k, name);
    ++k;
  }
  s += fmt::format("<text x='{}' y='{}'>filled: key centering</text>\n", W - R + 14, T + 30 + 18 * k);
  s += "</svg>\n";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string input =
        argc > 1 && argv[1][0] ? argv[1] : std::string(KVQ_SOURCE_DIR) + "/tests/data/smollm2/activations_l2_15_28.safetensors";
    const std::filesystem::path out = argc > 2 ? argv[2] : ".";
    std::filesystem::create_directories(out);
    const auto layers = read_activations(input);
    const int d = layers.front().head_dim;
    fmt::print("input {}: {} layers, {} tokens, {} sequences\n", input, layers.size(), layers.front().n_tokens,
               layers.front().n_seq());
    const OptRConfig cfg;  // DESIGN §6.3 defaults
    std::vector<Row> rows;
    for (const auto& [pname, base_p] : {std::pair{"K2V2", kvq::presets::K2V2}, std::pair{"K4V2", kvq::presets::K4V2}})
      for (bool centered : {false, true}) {
        kvq::Policy P = base_p.with_head_dim(d).with_clip(960, 920);
        P.key.rotation = P.value.rotation = kvq::Rotation::dense;
        P.key.centered = centered;
        const struct {
          const char* name;
          BaseKind base;
          bool optr;
        } variants[] = {{"none", BaseKind::identity, false},
                        {"hadamard", BaseKind::hadamard, false},
                        {"covariance", BaseKind::covariance, false},
                        {"optr+hadamard", BaseKind::hadamard, true},
                        {"optr+covariance", BaseKind::covariance, true}};
        for (const auto& v : variants) {
          rows.push_back(evaluate(layers, P, pname, v.name, v.base, v.optr, cfg));
          fmt::print("  {} {:<16} centered={} error {:.4e} ({:.1f}s)\n", pname, v.name, centered, rows.back().error,
                     rows.back().seconds);
        }
      }
    std::map<std::string, double> ref;  // no rotation, no centering, per policy
    for (const Row& r : rows)
      if (r.variant == "none" && !r.centered) ref[r.policy] = r.error;
    for (Row& r : rows) r.rel = r.error / ref[r.policy];

    std::string md = "| policy | bits/elem | rotation | key centering | held-out post-W_O error | vs none | calib s |\n"
                     "|---|---|---|---|---|---|---|\n";
    for (const Row& r : rows)
      md += fmt::format("| {} | {:.3f} | {} | {} | {:.4e} | {:.3f} | {:.1f} |\n", r.policy, r.bits, r.variant,
                        r.centered ? "yes" : "no", r.error, r.rel, r.seconds);
    fmt::print("\n{}", md);
    std::ofstream(out / "calib_compare.md") << md;
    std::ofstream csv(out / "calib_compare.csv");
    csv << "policy,bits_per_element,rotation,key_centering,heldout_error,relative_to_none,calib_seconds\n";
    for (const Row& r : rows)
      csv << fmt::format("{},{},{},{},{:.6e},{:.6f},{:.3f}\n", r.policy, r.bits, r.variant, r.centered ? 1 : 0,
                         r.error, r.rel, r.seconds);
    std::ofstream(out / "calib_compare.svg") << svg_plot(rows);
    fmt::print("wrote {}/calib_compare.{{md,csv,svg}}\n", out.string());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "calib_compare: error: {}\n", e.what());
    return 1;
  }
}
