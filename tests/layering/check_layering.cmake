# Checks that kvq's headers depend on each other one way only (cmake -P, run by ctest):
#   cmake -DINCLUDE_DIR=<dir holding kvq/> -P check_layering.cmake
# Every #include "kvq/..." (or <kvq/...>) of every file under INCLUDE_DIR/kvq is tested
# against the rules below; the script fails listing each violation as file:line.
#
#   from                 must not include          why
#   kvq/core/            anything outside core/    the core depends on nothing else in kvq
#   kvq/cuda/kernel/     kvq/cuda/launch/          launchers use kernels, not the reverse;
#                                                  shared numbers live in kvq/cuda/traits/
#   kvq/cuda/traits/     anything but core/ and    plain C++ shared by kernels and launchers
#                        cuda/traits/
#   kvq/cuda/launch/     kvq/attention/            engines include launch/api.hpp anywhere;
#                                                  it must not pull in the CPU attention
#   kvq/calib/           kvq/cache/                calibration does not need the host cache
#   kvq/cpu/             kvq/attention/ except      the CPU pieces sit below the attention API
#                        softmax.hpp, and cache/    that uses them
#   kvq/cuda/            kvq/cpu/                   device code never sees host SIMD
# and no GGUF reader is part of the library: no file under kvq/ is named *gguf* and none
# includes one (GGUF is the SmolLM2 example's model format, examples/smollm2/).
cmake_minimum_required(VERSION 3.24)
if(NOT INCLUDE_DIR)
  message(FATAL_ERROR "usage: cmake -DINCLUDE_DIR=<include dir> -P check_layering.cmake")
endif()
get_filename_component(INCLUDE_DIR "${INCLUDE_DIR}" ABSOLUTE)
if(NOT IS_DIRECTORY "${INCLUDE_DIR}/kvq")
  message(FATAL_ERROR "check_layering: ${INCLUDE_DIR}/kvq is not a directory")
endif()

# rule: <from-prefix>@<forbidden include regex>@<allowed include regex or empty>
set(rules
  "kvq/core/@^kvq/@^kvq/core/"
  "kvq/cuda/kernel/@^kvq/cuda/launch/@"
  "kvq/cuda/traits/@^kvq/@^kvq/(core|cuda/traits)/"
  "kvq/cuda/launch/@^kvq/attention/@"
  "kvq/calib/@^kvq/cache/@"
  "kvq/cpu/@^kvq/(attention|cache)/@^kvq/attention/softmax.hpp$"
  "kvq/cuda/@^kvq/cpu/@")

file(GLOB_RECURSE files RELATIVE ${INCLUDE_DIR} ${INCLUDE_DIR}/kvq/*)
set(violations "")
foreach(f IN LISTS files)
  string(TOLOWER "${f}" lower)
  if(lower MATCHES "gguf")
    string(APPEND violations "  ${f}: a GGUF file under include/ (it belongs to examples/smollm2/)\n")
  endif()
  file(STRINGS ${INCLUDE_DIR}/${f} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]kvq/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"].*$" "\\1" inc "${line}")
    string(TOLOWER "${inc}" inc_lower)
    if(inc_lower MATCHES "gguf")
      string(APPEND violations "  ${f}: includes ${inc} (GGUF is not part of the library)\n")
    endif()
    foreach(rule IN LISTS rules)
      string(REPLACE "@" ";" parts "${rule}@")
      list(GET parts 0 from)
      list(GET parts 1 forbidden)
      list(GET parts 2 allowed)
      string(FIND "${f}" "${from}" at)
      if(NOT at EQUAL 0 OR NOT inc MATCHES "${forbidden}")
        continue()
      endif()
      if(allowed AND inc MATCHES "${allowed}")
        continue()
      endif()
      string(APPEND violations "  ${f}: includes ${inc} (files under ${from} must not include ${forbidden}")
      if(allowed)
        string(APPEND violations " other than ${allowed}")
      endif()
      string(APPEND violations ")\n")
    endforeach()
  endforeach()
endforeach()
if(violations)
  message(FATAL_ERROR "kvq layering violated:\n${violations}")
endif()
list(LENGTH files n)
message(STATUS "kvq layering: ${n} files under ${INCLUDE_DIR}/kvq, no violation")
