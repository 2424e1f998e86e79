# Initial cache: Release, no CUDA.
set(CMAKE_BUILD_TYPE Release CACHE STRING "")
set(KVQ_ENABLE_CUDA OFF CACHE BOOL "")
