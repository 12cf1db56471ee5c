# cmake -DBUILD_DIR=<kvkit build> -DSOURCE_DIR=<kvkit checkout> -DPREFIX=<stage>
#       [-DHIREDIS_LIBRARY=<path>] -P stage_install.cmake
# Installs kvkit's development component into a fresh staging prefix and checks what it
# put there: headers only under include/, a complete CMake package, and no path from the
# build machine (source tree, build tree, hiredis or CUDA location) baked into it.
file(REMOVE_RECURSE "${PREFIX}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}"
          --component kvkit_development
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()

set(pkg "${PREFIX}/share/cmake/kvkit")
foreach(f kvkit/kvkit.hpp kvkit/version.hpp kvkit/core/paged_kv_view.hpp)
  if(NOT EXISTS "${PREFIX}/include/${f}")
    message(FATAL_ERROR "install is missing include/${f}")
  endif()
endforeach()
foreach(f kvkitConfig.cmake kvkitConfigVersion.cmake kvkitTargets.cmake kvkitHiredis.cmake
          kvkitZstd.cmake)
  if(NOT EXISTS "${pkg}/${f}")
    message(FATAL_ERROR "install is missing share/cmake/kvkit/${f}")
  endif()
endforeach()

file(GLOB_RECURSE installed RELATIVE "${PREFIX}" "${PREFIX}/*")
foreach(f IN LISTS installed)
  if(f MATCHES "^include/" AND NOT f MATCHES "\\.(hpp|cuh|h)$")
    message(FATAL_ERROR "non-header file installed under include/: ${f}")
  endif()
  if(NOT f MATCHES "^(include/kvkit/|share/cmake/kvkit/|share/doc/kvkit/)")
    message(FATAL_ERROR "unexpected installed file: ${f}")
  endif()
endforeach()

set(forbidden "${SOURCE_DIR}" "${BUILD_DIR}" "/usr/local/cuda")
if(HIREDIS_LIBRARY)
  list(APPEND forbidden "${HIREDIS_LIBRARY}")
endif()
file(GLOB pkg_files "${pkg}/*.cmake")
foreach(f IN LISTS pkg_files)
  file(READ "${f}" text)
  foreach(p IN LISTS forbidden)
    string(FIND "${text}" "${p}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${f} contains the build machine path ${p}")
    endif()
  endforeach()
endforeach()
list(LENGTH installed n)
message(STATUS "staged ${n} files in ${PREFIX}")
