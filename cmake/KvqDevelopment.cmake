# Settings for kvq's own tests, examples and benchmarks. Nothing here reaches
# consumers of kvq::kvq.
option(KVQ_SANITIZE "Build in-tree targets with ASan+UBSan" OFF)

add_library(kvq_dev_flags INTERFACE)
target_compile_options(kvq_dev_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>)
if(KVQ_SANITIZE)
  target_compile_options(kvq_dev_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer>)
  target_link_options(kvq_dev_flags INTERFACE -fsanitize=address,undefined)
endif()

find_package(Threads REQUIRED)

# kvq_add_test(<name> SOURCES <src>... [LIBS <lib>...] [PREFIX <ctest name prefix>])
# One GoogleTest executable, registered with CTest test by test.
function(kvq_add_test name)
  cmake_parse_arguments(ARG "" "PREFIX" "SOURCES;LIBS" ${ARGN})
  find_package(GTest REQUIRED)
  include(GoogleTest)
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE kvq::kvq kvq_dev_flags GTest::gtest_main Threads::Threads ${ARG_LIBS})
  target_compile_definitions(${name} PRIVATE KVQ_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data")
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120 TEST_PREFIX "${ARG_PREFIX}" PROPERTIES LABELS "${ARG_LABELS}")
endfunction()

# kvq_add_core_test(<name> <src>...): a test that uses tests/common (nlohmann-json).
function(kvq_add_core_test name)
  find_package(nlohmann_json 3 REQUIRED)
  kvq_add_test(${name} SOURCES ${ARGN} LIBS nlohmann_json::nlohmann_json)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
endfunction()

# kvq_add_isa_twin(<name> <prefix> <flag> SOURCES <src>...): the same test sources once
# more, compiled with a target flag (-march=native: AVX-512 VNNI and F16C on CI's
# machines; -march=haswell: AVX2 without AVX-512), so the portable and the SIMD paths of
# the CPU code are all tested. Skipped when the compiler lacks the flag; CTest names get
# the prefix "<prefix>.". An ISA the machine lacks fails loudly (SIGILL), never silently.
include(CheckCXXCompilerFlag)
function(kvq_add_isa_twin name prefix flag)
  cmake_parse_arguments(ARG "" "" "SOURCES" ${ARGN})
  string(MAKE_C_IDENTIFIER "KVQ_HAS_FLAG_${flag}" has_flag)
  check_cxx_compiler_flag(${flag} ${has_flag})
  if(NOT ${has_flag})
    return()
  endif()
  find_package(nlohmann_json 3 REQUIRED)
  kvq_add_test(${name} SOURCES ${ARG_SOURCES} LIBS nlohmann_json::nlohmann_json PREFIX "${prefix}.")
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_options(${name} PRIVATE ${flag})
endfunction()
