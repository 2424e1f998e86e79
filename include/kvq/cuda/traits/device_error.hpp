// kvq/cuda/traits/device_error.hpp — the bits the kernels OR into the optional
// `error_flags` device word when they skip an out-of-range item (the argument structs
// of kvq/cuda/launch/api.hpp carry the pointer). Plain C++.
#pragma once

namespace kvq::cuda {

enum DeviceError : unsigned {
  kBadBatchIndex = 1u,  // batch index outside [0, batch_size)
  kBadPosition = 2u,    // position outside the sequence the page table describes
  kBadPage = 4u,        // page index outside [0, num_pages)
  kBadPageTable = 8u,   // a sequence's indptr run is negative, decreases or ends past
                        // num_indices (when given), or its last_page_len exceeds the page
                        // size (its tokens would run past its pages): it is taken as empty
                        // (PageTableView::seq_within_pages)
  kBadQueryRows = 16u,  // decode: a sequence's q_indptr run leaves [0, total_q] (its rows
                        // are skipped), or has more rows than max_q_per_seq lets the
                        // grid cover (the rows past them are not computed). Such rows are
                        // left unwritten by both kernels and both split merges
};

}  // namespace kvq::cuda
