// Codegen check (check_prefetch.cmake): the fp16-pages decode must keep its prefetches.
// GCC's IPA pure-const pass once deleted every __builtin_prefetch of the decode
// sources' page walks (kvq/cpu/tile.hpp, prefetch_bytes), silently: no output changes.
#include "kvq/kvq.hpp"

kvq::Status kvq_codegen_dense(const std::byte* pool, int pages, const kvq::DensePageLayout<kvq::half_t, 128>& layout,
                              const kvq::PageTableView& table, const kvq::DecodeParams<float, float>& p) {
  return kvq::dense_paged_attention<128>(pool, pages, layout, table, p);
}
