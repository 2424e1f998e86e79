# Installs kvq from BUILD_DIR into a scratch prefix, then builds and runs the consumer
# project: through find_package(kvq) with and without components, and through
# add_subdirectory (with components). Asking for a component kvq does not have must fail.
set(work ${WORK_DIR})
file(REMOVE_RECURSE ${work})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed: ${ARGN}\n${out}\n${err}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${work}/prefix)
foreach(mode find_package find_package_components add_subdirectory)
  set(extra -DCMAKE_PREFIX_PATH=${work}/prefix)
  set(programs consumer)
  if(mode STREQUAL "add_subdirectory")
    set(extra -DKVQ_SOURCE_DIR=${SOURCE_DIR} -DKVQ_ENABLE_CUDA=OFF -DKVQ_WITH_COMPONENTS=ON)
  elseif(mode STREQUAL "find_package_components")
    list(APPEND extra -DKVQ_WITH_COMPONENTS=ON)
  endif()
  if(NOT mode STREQUAL "find_package")
    list(APPEND programs consumer_calib)
  endif()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package/consumer -B ${work}/${mode} -DCMAKE_BUILD_TYPE=Release
      -DCMAKE_CXX_COMPILER=${CXX} ${extra})
  run(${CMAKE_COMMAND} --build ${work}/${mode})
  foreach(p ${programs})
    run(${work}/${mode}/${p})
  endforeach()
  message(STATUS "consumer via ${mode} (${programs}): ok")
endforeach()

# An unknown required component is an error of find_package, not a silent success.
file(WRITE ${work}/unknown/CMakeLists.txt
     "cmake_minimum_required(VERSION 3.24)\nproject(kvq_unknown LANGUAGES NONE)\n"
     "find_package(kvq CONFIG REQUIRED COMPONENTS nope)\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${work}/unknown -B ${work}/unknown/build
                        -DCMAKE_PREFIX_PATH=${work}/prefix
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "nope")
  message(FATAL_ERROR "find_package(kvq COMPONENTS nope) should fail naming the component\n${out}\n${err}")
endif()
message(STATUS "unknown component rejected: ok")
