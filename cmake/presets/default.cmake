# Initial cache for `cmake -C cmake/presets/default.cmake`: Release; CUDA when nvcc is
# found. (Presets live here rather than in a top-level CMakePresets.json
# to keep the repository's top level fixed.)
set(CMAKE_BUILD_TYPE Release CACHE STRING "")
# kvq's tests compile at -O2 and their CUDA code for sm_90 only (the H200 the device checks
# run on; examples/cuda still builds for sm_80 and sm_90, and benchmarks/ stays at -O3):
# this build dominates CI time. g++ 12 on tests/cpu/test_value_int8.cpp, one core each,
# both at once: -O3 50.5 s, -O2 33.5 s. Device code is compiled once per architecture.
set(CMAKE_CXX_FLAGS_RELEASE "-O2 -DNDEBUG" CACHE STRING "")
set(CMAKE_CUDA_FLAGS_RELEASE "-O2 -DNDEBUG" CACHE STRING "")
set(KVQ_TEST_CUDA_ARCHITECTURES 90 CACHE STRING "")
