# kvkit_find_hiredis(): defines the imported target kvkit::hiredis when hiredis is found
# and sets KVKIT_HIREDIS_FOUND. Used by the build tree and by the installed
# kvkitConfig.cmake, so both locate hiredis the same way on the machine that uses them.
# hiredis >= 1.0 ships a CMake package (hiredis::hiredis); Debian 12's 0.14 does not, so
# fall back to find_path/find_library (hint: HIREDIS_ROOT or CMAKE_PREFIX_PATH).
macro(kvkit_find_hiredis)
  if(NOT TARGET kvkit::hiredis)
    find_package(hiredis CONFIG QUIET)
    if(TARGET hiredis::hiredis)
      add_library(kvkit::hiredis INTERFACE IMPORTED)
      set_target_properties(kvkit::hiredis PROPERTIES INTERFACE_LINK_LIBRARIES hiredis::hiredis)
    else()
      find_path(KVKIT_HIREDIS_INCLUDE_DIR hiredis/hiredis.h HINTS ${HIREDIS_ROOT}/include)
      find_library(KVKIT_HIREDIS_LIBRARY hiredis HINTS ${HIREDIS_ROOT}/lib)
      mark_as_advanced(KVKIT_HIREDIS_INCLUDE_DIR KVKIT_HIREDIS_LIBRARY)
      if(KVKIT_HIREDIS_INCLUDE_DIR AND KVKIT_HIREDIS_LIBRARY)
        add_library(kvkit::hiredis UNKNOWN IMPORTED)
        set_target_properties(kvkit::hiredis PROPERTIES
          IMPORTED_LOCATION "${KVKIT_HIREDIS_LIBRARY}"
          INTERFACE_INCLUDE_DIRECTORIES "${KVKIT_HIREDIS_INCLUDE_DIR}")
      endif()
    endif()
  endif()
  if(TARGET kvkit::hiredis)
    set(KVKIT_HIREDIS_FOUND TRUE)
  else()
    set(KVKIT_HIREDIS_FOUND FALSE)
  endif()
endmacro()
