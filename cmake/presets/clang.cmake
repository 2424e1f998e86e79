# Initial cache: the CPU and attention tests built with clang (Release, no CUDA). CI builds
# the library with GCC otherwise; clang takes other paths in a few places (the vpdpbusd
# wrapper in kvq/cpu/code_fields.hpp) and rejects code GCC accepts.
set(CMAKE_CXX_COMPILER clang++ CACHE STRING "")
set(CMAKE_BUILD_TYPE Release CACHE STRING "")
set(KVQ_ENABLE_CUDA OFF CACHE BOOL "")
set(KVQ_BUILD_BENCHMARKS OFF CACHE BOOL "")
set(KVQ_BUILD_EXAMPLES OFF CACHE BOOL "")
