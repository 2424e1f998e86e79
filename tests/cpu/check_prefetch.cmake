# Compiles SOURCE to assembly with FLAGS and succeeds only if a prefetch instruction
# (x86 prefetcht*/prefetchnta, Arm prfm) is in it.
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
execute_process(
  COMMAND ${COMPILER} -std=c++20 ${flags} -I${INCLUDE} -S -o - ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE asm ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} did not compile:\n${err}")
endif()
string(REGEX MATCHALL "\n[ \t]+(prefetch[a-z0-9]*|prfm)[ \t]" found "${asm}")
list(LENGTH found count)
if(count EQUAL 0)
  message(FATAL_ERROR "${SOURCE} (${FLAGS}): no prefetch instruction in the assembly")
endif()
message(STATUS "${count} prefetch instructions")
