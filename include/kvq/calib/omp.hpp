// kvq/calib/omp.hpp — KVQ_CALIB_OMP(...): an OpenMP pragma when the consumer compiles
// with -fopenmp, nothing otherwise (no unknown-pragma noise).
//   KVQ_CALIB_OMP(parallel for schedule(dynamic, 1))  →  #pragma omp parallel for ...
#pragma once

#if defined(_OPENMP)
#define KVQ_CALIB_STR_(...) #__VA_ARGS__
#define KVQ_CALIB_OMP(...) _Pragma(KVQ_CALIB_STR_(omp __VA_ARGS__))
#else
#define KVQ_CALIB_OMP(...)
#endif
