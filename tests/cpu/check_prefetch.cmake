# Compiles SOURCE to assembly with FLAGS and succeeds only if a prefetch instruction
# (x86 prefetcht*/prefetchnta, Arm prfm) is in it, and, when EXPECT is given, only if
# every one of them is EXPECT (the level KVQ_CPU_PREFETCH_LOCALITY asks for).
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
if(DEFINED EXPECT)
  foreach(instruction IN LISTS found)
    string(STRIP "${instruction}" instruction)
    if(NOT instruction STREQUAL EXPECT)
      message(FATAL_ERROR "${SOURCE} (${FLAGS}): ${instruction} where every prefetch should be ${EXPECT}")
    endif()
  endforeach()
endif()
message(STATUS "${count} prefetch instructions")
