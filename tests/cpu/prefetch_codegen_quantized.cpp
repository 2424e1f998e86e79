// Codegen check (check_prefetch.cmake): the quantized decode in its fastest mode must
// keep its prefetches (see prefetch_codegen_dense.cpp).
#include "kvq/kvq.hpp"

kvq::Status kvq_codegen_quantized(const kvq::ConstPagedCacheView<kvq::presets::K4V2>& cache,
                                  const kvq::PageTableView& table, const kvq::DecodeParams<float, float>& p,
                                  const kvq::RotationParams& r) {
  return kvq::decode_attention<kvq::presets::K4V2>(
      cache, table, p, r, {kvq::KeyScoring::int8_query, kvq::ValueAccumulation::int8_weights});
}
