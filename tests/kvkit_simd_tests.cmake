# kvkit_add_simd_test(name src): registers `name` (default flags) and, where the compiler
# and build machine allow, `name_native` (-march=native) and `name_avx2`
# (-mavx2 -mfma -mf16c, only when -march=native has AVX-512, so it can run here).
# The sanitizer build (KVKIT_SANITIZE) skips `name_avx2`: the Release build runs the AVX2
# path's numbers, and the sanitizers already see the portable and native paths, whose
# loops and tails the AVX2 path shares; this keeps CI's two builds inside their time.
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)
if(NOT DEFINED KVKIT_NATIVE_FLAGS_OK)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_FLAGS "-march=native")
  check_cxx_source_compiles("int main() { return 0; }" KVKIT_NATIVE_FLAGS_OK)
  check_cxx_source_compiles("#ifndef __AVX512F__\n#error no\n#endif\nint main() { return 0; }"
                            KVKIT_NATIVE_HAS_AVX512)
  cmake_pop_check_state()
endif()
function(kvkit_add_simd_test name src)
  kvkit_add_test(${name} ${src})
  if(KVKIT_NATIVE_FLAGS_OK)
    kvkit_add_test(${name}_native ${src})
    target_compile_options(${name}_native PRIVATE -march=native)
  endif()
  if(KVKIT_NATIVE_HAS_AVX512 AND NOT KVKIT_SANITIZE)
    kvkit_add_test(${name}_avx2 ${src})
    target_compile_options(${name}_avx2 PRIVATE -mavx2 -mfma -mf16c)
  endif()
endfunction()
