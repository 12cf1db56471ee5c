# kvkit_find_zstd(): defines the imported target kvkit::zstd when libzstd is found and sets
# KVKIT_ZSTD_FOUND. zstd is optional: a target that links kvkit::zstd gets
# KVKIT_HAS_ZSTD=1, which turns on compressed block payloads (kvkit/store/block_format.hpp).
# Debian's libzstd-dev ships no CMake package (zstd >= 1.5.6 upstream does: zstd::libzstd_shared),
# so fall back to find_path/find_library (hint: ZSTD_ROOT or CMAKE_PREFIX_PATH).
macro(kvkit_find_zstd)
  if(NOT TARGET kvkit::zstd)
    find_package(zstd CONFIG QUIET)
    if(TARGET zstd::libzstd_shared OR TARGET zstd::libzstd_static)
      add_library(kvkit::zstd INTERFACE IMPORTED)
      if(TARGET zstd::libzstd_shared)
        set_target_properties(kvkit::zstd PROPERTIES INTERFACE_LINK_LIBRARIES zstd::libzstd_shared)
      else()
        set_target_properties(kvkit::zstd PROPERTIES INTERFACE_LINK_LIBRARIES zstd::libzstd_static)
      endif()
    else()
      find_path(KVKIT_ZSTD_INCLUDE_DIR zstd.h HINTS ${ZSTD_ROOT}/include)
      find_library(KVKIT_ZSTD_LIBRARY zstd HINTS ${ZSTD_ROOT}/lib)
      mark_as_advanced(KVKIT_ZSTD_INCLUDE_DIR KVKIT_ZSTD_LIBRARY)
      if(KVKIT_ZSTD_INCLUDE_DIR AND KVKIT_ZSTD_LIBRARY)
        add_library(kvkit::zstd UNKNOWN IMPORTED)
        set_target_properties(kvkit::zstd PROPERTIES
          IMPORTED_LOCATION "${KVKIT_ZSTD_LIBRARY}"
          INTERFACE_INCLUDE_DIRECTORIES "${KVKIT_ZSTD_INCLUDE_DIR}")
      endif()
    endif()
    if(TARGET kvkit::zstd)
      set_property(TARGET kvkit::zstd APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS KVKIT_HAS_ZSTD=1)
    endif()
  endif()
  if(TARGET kvkit::zstd)
    set(KVKIT_ZSTD_FOUND TRUE)
  else()
    set(KVKIT_ZSTD_FOUND FALSE)
  endif()
endmacro()
