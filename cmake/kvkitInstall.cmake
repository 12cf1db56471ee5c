# Install rules: headers, the exported targets and a relocatable CMake package.
#
#   <prefix>/include/kvkit/...                 headers (kvkit is header-only)
#   <prefix>/share/cmake/kvkit/                kvkitConfig.cmake, kvkitConfigVersion.cmake,
#                                              kvkitTargets.cmake, kvkitHiredis.cmake,
#                                              kvkitZstd.cmake
#   <prefix>/share/doc/kvkit/                  LICENSE, NOTICE
#
# Nothing here depends on the machine that installs: the package is architecture
# independent and its dependencies (Threads, optional Eigen, CUDAToolkit for the cuda
# component, hiredis for the redis component, libzstd for the zstd component) are found again by kvkitConfig.cmake on the
# consumer's machine. Every rule is in the COMPONENT kvkit_development.
include(CMakePackageConfigHelpers)

set(KVKIT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/kvkit" CACHE STRING
    "Where the kvkit CMake package is installed (relative to the prefix)")
mark_as_advanced(KVKIT_INSTALL_CMAKEDIR)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT kvkit_development
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh" PATTERN "*.h")

# The component targets exist in the build tree only when their dependency was found
# here; the installed package always carries them, each tied to a dependency that the
# config file looks up when the component is requested.
add_library(kvkit_install_cuda INTERFACE)
target_link_libraries(kvkit_install_cuda INTERFACE kvkit $<INSTALL_INTERFACE:CUDA::cudart>)
set_target_properties(kvkit_install_cuda PROPERTIES EXPORT_NAME cuda)
add_library(kvkit_install_redis INTERFACE)
target_link_libraries(kvkit_install_redis INTERFACE kvkit $<INSTALL_INTERFACE:kvkit::hiredis>)
set_target_properties(kvkit_install_redis PROPERTIES EXPORT_NAME redis)
add_library(kvkit_install_zstd INTERFACE)
target_link_libraries(kvkit_install_zstd INTERFACE kvkit $<INSTALL_INTERFACE:kvkit::libzstd>)
target_compile_definitions(kvkit_install_zstd INTERFACE $<INSTALL_INTERFACE:KVKIT_HAS_ZSTD=1>)
set_target_properties(kvkit_install_zstd PROPERTIES EXPORT_NAME zstd)

install(TARGETS kvkit kvkit_install_cuda kvkit_install_redis kvkit_install_zstd
        EXPORT kvkitTargets
        COMPONENT kvkit_development)
install(EXPORT kvkitTargets
        NAMESPACE kvkit::
        DESTINATION "${KVKIT_INSTALL_CMAKEDIR}"
        COMPONENT kvkit_development)

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/kvkitConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvkitConfig.cmake"
  INSTALL_DESTINATION "${KVKIT_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/kvkitConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion
  ARCH_INDEPENDENT)
install(FILES
          "${PROJECT_BINARY_DIR}/kvkitConfig.cmake"
          "${PROJECT_BINARY_DIR}/kvkitConfigVersion.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/kvkitHiredis.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/kvkitZstd.cmake"
        DESTINATION "${KVKIT_INSTALL_CMAKEDIR}"
        COMPONENT kvkit_development)
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" "${PROJECT_SOURCE_DIR}/NOTICE"
        DESTINATION "${CMAKE_INSTALL_DOCDIR}"
        COMPONENT kvkit_development
        OPTIONAL)
