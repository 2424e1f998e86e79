// examples/smollm2/caches.cpp — see caches.hpp. kvq headers instantiate nothing; this
// is where the SmolLM2 integration chooses what to instantiate: every preset at the two
// head dims a Llama-family model of this size uses.
#include "caches.hpp"

#include <utility>

#include "kvq/core/dispatch.hpp"

namespace smollm2 {

std::unique_ptr<kvq::KVCache> make_kv_cache(std::string_view policy, int head_dim, const kvq::HostCacheOptions& options,
                                            kvq::LayerParams params) {
  std::unique_ptr<kvq::KVCache> cache;
  kvq::throw_if_error(kvq::dispatch_head_dim<64, 128>(
      head_dim, [&]<int D>() { cache = kvq::make_kv_cache<D>(policy, options, std::move(params)); }));
  return cache;
}

}  // namespace smollm2
