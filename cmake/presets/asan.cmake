# Initial cache: the CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer.
# -O0, because compiling dominates this build's CI time and the unit tests run in well
# under a second each anyway: tests/cpu/test_value_int8.cpp with g++ 12 under the same
# load took 167 s at -O1 -g1 and 58.5 s at -O0 -g1 (83 s at -O1 with ASan alone). The
# directories whose tests run long (forward passes, calibration, the CUDA kernels' host
# emulator) compile at -O1, the level the ASan documentation recommends
# (kvq_optimize_under_sanitizers()). No nvcc here: tests/cuda builds only its plain C++
# tests (the emulator and the launch arithmetic). -g1 keeps file:line
# in the reports.
set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "")
set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O0 -g1 -DNDEBUG" CACHE STRING "")
set(KVQ_ENABLE_CUDA OFF CACHE BOOL "")
set(KVQ_SANITIZE ON CACHE BOOL "")
set(KVQ_BUILD_BENCHMARKS OFF CACHE BOOL "")
set(KVQ_BUILD_EXAMPLES OFF CACHE BOOL "")
