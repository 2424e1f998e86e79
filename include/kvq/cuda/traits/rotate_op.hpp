// kvq/cuda/traits/rotate_op.hpp — the operation of a standalone row rotation
// (kvq::cuda::rotate_rows, RotateArgs::op), each bit-identical to the host function
// named. Plain C++.
#pragma once

namespace kvq::cuda {

enum class RotateOp {
  key,     // transform_key:      (k − μ_K)·R_K
  value,   // transform_value:    (v − ν_V)·R_V
  query,   // q·R_K (no centering; attention adds the τ·q·μ_K shift itself)
  output,  // untransform_output: ô·R_Vᵀ + ν_V
};

}  // namespace kvq::cuda
