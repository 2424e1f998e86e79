# Runs check_layering.cmake on fixture/, which breaks every rule once (and uses its one
# exception), and fails unless the check fails and reports each violation and nothing
# allowed (cmake -P, run by ctest).
cmake_minimum_required(VERSION 3.24)
get_filename_component(here "${CMAKE_CURRENT_LIST_FILE}" DIRECTORY)
execute_process(COMMAND ${CMAKE_COMMAND} -DINCLUDE_DIR=${here}/fixture -P ${here}/check_layering.cmake
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "check_layering.cmake passed on the fixture:\n${out}${err}")
endif()
foreach(expected
    "kvq/core/bad.hpp: includes kvq/layout/paged.hpp"
    "kvq/cuda/kernel/bad.cuh: includes kvq/cuda/launch/plan.hpp"
    "kvq/cuda/launch/bad.hpp: includes kvq/attention/dense.hpp"
    "kvq/calib/bad.hpp: includes kvq/cache/host_cache.hpp"
    "kvq/cpu/bad.hpp: includes kvq/attention/decode.hpp"
    "kvq/cuda/traits/bad.hpp: includes kvq/layout/paged.hpp"
    "kvq/cuda/warp/bad.cuh: includes kvq/cpu/tile.hpp"
    "kvq/io/gguf.hpp: a GGUF file")
  string(FIND "${err}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check_layering.cmake did not report '${expected}':\n${err}")
  endif()
endforeach()
# The allowed exception (kvq/cpu/ may include attention/softmax.hpp) is not reported.
string(FIND "${err}" "kvq/cpu/ok.hpp" at)
if(NOT at EQUAL -1)
  message(FATAL_ERROR "check_layering.cmake reported the allowed kvq/cpu/ok.hpp:\n${err}")
endif()
message(STATUS "check_layering.cmake reports every fixture violation")
