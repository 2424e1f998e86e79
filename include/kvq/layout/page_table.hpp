// kvq/layout/page_table.hpp — CSR page table (FlashInfer's paged-KV convention).
//
//   indptr        : [batch + 1]  pages of sequence b are indices[indptr[b] .. indptr[b+1])
//   indices       : [num_indices] page numbers into the pool, each in [0, num_pages);
//                                the table uses the first indptr[batch]
//   last_page_len : [batch]      tokens in the last page, in [1, page_size]; 0 iff the
//                                sequence has no pages
//
// Sequence b holds (pages − 1)·page_size + last_page_len tokens; token t lives in page
// indices[indptr[b] + t / page_size], slot t % page_size.
//
// num_indices is the length of the engine's indices array (a tensor's numel). Given, it
// bounds indptr: validate_page_table rejects indptr[batch] > num_indices, and the CUDA
// kernels take a sequence whose pages run past it as empty (kBadPageTable), so a corrupt
// indptr is caught instead of read past. Left at −1 (unknown), indices must hold
// indptr[batch] entries, as in FlashInfer's convention.
#pragma once

#include <cstdint>
#include <string>

#include "kvq/core/config.hpp"
#include "kvq/core/status.hpp"

namespace kvq {

struct PageTableView {
  const std::int32_t* indptr = nullptr;
  const std::int32_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  int batch_size = 0;
  int page_size = 16;
  int num_indices = -1;  // length of indices; −1: unknown (see the top)

  KVQ_HOST_DEVICE int num_pages(int b) const { return indptr[b + 1] - indptr[b]; }
  // Whether every token sequence b counts lies in one of its pages, and its pages in
  // indices (0 ≤ indptr[b] ≤ indptr[b + 1], ≤ num_indices when given; last_page_len ≤
  // page_size): what a kernel must know before it walks a table in device memory. Looser
  // than validate_page_table, on purpose: an empty sequence's last_page_len (batch
  // padding) and a last page counted as empty (last_page_len ≤ 0: seq_len gives what the
  // formula says, which may be negative; the kernels take ≤ 0 as empty) read nothing
  // outside the table.
  KVQ_HOST_DEVICE bool seq_within_pages(int b) const {
    const int first = indptr[b], end = indptr[b + 1];
    return first >= 0 && end >= first && (num_indices < 0 || end <= num_indices) && last_page_len[b] <= page_size;
  }
  KVQ_HOST_DEVICE int seq_len(int b) const {
    const int n = num_pages(b);
    return n == 0 ? 0 : (n - 1) * page_size + last_page_len[b];
  }
  // Page number of token t of sequence b (t < seq_len(b)); its slot is t % page_size.
  KVQ_HOST_DEVICE int page_of(int b, int t) const { return indices[indptr[b] + t / page_size]; }
  // Calls fn(page, first_slot, count) for each page that tokens [t0, t0 + n) of
  // sequence b touch, with the run of slots they occupy there (host). A page's slots are
  // contiguous rows, so the CPU decode computes one address per run, not one per token
  // (a multiply per token and row was ~11% of the fp16 pages' decode). One division per
  // call: after the first run every run starts at slot 0 of the next page (an idiv per
  // run, four walks per 64-token block over 16-token pages, was ~4% of the quantized
  // decode on a Zen 4).
  template <class Fn>
  void for_each_page_run(int b, int t0, int n, Fn&& fn) const {
    if (n <= 0) return;
    const std::int32_t* pages = indices + indptr[b];
    int k = t0 / page_size, slot = t0 - k * page_size;
    for (int left = n; left > 0; ++k, slot = 0) {
      const int count = page_size - slot < left ? page_size - slot : left;
      fn(pages[k], slot, count);
      left -= count;
    }
  }
};

// A pool slot s = page·page_size + row, the page-table-free address of a token (vLLM's
// slot_mapping, llama.cpp's cells): s < 0 is padding (page −1), a page ≥ num_pages is
// `outside` (page −1).
struct PoolSlot {
  int page = -1;
  int row = 0;
  bool outside = false;
};
KVQ_HOST_DEVICE constexpr PoolSlot pool_slot(std::int64_t s, int page_size, int num_pages) {
  PoolSlot r;
  if (s < 0) return r;
  const std::int64_t page = s / page_size;
  if (page >= num_pages) {
    r.outside = true;
  } else {
    r.page = static_cast<int>(page);
    r.row = static_cast<int>(s - page * page_size);
  }
  return r;
}

// Checks the whole table against a pool of `num_pages` pages, and indptr against
// num_indices when given. Host memory only.
inline Status validate_page_table(const PageTableView& t, int num_pages) {
  using enum StatusCode;
  KVQ_CHECK_ARG(t.batch_size >= 0, invalid_argument, "page table: negative batch_size");
  KVQ_CHECK_ARG(t.page_size >= 1, invalid_argument, "page table: page_size must be >= 1");
  KVQ_CHECK_ARG(t.num_indices >= -1, invalid_argument, "page table: num_indices must be >= 0, or -1 (unknown)");
  KVQ_CHECK_ARG(t.batch_size == 0 || (t.indptr && t.last_page_len), invalid_argument,
                "page table: indptr and last_page_len must not be null");
  if (t.batch_size == 0) return {};
  KVQ_CHECK_ARG(t.indptr[0] == 0, invalid_argument, "page table: indptr[0] must be 0");
  for (int b = 0; b < t.batch_size; ++b) {
    const int n = t.num_pages(b);
    if (n < 0)
      return {invalid_argument, "page table: indptr must be non-decreasing (sequence " + std::to_string(b) + ")"};
    const int last = t.last_page_len[b];
    if (n == 0 ? last != 0 : (last < 1 || last > t.page_size))
      return {out_of_range, "page table: last_page_len[" + std::to_string(b) + "] = " + std::to_string(last) +
                                " must be in [1, page_size] for a non-empty sequence and 0 for an empty one"};
  }
  // indptr starts at 0 and never decreases (above), so this bounds every entry.
  if (t.num_indices >= 0 && t.indptr[t.batch_size] > t.num_indices)
    return {out_of_range, "page table: indptr[" + std::to_string(t.batch_size) + "] = " +
                              std::to_string(t.indptr[t.batch_size]) + " exceeds num_indices = " +
                              std::to_string(t.num_indices)};
  KVQ_CHECK_ARG(t.indptr[t.batch_size] == 0 || t.indices, invalid_argument, "page table: indices is null");
  for (int i = 0; i < t.indptr[t.batch_size]; ++i)
    if (t.indices[i] < 0 || t.indices[i] >= num_pages)
      return {out_of_range, "page table: indices[" + std::to_string(i) + "] = " + std::to_string(t.indices[i]) +
                                " outside the pool [0, " + std::to_string(num_pages) + ")"};
  return {};
}

}  // namespace kvq
