# The library targets. kvkit is header-only: every target is INTERFACE.
#   kvkit::kvkit  core + policies + CPU kernels (C++17; Eigen3 when found)
#   kvkit::cuda   adds CUDA::cudart for <kvkit/cuda.cuh>
#   kvkit::redis  adds hiredis for the Redis block store
#   kvkit::zstd   adds libzstd and KVKIT_HAS_ZSTD=1: zstd-compressed block payloads
include(GNUInstallDirs)

add_library(kvkit INTERFACE)
add_library(kvkit::kvkit ALIAS kvkit)
target_include_directories(kvkit INTERFACE
  $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(kvkit INTERFACE cxx_std_17)
find_package(Threads REQUIRED)
target_link_libraries(kvkit INTERFACE Threads::Threads)
find_package(Eigen3 3.3 CONFIG QUIET)
if(TARGET Eigen3::Eigen)
  target_link_libraries(kvkit INTERFACE $<BUILD_INTERFACE:Eigen3::Eigen>)
  target_compile_definitions(kvkit INTERFACE $<BUILD_INTERFACE:KVKIT_HAS_EIGEN=1>)
endif()
# Installed package: Eigen is optional and decided on the consumer's machine
# (kvkitConfig.cmake looks for it), not baked in from this one.
target_link_libraries(kvkit INTERFACE $<INSTALL_INTERFACE:$<TARGET_NAME_IF_EXISTS:Eigen3::Eigen>>)
target_compile_definitions(kvkit INTERFACE
  $<INSTALL_INTERFACE:$<$<TARGET_EXISTS:Eigen3::Eigen>:KVKIT_HAS_EIGEN=1>>)
set_target_properties(kvkit PROPERTIES EXPORT_NAME kvkit)

# CUDA component: only when the toolkit is found.
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND)
  add_library(kvkit_cuda INTERFACE)
  add_library(kvkit::cuda ALIAS kvkit_cuda)
  target_link_libraries(kvkit_cuda INTERFACE kvkit CUDA::cudart)
  set_target_properties(kvkit_cuda PROPERTIES EXPORT_NAME cuda)
endif()

# Redis component: hiredis has no CMake package on Debian 12's 0.14, so
# kvkit_find_hiredis() finds it by hand and wraps it as the imported kvkit::hiredis.
include(${CMAKE_CURRENT_LIST_DIR}/kvkitHiredis.cmake)
kvkit_find_hiredis()
if(KVKIT_HIREDIS_FOUND)
  add_library(kvkit_redis INTERFACE)
  add_library(kvkit::redis ALIAS kvkit_redis)
  target_link_libraries(kvkit_redis INTERFACE kvkit kvkit::hiredis)
  set_target_properties(kvkit_redis PROPERTIES EXPORT_NAME redis)
endif()

# zstd component: libzstd found by kvkit_find_zstd() (its CMake package, else by hand) and
# wrapped as the imported kvkit::libzstd; kvkit::zstd adds KVKIT_HAS_ZSTD=1.
include(${CMAKE_CURRENT_LIST_DIR}/kvkitZstd.cmake)
kvkit_find_zstd()
if(KVKIT_ZSTD_FOUND)
  add_library(kvkit_zstd INTERFACE)
  add_library(kvkit::zstd ALIAS kvkit_zstd)
  target_link_libraries(kvkit_zstd INTERFACE kvkit kvkit::libzstd)
  target_compile_definitions(kvkit_zstd INTERFACE KVKIT_HAS_ZSTD=1)
  set_target_properties(kvkit_zstd PROPERTIES EXPORT_NAME zstd)
endif()
