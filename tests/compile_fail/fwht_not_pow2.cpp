// EXPECT: FWHT needs a power-of-two length
#include "kvq/kvq.hpp"
void f(float* x) { kvq::hadamard_forward<96>(x); }
template void kvq::fwht_butterflies<96>(float*);
