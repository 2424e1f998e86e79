// EXPECT: sign_seed is only meaningful with Rotation::hadamard
#include "kvq/kvq.hpp"
constexpr kvq::Policy P{kvq::QuantSpec{4, 32, kvq::Rotation::dense, false, 1000, kvq::MetaType::fp16, 7}, kvq::QuantSpec{2, 128}, 128};
kvq::PageLayout<P> layout;
