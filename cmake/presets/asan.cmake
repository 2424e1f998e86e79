# Initial cache: the CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer.
set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "")
set(KVQ_ENABLE_CUDA OFF CACHE BOOL "")
set(KVQ_SANITIZE ON CACHE BOOL "")
set(KVQ_BUILD_BENCHMARKS OFF CACHE BOOL "")
set(KVQ_BUILD_EXAMPLES OFF CACHE BOOL "")
