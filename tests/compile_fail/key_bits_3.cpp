// EXPECT: key bits must be 2, 4 or 8
#include "kvq/kvq.hpp"
constexpr kvq::Policy P{kvq::QuantSpec{3, 32}, kvq::QuantSpec{2, 128}, 128};
static_assert(kvq::check_policy<P>());
