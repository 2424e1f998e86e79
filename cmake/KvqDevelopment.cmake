# Settings for kvq's own tests, examples and benchmarks. Nothing here reaches
# consumers of kvq::kvq.
option(KVQ_SANITIZE "Build in-tree targets with ASan+UBSan" OFF)

add_library(kvq_dev_flags INTERFACE)
target_compile_options(kvq_dev_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>)
if(KVQ_SANITIZE)
  # -Wno-stringop-overflow: GCC 12 at -O0 under the sanitizers flags a vector store in a loop
  # that never runs (exp_block with n < W, tests/cpu/test_tile.cpp); ASan checks the real
  # writes at run time.
  target_compile_options(kvq_dev_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
                              -Wno-stringop-overflow>)
  target_link_options(kvq_dev_flags INTERFACE -fsanitize=address,undefined)
endif()

find_package(Threads REQUIRED)

# kvq_optimize_under_sanitizers(): the sanitizer build compiles at -O0
# (cmake/presets/asan.cmake); the calling directory's targets, whose tests run long, at -O1.
macro(kvq_optimize_under_sanitizers)
  if(KVQ_SANITIZE)
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-O1>)
  endif()
endmacro()

# kvq_add_test(<name> SOURCES <src>... [LIBS <lib>...] [PREFIX <ctest name prefix>] [UNITY])
# One GoogleTest executable, registered with CTest test by test. UNITY compiles its sources
# as one translation unit: for Eigen-heavy tests whose files share most instantiations
# (the calibration's eigensolvers and GEMMs), which then compile once instead of per file.
function(kvq_add_test name)
  cmake_parse_arguments(ARG "UNITY" "PREFIX" "SOURCES;LIBS" ${ARGN})
  find_package(GTest REQUIRED)
  include(GoogleTest)
  add_executable(${name} ${ARG_SOURCES})
  if(ARG_UNITY)
    set_target_properties(${name} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
  endif()
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

# kvq_add_isa_twin(<name> <prefix> <flag> [NOT_SANITIZED] SOURCES <src>... [LIBS <lib>...]): the same test
# sources once more, compiled with a target flag (-march=native: AVX-512 VNNI and F16C on
# CI's machines; -march=haswell: AVX2 without AVX-512), so the portable and the SIMD paths
# of the CPU code are all tested. Skipped when the compiler lacks the flag; CTest names get
# the prefix "<prefix>.". An ISA the machine lacks fails loudly (SIGILL), never silently.
# NOT_SANITIZED twins are left out of the sanitizer build, which keeps CI's time bounded:
# it still runs each SIMD kernel's own tests (tests/cpu) under ASan+UBSan in every ISA.
include(CheckCXXCompilerFlag)
function(kvq_add_isa_twin name prefix flag)
  cmake_parse_arguments(ARG "NOT_SANITIZED" "" "SOURCES;LIBS" ${ARGN})
  if(ARG_NOT_SANITIZED AND KVQ_SANITIZE)
    return()
  endif()
  string(MAKE_C_IDENTIFIER "KVQ_HAS_FLAG_${flag}" has_flag)
  check_cxx_compiler_flag(${flag} ${has_flag})
  if(NOT ${has_flag})
    return()
  endif()
  find_package(nlohmann_json 3 REQUIRED)
  kvq_add_test(${name} SOURCES ${ARG_SOURCES} LIBS nlohmann_json::nlohmann_json ${ARG_LIBS} PREFIX "${prefix}.")
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_options(${name} PRIVATE ${flag})
endfunction()

# kvq_add_fuzzer(<reader> SOURCE <cpp> [INCLUDES <dir>...] [DEPENDS <file>...]): the
# libFuzzer target kvq_fuzz_<reader> (not part of `all`), built into
# ${PROJECT_BINARY_DIR}/fuzz/. It needs clang; when the project compiler is not clang, a
# clang++ on PATH is driven directly, with kvq's and nlohmann-json's include dirs.
# Without clang the target does not exist.
function(kvq_add_fuzzer reader)
  cmake_parse_arguments(ARG "" "SOURCE" "INCLUDES;DEPENDS" ${ARGN})
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(fuzz_cxx ${CMAKE_CXX_COMPILER})
  else()
    find_program(KVQ_FUZZ_CXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14)
    set(fuzz_cxx ${KVQ_FUZZ_CXX})
  endif()
  if(NOT fuzz_cxx)
    return()
  endif()
  find_package(nlohmann_json 3.2 REQUIRED)
  get_target_property(json_inc nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
  set(flags -I${PROJECT_SOURCE_DIR}/include)
  foreach(dir IN LISTS ARG_INCLUDES)
    list(APPEND flags -I${dir})
  endforeach()
  foreach(dir IN LISTS json_inc)
    if(NOT dir STREQUAL "/usr/include")  # -isystem /usr/include breaks libstdc++'s include_next
      list(APPEND flags -isystem ${dir})
    endif()
  endforeach()
  get_filename_component(src ${ARG_SOURCE} ABSOLUTE)
  set(bin ${PROJECT_BINARY_DIR}/fuzz/kvq_fuzz_${reader})
  add_custom_command(OUTPUT ${bin}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/fuzz
    COMMAND ${fuzz_cxx} -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
            ${flags} ${src} -o ${bin}
    DEPENDS ${src} ${ARG_DEPENDS} ${PROJECT_SOURCE_DIR}/include/kvq/io/file.hpp
            ${PROJECT_SOURCE_DIR}/include/kvq/core/numeric.hpp ${PROJECT_SOURCE_DIR}/include/kvq/core/status.hpp
    COMMENT "Building libFuzzer target kvq_fuzz_${reader} with ${fuzz_cxx}"
    VERBATIM)
  add_custom_target(kvq_fuzz_${reader} DEPENDS ${bin})
endfunction()
