// EXPECT: value group must be a power of two
#include "kvq/kvq.hpp"
constexpr kvq::Policy P{kvq::QuantSpec{4, 32}, kvq::QuantSpec{2, 48}, 128};
kvq::PageLayout<P> layout;
