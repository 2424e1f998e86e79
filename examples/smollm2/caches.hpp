// examples/smollm2/caches.hpp — the one entry point that turns a policy name into a
// kvq host cache. Every preset's HostKVCache<P> (append, decode attention, split) is
// instantiated by caches.cpp alone, once per executable, instead of in every
// translation unit that builds a model's caches.
#pragma once

#include <memory>
#include <string_view>

#include "kvq/cache/host_cache.hpp"

namespace smollm2 {

// A cache for "fp32", any kvq preset name (kvq::presets::all) or one of the spelled
// variants listed in caches.cpp, at head_dim 64 or 128.
// Throws kvq::Error for an unknown name or head_dim, or parameters the policy rejects.
std::unique_ptr<kvq::KVCache> make_kv_cache(std::string_view policy, int head_dim, const kvq::HostCacheOptions& options,
                                            kvq::LayerParams params = {});

}  // namespace smollm2
