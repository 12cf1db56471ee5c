#pragma once
// <immintrin.h> for kvkit's x86 SIMD paths, included through this header only. GCC 12
// warns inside its own AVX-512 headers (_mm512_undefined_* "may be used uninitialized",
// GCC bug 105593); the warning is located in the header, so it is silenced there, around
// the include, and nowhere else.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
