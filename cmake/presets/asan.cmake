# Initial cache: the CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer.
# -O1 is the optimization level the ASan documentation recommends; -g1 keeps file:line
# in the reports. Measured on tests/calib/test_skew_exp.cpp with g++ 12 (one core):
# -O2 -g 109 s, -O2 -g1 77 s, -O1 -g1 52 s; this build dominates CI time.
set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "")
set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O1 -g1 -DNDEBUG" CACHE STRING "")
set(KVQ_ENABLE_CUDA OFF CACHE BOOL "")
set(KVQ_SANITIZE ON CACHE BOOL "")
set(KVQ_BUILD_BENCHMARKS OFF CACHE BOOL "")
set(KVQ_BUILD_EXAMPLES OFF CACHE BOOL "")
