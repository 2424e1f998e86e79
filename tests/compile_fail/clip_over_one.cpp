// EXPECT: clip_permille must be in \[1, 1000\]
#include "kvq/kvq.hpp"
constexpr kvq::Policy P = kvq::presets::K2V2.with_clip(1200, 920);
kvq::PageLayout<P> layout;
