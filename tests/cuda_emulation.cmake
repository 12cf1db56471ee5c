# CUDA tests on the host. CI has no GPU, so the sanitizer build also compiles the CUDA
# test files named in KVKIT_EMULATED_CUDA_TESTS (by default the core kernels' parity test
# and kvchan's residual, whose kernels never ran on a GPU; the other three files cost
# 45-100 s of compile each, run them with run_tests.sh), with the real kernels/cuda headers, as
# C++20 against a stand-in CUDA runtime (scripts/cuda_emulation/runtime/cuda_runtime.h: a
# block's threads are fibers switched at barriers) and runs them under ASan/UBSan: the
# CUDA twins then run, and are compared with the CPU, on every CI pass.
# scripts/cuda_emulation/rewrite.py copies the .cuh / .cu files with their <<<...>>>
# launches rewritten; scripts/cuda_emulation/run_tests.sh runs every CUDA test file the
# same way by hand. Needs x86-64 (the fibers' stack switch), GCC or Clang, C++20 and Python 3.
set(KVKIT_EMULATED_CUDA_TESTS "test_cuda_parity;test_kvchan_residual_cuda" CACHE STRING
    "tests/cuda files the sanitizer build runs on the host CUDA emulation")
find_package(Python3 COMPONENTS Interpreter)
if(NOT Python3_Interpreter_FOUND OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang"
   OR NOT CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" OR CMAKE_CXX_STANDARD LESS 20)
  message(STATUS "kvkit: host CUDA emulation tests off (need Python 3, GCC/Clang, x86-64, C++20)")
  return()
endif()

set(_kvkit_emu ${PROJECT_SOURCE_DIR}/scripts/cuda_emulation)
set(_kvkit_emu_gen ${CMAKE_CURRENT_BINARY_DIR}/cuda_emulation)
file(GLOB_RECURSE _kvkit_emu_inputs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/kvkit/*.cuh
     ${CMAKE_CURRENT_SOURCE_DIR}/cuda/*.cu ${CMAKE_CURRENT_SOURCE_DIR}/cuda/*.cuh)
set(_kvkit_emu_srcs)
set(_kvkit_emu_copy)
foreach(t IN LISTS KVKIT_EMULATED_CUDA_TESTS)  # .cpp next to its .cu (its includes are relative)
  list(APPEND _kvkit_emu_srcs ${_kvkit_emu_gen}/tests/cuda/${t}.cpp)
  list(APPEND _kvkit_emu_copy COMMAND ${CMAKE_COMMAND} -E copy ${_kvkit_emu_gen}/tests/cuda/${t}.cu
       ${_kvkit_emu_gen}/tests/cuda/${t}.cpp)
endforeach()
add_custom_command(OUTPUT ${_kvkit_emu_srcs}
  COMMAND Python3::Interpreter ${_kvkit_emu}/rewrite.py ${PROJECT_SOURCE_DIR} ${_kvkit_emu_gen}
  ${_kvkit_emu_copy}
  DEPENDS ${_kvkit_emu_inputs} ${_kvkit_emu}/rewrite.py
  COMMENT "Rewriting the CUDA sources for the host emulation")
foreach(t IN LISTS KVKIT_EMULATED_CUDA_TESTS)
  kvkit_add_test(${t}_emu ${_kvkit_emu_gen}/tests/cuda/${t}.cpp)
  # The rewritten .cuh copies shadow the originals; every other header comes from include/.
  target_include_directories(${t}_emu BEFORE PRIVATE ${_kvkit_emu}/runtime ${_kvkit_emu_gen}/include)
  target_compile_definitions(${t}_emu PRIVATE __CUDACC__)
  # -O1: the kernels' loops at -O0 under ASan would double the run.
  target_compile_options(${t}_emu PRIVATE -include cuda_runtime.h -O1 -fno-strict-aliasing -Wno-deprecated -Wno-unknown-pragmas)
  # COST: ctest starts it first, so its ~100 s overlap the other tests.
  set_tests_properties(${t}_emu PROPERTIES LABELS cuda_emulation COST 1000)
endforeach()
