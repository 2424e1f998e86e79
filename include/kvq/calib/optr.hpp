// kvq/calib/optr.hpp — OptR: output-aware per-head rotations (DESIGN §6.3).
//
// For each (layer, KV head) the rotation R = R0·exp(A − Aᵀ) is learned through the
// whole quantize → attention → W_O path, first for keys (values exact), then for
// values (keys quantized with the chosen R_K). Only the tokens that deployment
// quantizes are quantized here: per sequence, the first `prefix` tokens and the `recent`
// latest tokens of the cache each query sees (appended `qblock` at a time) stay exact, and
// the loss is measured on `qwin` query positions `qstride` apart, the last at the
// sequence's end, under a causal mask. Rounding uses the straight-through estimator of DESIGN §6.3
// (clip threshold frozen, gradient to the group's extremes through the scale, rounding
// residual δ held; optr/rotated_quant.hpp); gradients are hand-written and equal the
// exact gradient of its frozen surrogate (tests/calib checks that against finite
// differences).
//
// Shapes: keys/values of one head [L, d]; W_O slice of query head j [D, d];
// M_j = W_jᵀ·W_j [d, d] turns squared post-W_O norms into d×d quadratic forms,
// ‖a·W_jᵀ‖² = a·M_j·aᵀ, so the D dimension never enters the inner loops.
#pragma once

// The pieces, one concept per header:
#include "kvq/calib/optr/config.hpp"         // OptRConfig, BaseKind, Parameterization
#include "kvq/calib/optr/windows.hpp"        // exact/quantized rows of each sequence
#include "kvq/calib/optr/rotated_quant.hpp"  // Q(X·R)·Rᵀ and its straight-through estimator
#include "kvq/calib/optr/k_phase.hpp"        // K-phase loss and gradient
#include "kvq/calib/optr/v_phase.hpp"        // V-phase loss and gradient
#include "kvq/calib/optr/adam.hpp"           // optimize_rotation: Adam + held-out selection
#include "kvq/calib/optr/driver.hpp"         // calibrate_head, calibrate (OpenMP)
