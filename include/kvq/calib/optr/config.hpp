// kvq/calib/optr/config.hpp — OptR settings (DESIGN §6.3): windows, optimizer, base rotation
// and parameterization, with their validation.
#pragma once

#include <cstdint>
#include <string>

#include "kvq/core/status.hpp"

namespace kvq::calib {

enum class BaseKind { identity, hadamard, covariance };
enum class Parameterization {
  exp_map,     // R = R0·exp(A − Aᵀ), gradient by the block-exponential Fréchet adjoint
  riemannian,  // R ← R·exp(step) with the gradient taken at the current point (A = 0)
};

inline const char* to_string(BaseKind b) {
  switch (b) {
    case BaseKind::identity: return "identity";
    case BaseKind::hadamard: return "hadamard";
    case BaseKind::covariance: return "covariance";
  }
  return "?";
}
inline const char* to_string(Parameterization p) {
  return p == Parameterization::exp_map ? "exp_map" : "riemannian";
}

struct OptRConfig {
  int prefix = 64;       // exact attention-sink tokens at the start of each sequence
  int recent = 256;      // exact latest tokens of the cache each query sees (optr/windows.hpp)
  int qwin = 64;         // query positions used per sequence, the last at its end
  // Spacing of those positions: 1 = the last qwin tokens (the rule until 2026-12-05); 0 =
  // spread over the positions that see quantized keys, max(1, ⌊(len − prefix − recent) /
  // qwin⌋) per sequence (11 for 1024 tokens: positions 330 … 1023), as an evaluation scores
  // every position. Measured on SmolLM2 (examples/smollm2 README).
  int qstride = 0;
  // Tokens appended and attended at a time (optr/windows.hpp): a query sees the recent
  // window as it stands after its block. 1 = token-by-token decode (measured better on
  // SmolLM2 than 64, examples/smollm2's prefill blocks, with which the last 64 queries of a
  // 1024-token sequence all see [prefix, len − recent) quantized, the rule until 2026-12-05).
  int qblock = 1;
  int steps = 80;        // Adam steps per phase; 0 = base rotations only
  // Adam steps of the V phase; −1 = steps. 0 keeps the base V rotation (learned keys only:
  // on SmolLM2 the learned V rotations cost most of 8K passkey retrieval, examples/smollm2).
  int v_steps = -1;
  int eval_every = 20;   // held-out evaluation period (and at the end)
  // lr 0.005, constant: measured on SmolLM2-135M (8 × 1024 tokens, examples/smollm2 README);
  // the paper's 0.02 moves ‖A − Aᵀ‖ by radians within 10 steps and a half-cosine decay
  // from 0.01 generalized worse on both evaluation texts.
  double lr = 0.005, beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  double lambda = 1.0;   // weight of the post-W_O shift term in the K phase
  double k_token = 0.0;  // weight of the K phase's per-key logit-error term (k_phase.hpp); 0 = §6.3
  double v_token = 0.0;  // weight of the V phase's per-token term (v_phase.hpp); 0 = §6.3
  double v_uniform = 0.0;  // weight of the V phase's unweighted per-token term (v_phase.hpp); 0 = §6.3
  double margin = 0.01;  // keep learned R only if best < base·(1 − margin)
  // > 0: every sequence is turned to a pseudo-random absolute position so that its tokens
  // lie in [0, rope_shift) (rope_shift.hpp; needs the capture's RoPE). 0 = as captured.
  std::int64_t rope_shift = 0;
  bool cosine_lr = false;  // lr·½(1 + cos(π·(step−1)/steps)) instead of DESIGN §6.3's constant lr
  double tau = 0.0;      // softmax scale; 0 = 1/√d
  double heldout_fraction = 0.25;  // share of sequences held out (at least one)
  BaseKind base = BaseKind::hadamard;
  Parameterization param = Parameterization::exp_map;

  void validate() const {
    auto bad = [](const std::string& m) { throw Error(StatusCode::invalid_argument, "calib: " + m); };
    if (prefix < 0 || recent < 0) bad("prefix and recent must be >= 0");
    if (qwin <= 0) bad("qwin must be > 0");
    if (qstride < 0) bad("qstride must be >= 0 (0 = spread)");
    if (qblock <= 0) bad("qblock must be > 0");
    if (steps < 0) bad("steps must be >= 0");
    if (v_steps < -1) bad("v_steps must be >= 0, or -1 for steps");
    if (eval_every <= 0) bad("eval_every must be > 0");
    if (!(lr > 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(adam_eps > 0))
      bad("Adam hyper-parameters out of range");
    if (!(lambda >= 0)) bad("lambda must be >= 0");
    if (!(k_token >= 0) || !(v_token >= 0) || !(v_uniform >= 0)) bad("k_token, v_token and v_uniform must be >= 0");
    if (!(margin >= 0 && margin < 1)) bad("margin must be in [0, 1)");
    if (rope_shift < 0) bad("rope_shift must be >= 0");
    if (!(tau >= 0)) bad("tau must be >= 0");
    if (!(heldout_fraction > 0 && heldout_fraction < 1)) bad("heldout_fraction must be in (0, 1)");
  }
};

}  // namespace kvq::calib
