# Compiles SOURCE and succeeds only if compilation fails with output matching EXPECT.
execute_process(
  COMMAND ${COMPILER} -std=c++20 -fsyntax-only -I${INCLUDE} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must be rejected")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "${SOURCE} failed without the expected diagnostic '${EXPECT}':\n${err}")
endif()
message(STATUS "rejected as expected: ${EXPECT}")
