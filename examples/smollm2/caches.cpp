// examples/smollm2/caches.cpp — see caches.hpp. kvq headers instantiate nothing; this
// is where the SmolLM2 integration chooses what to instantiate: every preset, and the
// spelled variants below, at the two head dims a Llama-family model of this size uses.
#include "caches.hpp"

#include <array>
#include <utility>

#include "kvq/core/dispatch.hpp"

namespace smollm2 {
namespace {

// Variants measured in examples/smollm2/README.md ("Value clipping and retrieval", "It is
// the value clipping alone", "K4V2_R: values clipped alone"); spelled as kvq::parse_policy
// reads them.
constexpr kvq::presets::NamedPolicy kVariants[] = {
    {"K2V2_R:vclip=1000", kvq::presets::K2V2_R.with_clip(960, 1000)},
    {"K4V2_HC:kclip=960:vclip=920", kvq::presets::K4V2_HC.with_clip(960, 920)},
    {"K4V2_HC:vclip=1000", kvq::presets::K4V2_HC.with_clip(1000, 1000)},  // K4V2_HC until 2026-12-05
    {"K2V2_HC:vclip=920", kvq::presets::K2V2_HC.with_clip(1000, 920)},
    {"K4V2_R:kclip=960", kvq::presets::K4V2_R.with_clip(960, 920)},  // K4V2_R until 2026-12-04
};

constexpr auto kInstantiated = [] {
  std::array<kvq::presets::NamedPolicy, std::size(kvq::presets::all) + std::size(kVariants)> out{};
  std::size_t n = 0;
  for (const auto& p : kvq::presets::all) out[n++] = p;
  for (const auto& p : kVariants) out[n++] = p;
  return out;
}();

}  // namespace

std::unique_ptr<kvq::KVCache> make_kv_cache(std::string_view policy, int head_dim, const kvq::HostCacheOptions& options,
                                            kvq::LayerParams params) {
  std::unique_ptr<kvq::KVCache> cache;
  kvq::throw_if_error(kvq::dispatch_head_dim<64, 128>(head_dim, [&]<int D>() {
    cache = kvq::make_kv_cache<D, kInstantiated>(policy, options, std::move(params));
  }));
  return cache;
}

}  // namespace smollm2
