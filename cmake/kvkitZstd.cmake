# kvkit_find_zstd(): defines the imported target kvkit::libzstd when libzstd is found and
# sets KVKIT_ZSTD_FOUND. Used by the build tree (cmake/kvkitTargets.cmake) and by the
# installed kvkitConfig.cmake for the `zstd` component, so both locate libzstd the same way
# on the machine that uses them. The component target kvkit::zstd (kvkit + libzstd +
# KVKIT_HAS_ZSTD=1) turns on compressed block payloads (kvkit/store/block_format.hpp).
# Debian's libzstd-dev may ship no CMake package (zstd >= 1.5.6 upstream does:
# zstd::libzstd_shared), so fall back to find_path/find_library (hint: ZSTD_ROOT or
# CMAKE_PREFIX_PATH).
macro(kvkit_find_zstd)
  if(NOT TARGET kvkit::libzstd)
    find_package(zstd CONFIG QUIET)
    if(TARGET zstd::libzstd_shared OR TARGET zstd::libzstd_static)
      add_library(kvkit::libzstd INTERFACE IMPORTED)
      if(TARGET zstd::libzstd_shared)
        set_target_properties(kvkit::libzstd PROPERTIES INTERFACE_LINK_LIBRARIES zstd::libzstd_shared)
      else()
        set_target_properties(kvkit::libzstd PROPERTIES INTERFACE_LINK_LIBRARIES zstd::libzstd_static)
      endif()
    else()
      find_path(KVKIT_ZSTD_INCLUDE_DIR zstd.h HINTS ${ZSTD_ROOT}/include)
      find_library(KVKIT_ZSTD_LIBRARY zstd HINTS ${ZSTD_ROOT}/lib)
      mark_as_advanced(KVKIT_ZSTD_INCLUDE_DIR KVKIT_ZSTD_LIBRARY)
      if(KVKIT_ZSTD_INCLUDE_DIR AND KVKIT_ZSTD_LIBRARY)
        add_library(kvkit::libzstd UNKNOWN IMPORTED)
        set_target_properties(kvkit::libzstd PROPERTIES
          IMPORTED_LOCATION "${KVKIT_ZSTD_LIBRARY}"
          INTERFACE_INCLUDE_DIRECTORIES "${KVKIT_ZSTD_INCLUDE_DIR}")
      endif()
    endif()
  endif()
  if(TARGET kvkit::libzstd)
    set(KVKIT_ZSTD_FOUND TRUE)
  else()
    set(KVKIT_ZSTD_FOUND FALSE)
  endif()
endmacro()
