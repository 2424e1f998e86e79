// kvq/cuda/traits/device_error.hpp — the bits the kernels OR into the optional
// `error_flags` device word when they skip an out-of-range item (the argument structs
// of kvq/cuda/launch/api.hpp carry the pointer). Plain C++.
#pragma once

namespace kvq::cuda {

enum DeviceError : unsigned {
  kBadBatchIndex = 1u,  // batch index outside [0, batch_size)
  kBadPosition = 2u,    // position outside the sequence the page table describes
  kBadPage = 4u,        // page index outside [0, num_pages)
};

}  // namespace kvq::cuda
