// kvq/kvq.cuh — umbrella header for the CUDA side (needs nvcc). Includes the host
// umbrella, the kernels and the launcher definitions. Engines that only call
// instantiated launchers include kvq/cuda/launch/api.hpp instead.
#pragma once

#include "kvq/kvq.hpp"
#include "kvq/cuda/config.cuh"
#include "kvq/cuda/instantiate.cuh"
#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/kernel/decode_mma.cuh"
#include "kvq/cuda/kernel/rows.cuh"
#include "kvq/cuda/launch/api.hpp"
#include "kvq/cuda/launch/dispatch.hpp"
#include "kvq/cuda/launch/launch.cuh"
#include "kvq/cuda/launch/plan.hpp"
#include "kvq/cuda/traits/decode_smem.hpp"
#include "kvq/cuda/traits/device_error.hpp"
#include "kvq/cuda/traits/geometry.hpp"
#include "kvq/cuda/traits/rotate_op.hpp"
#include "kvq/cuda/traits/tensor_core.hpp"
#include "kvq/cuda/warp/copy.cuh"
#include "kvq/cuda/warp/mma.cuh"
#include "kvq/cuda/warp/reduce.cuh"
#include "kvq/cuda/warp/rotate.cuh"
