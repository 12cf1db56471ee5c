# Settings for kvkit's own tests, examples and benchmarks (never exported).

# Warnings as errors for the project's own targets.
add_library(kvkit_dev_flags INTERFACE)
# CXX-only (nvcc gets its own flags in tests/cuda); quoted lists keep each genex whole.
target_compile_options(kvkit_dev_flags INTERFACE
  "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Werror>")
if(KVKIT_SANITIZE)
  # -Wno-maybe-uninitialized: GCC 12 reports a false positive inside libstdc++'s <regex>
  # (pulled in by Catch2) once the sanitizers change inlining; it is not kvkit code.
  target_compile_options(kvkit_dev_flags INTERFACE
    "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined;-fno-sanitize-recover=all;-fno-omit-frame-pointer;-Wno-maybe-uninitialized>")
  target_link_options(kvkit_dev_flags INTERFACE -fsanitize=address,undefined)
endif()

# CUDA: AUTO enables it when nvcc can be found.
set(KVKIT_WITH_CUDA OFF)
if(NOT KVKIT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # sm_90 SASS plus compute_90 PTX so newer GPUs JIT the kernels.
      set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
    endif()
    enable_language(CUDA)
    set(KVKIT_WITH_CUDA ON)
  elseif(KVKIT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVKIT_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "kvkit: CUDA kernels and parity tests: ${KVKIT_WITH_CUDA}")

# Where tests and benchmarks look for the real checkpoint.
set(KVKIT_MODEL_DIR "${CMAKE_CURRENT_SOURCE_DIR}/../shared/models" CACHE PATH
    "Folder holding stories260K.bin (tests skip with a message when absent)")
