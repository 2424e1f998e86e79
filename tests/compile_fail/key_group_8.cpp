// EXPECT: key group must be a power of two in \[16, head_dim\]
#include "kvq/kvq.hpp"
constexpr kvq::Policy P{kvq::QuantSpec{4, 8}, kvq::QuantSpec{2, 128}, 128};
kvq::PageLayout<P> layout;
