// EXPECT: head_dim must be 64, 128 or 256
#include "kvq/kvq.hpp"
kvq::PageLayout<kvq::presets::K4V2.with_head_dim(96)> layout;
