#pragma once
// Compile-time SIMD for the CPU kernels: float vectors, half/bfloat16 <-> float
// conversions, a vector exp, dot and axpy.
//
// The instruction set is chosen from the consumer's compiler flags, never at run time:
//   __AVX512F__                      -> 16-lane AVX-512 (vcvtph2ps zmm, FMA)   "avx512"
//                                       (-mavx512f suffices; it implies AVX2)
//   __AVX2__ + __FMA__ + __F16C__    -> 8-lane AVX2 (vcvtph2ps ymm, FMA)       "avx2"
//   __ARM_NEON on AArch64            -> 4-lane NEON (fcvtl, fmla)              "neon"
//   otherwise (x86-64 baseline, ...) -> portable C++ over the scalar converters "portable"
// Defining KVKIT_SIMD_PORTABLE forces the portable path. bfloat16 is widened by a 16-bit
// shift on every path.
//
// Two kinds of conversion live here:
//   - exact array conversions (convert_*): bit for bit what the scalar converters of
//     core/dtype.hpp return, NaN payloads included (the hardware quiets signalling NaNs
//     and drops float->half payload bits, so NaN lanes are patched). The hardware
//     converters honour MXCSR: with DAZ/FTZ set (e.g. -ffast-math startup code) subnormals
//     differ from the scalar reference.
//   - Vec::load(const T*): the kernels' fast widening load; identical to the scalar
//     converter except that a NaN may come back with another NaN payload.
// Everything is in an inline namespace named after the instruction set, so translation
// units built with different flags never share (ODR-merge) one of these functions.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvkit/core/dtype.hpp"

#if !defined(KVKIT_SIMD_PORTABLE) && !defined(__CUDA_ARCH__) && defined(__AVX512F__)
#define KVKIT_SIMD_AVX512 1
#include "kvkit/core/immintrin.hpp"  // GCC 12's warnings inside <immintrin.h> silenced there
#elif !defined(KVKIT_SIMD_PORTABLE) && !defined(__CUDA_ARCH__) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
#define KVKIT_SIMD_AVX2 1
#include "kvkit/core/immintrin.hpp"
#elif !defined(KVKIT_SIMD_PORTABLE) && !defined(__CUDA_ARCH__) && defined(__ARM_NEON) && \
    defined(__aarch64__)
#define KVKIT_SIMD_NEON 1
#include <arm_neon.h>
#else
#define KVKIT_SIMD_SCALAR 1
#endif

#if defined(KVKIT_SIMD_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// AVX512_BF16 (vdpbf16ps) unlocks the opt-in DecodeAttentionParams::bf16_dot kernel; the
// namespace differs so a unit with it and one without never share a kernel body.
#define KVKIT_SIMD_AVX512BF16 1
#define KVKIT_SIMD_NS simd_avx512bf16
#elif defined(KVKIT_SIMD_AVX512)
#define KVKIT_SIMD_NS simd_avx512
#elif defined(KVKIT_SIMD_AVX2)
#define KVKIT_SIMD_NS simd_avx2
#elif defined(KVKIT_SIMD_NEON)
#define KVKIT_SIMD_NS simd_neon
#else
#define KVKIT_SIMD_NS simd_portable
#endif

#if defined(__GNUC__) || defined(__clang__)
// For small helpers whose array arguments must stay in registers (not inlined, the
// array goes through the stack).
#define KVKIT_SIMD_INLINE inline __attribute__((always_inline))
#else
#define KVKIT_SIMD_INLINE inline
#endif

namespace kvkit {
namespace detail {
namespace cpu {
inline namespace KVKIT_SIMD_NS {

/// Name of the compiled-in instruction set: "avx512", "avx2", "neon" or "portable".
inline const char* simd_isa() {
#if defined(KVKIT_SIMD_AVX512)
  return "avx512";
#elif defined(KVKIT_SIMD_AVX2)
  return "avx2";
#elif defined(KVKIT_SIMD_NEON)
  return "neon";
#else
  return "portable";
#endif
}

// ---------------------------------------------------------------------------------------
// Vec: kLanes floats and the handful of operations the kernels need.

#if defined(KVKIT_SIMD_AVX512)

struct Vec {
  static constexpr int kLanes = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }  // [16]
  static Vec load(const half_t* p) {                                  // [16]
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec load(const bfloat16_t* p) {  // [16]
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }  // [16]
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  /// a * b + c (fused).
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  /// Sum of the lanes in a fixed order (deterministic).
  float hsum() const {
    const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  /// out[i] = x[i].hsum() for 4 vectors, sharing the shuffles (fixed order).
  static void hsum4(const Vec* x, float* out) {  // x [4], out [4]
    __m256 y[4];
    for (int i = 0; i < 4; ++i)
      y[i] = _mm256_add_ps(_mm512_castps512_ps256(x[i].v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x[i].v), 1)));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
  /// 2^n for integral-valued n in [-126, 127].
  static Vec pow2i(Vec n) {
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(i, 23))};
  }
  static Vec round(Vec x) {
    return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  /// Lanes where x >= lo keep `a`, others become 0.
  static Vec keep_ge(Vec x, Vec lo, Vec a) {
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, lo.v, _CMP_GE_OQ), a.v)};
  }
};

#elif defined(KVKIT_SIMD_AVX2)

struct Vec {
  static constexpr int kLanes = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }  // [8]
  static Vec load(const half_t* p) {                                  // [8]
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static Vec load(const bfloat16_t* p) {  // [8]
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }  // [8]
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
  float hsum() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static void hsum4(const Vec* x, float* out) {  // x [4], out [4]
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(x[0].v, x[1].v), _mm256_hadd_ps(x[2].v, x[3].v));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
  float hmax() const {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static Vec pow2i(Vec n) {
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(i, 23))};
  }
  static Vec round(Vec x) {
    return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  static Vec keep_ge(Vec x, Vec lo, Vec a) {
    return {_mm256_and_ps(_mm256_cmp_ps(x.v, lo.v, _CMP_GE_OQ), a.v)};
  }
};

#elif defined(KVKIT_SIMD_NEON)

struct Vec {
  static constexpr int kLanes = 4;
  float32x4_t v;
  static Vec zero() { return {vdupq_n_f32(0.f)}; }
  static Vec set1(float x) { return {vdupq_n_f32(x)}; }
  static Vec load(const float* p) { return {vld1q_f32(p)}; }  // [4]
  static Vec load(const half_t* p) {                            // [4]
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))))};
  }
  static Vec load(const bfloat16_t* p) {  // [4]
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)), 16))};
  }
  void store(float* p) const { vst1q_f32(p, v); }  // [4]
  friend Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }
  float hsum() const {
    const float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
  }
  float hmax() const { return vmaxvq_f32(v); }
  static void hsum4(const Vec* x, float* out) {  // x [4], out [4]
    for (int i = 0; i < 4; ++i) out[i] = x[i].hsum();
  }
  static Vec pow2i(Vec n) {
    const int32x4_t i = vaddq_s32(vcvtq_s32_f32(n.v), vdupq_n_s32(127));
    return {vreinterpretq_f32_s32(vshlq_n_s32(i, 23))};
  }
  static Vec round(Vec x) { return {vrndnq_f32(x.v)}; }
  static Vec keep_ge(Vec x, Vec lo, Vec a) {
    return {vreinterpretq_f32_u32(vandq_u32(vcgeq_f32(x.v, lo.v), vreinterpretq_u32_f32(a.v)))};
  }
};

#elif defined(__GNUC__) || defined(__clang__)  // portable: GCC/Clang vector extensions

// 4 floats as a compiler vector type: SSE2 on x86-64 baseline, whatever the target has
// elsewhere, and never an instruction the consumer's flags do not allow.
typedef float KvkitF32x4 __attribute__((vector_size(16)));

struct Vec {
  static constexpr int kLanes = 4;
  KvkitF32x4 v;
  static Vec zero() { return {KvkitF32x4{0.f, 0.f, 0.f, 0.f}}; }
  static Vec set1(float x) { return {KvkitF32x4{x, x, x, x}}; }
  static Vec load(const float* p) {  // [4]
    Vec r;
    std::memcpy(&r.v, p, sizeof r.v);
    return r;
  }
  typedef std::int32_t I32x4 __attribute__((vector_size(16)));
  typedef std::uint16_t U16x4 __attribute__((vector_size(8)));
  static I32x4 widen(const void* p) {  // [4] 16-bit words, zero-extended
    U16x4 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, I32x4);
  }
  /// detail::half_bits_to_float on 4 lanes (same integer steps, so the same bits).
  static Vec load(const half_t* p) {  // [4]
    const I32x4 h = widen(p);
    const I32x4 sign = (h & 0x8000) << 16;
    const I32x4 em = h & 0x7fff;
    const I32x4 is_sub = em < 0x0400;     // all ones where subnormal or zero
    const I32x4 is_spec = em >= 0x7c00;   // inf, nan
    const I32x4 normal = (em << 13) + 0x38000000 + (is_spec & 0x38000000);
    KvkitF32x4 f;
    const I32x4 biased = (em << 13) + 0x38800000;
    std::memcpy(&f, &biased, sizeof f);
    f = f - KvkitF32x4{6.103515625e-05f, 6.103515625e-05f, 6.103515625e-05f, 6.103515625e-05f};
    I32x4 sub;
    std::memcpy(&sub, &f, sizeof sub);
    const I32x4 bits = sign | (normal & ~is_sub) | (sub & is_sub);
    Vec r;
    std::memcpy(&r.v, &bits, sizeof r.v);
    return r;
  }
  static Vec load(const bfloat16_t* p) {  // [4]
    const I32x4 bits = widen(p) << 16;
    Vec r;
    std::memcpy(&r.v, &bits, sizeof r.v);
    return r;
  }
  void store(float* p) const { std::memcpy(p, &v, sizeof v); }  // [4]
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  static Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  static Vec min(Vec a, Vec b) { return {a.v < b.v ? a.v : b.v}; }
  float hsum() const { return (v[0] + v[2]) + (v[1] + v[3]); }
  float hmax() const {
    const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
    return a > b ? a : b;
  }
  static void hsum4(const Vec* x, float* out) {  // x [4], out [4]
    for (int i = 0; i < 4; ++i) out[i] = x[i].hsum();
  }
};

#else  // portable, other compilers: 4 floats in plain C++

struct Vec {
  static constexpr int kLanes = 4;
  float v[4];
  static Vec zero() { return {{0.f, 0.f, 0.f, 0.f}}; }
  static Vec set1(float x) { return {{x, x, x, x}}; }
  template <class T>
  static Vec load(const T* p) {  // [4]
    return {{to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3])}};
  }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }  // [4]
  friend Vec operator+(Vec a, Vec b) {
    return {{a.v[0] + b.v[0], a.v[1] + b.v[1], a.v[2] + b.v[2], a.v[3] + b.v[3]}};
  }
  friend Vec operator-(Vec a, Vec b) {
    return {{a.v[0] - b.v[0], a.v[1] - b.v[1], a.v[2] - b.v[2], a.v[3] - b.v[3]}};
  }
  friend Vec operator*(Vec a, Vec b) {
    return {{a.v[0] * b.v[0], a.v[1] * b.v[1], a.v[2] * b.v[2], a.v[3] * b.v[3]}};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
  static Vec max(Vec a, Vec b) {
    Vec r;
    for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  static Vec min(Vec a, Vec b) {
    Vec r;
    for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  float hsum() const { return (v[0] + v[2]) + (v[1] + v[3]); }
  static void hsum4(const Vec* x, float* out) {  // x [4], out [4]
    for (int i = 0; i < 4; ++i) out[i] = x[i].hsum();
  }
  float hmax() const { return max(max(set1(v[0]), set1(v[1])), max(set1(v[2]), set1(v[3]))).v[0]; }
};

#endif

/// Loads n < Vec::kLanes elements (the rest 0) as a Vec: the tail of a row.
template <class T>
inline Vec load_partial(const T* p,  // [n]
                        int n) {
  T buf[Vec::kLanes];
  std::memset(static_cast<void*>(buf), 0, sizeof buf);
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * static_cast<std::size_t>(n));
  return Vec::load(buf);
}

/// Stores the first n < Vec::kLanes lanes of x.
inline void store_partial(Vec x, float* p,  // [n]
                          int n) {
  float buf[Vec::kLanes];
  x.store(buf);
  std::memcpy(p, buf, sizeof(float) * static_cast<std::size_t>(n));
}

/// e^x per lane. Vector paths: Cephes-style range reduction and a degree-6 polynomial
/// (about 2 ulp on [-87, 88]); lanes below -87.3 (and -inf) give exactly 0. The portable
/// path calls std::exp.
inline Vec vexp(Vec x) {
#if defined(KVKIT_SIMD_SCALAR)
  Vec r;
  for (int i = 0; i < 4; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
#else
  const Vec lo = Vec::set1(-87.3f);
  const Vec xc = Vec::min(Vec::max(x, lo), Vec::set1(88.3f));
  const Vec n = Vec::round(xc * Vec::set1(1.44269504088896341f));
  Vec r = Vec::fma(n, Vec::set1(-0.693359375f), xc);
  r = Vec::fma(n, Vec::set1(2.12194440e-4f), r);
  Vec p = Vec::set1(1.9875691500e-4f);
  p = Vec::fma(p, r, Vec::set1(1.3981999507e-3f));
  p = Vec::fma(p, r, Vec::set1(8.3334519073e-3f));
  p = Vec::fma(p, r, Vec::set1(4.1665795894e-2f));
  p = Vec::fma(p, r, Vec::set1(1.6666665459e-1f));
  p = Vec::fma(p, r, Vec::set1(5.0000001201e-1f));
  p = Vec::fma(p, r * r, r + Vec::set1(1.f));
#if defined(KVKIT_SIMD_AVX512)
  // p * 2^n in one instruction (vscalefps): the same single rounding as the two exact
  // power-of-two products below, so the same bits.
  return Vec::keep_ge(x, lo, Vec{_mm512_scalef_ps(p.v, n.v)});
#else
  // 2^n in two factors so n = 128 (x near 88.3) does not overflow the exponent field.
  const Vec half_n = Vec::round(n * Vec::set1(0.5f));
  const Vec res = p * Vec::pow2i(half_n) * Vec::pow2i(n - half_n);
  return Vec::keep_ge(x, lo, res);
#endif
#endif
}

/// e^x of one float through the same code as vexp (lane 0).
inline float vexp1(float x) {
  float buf[Vec::kLanes];
  vexp(Vec::set1(x)).store(buf);
  return buf[0];
}

/// sum a[i] * b[i] over n, in Vec::kLanes partial sums (fixed order, so deterministic).
template <class T>
inline float dot(const float* a,  // [n]
                 const T* b,      // [n]
                 std::int32_t n) {
  constexpr int W = Vec::kLanes;
  Vec s0 = Vec::zero(), s1 = Vec::zero();
  std::int32_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    s0 = Vec::fma(Vec::load(a + d), Vec::load(b + d), s0);
    s1 = Vec::fma(Vec::load(a + d + W), Vec::load(b + d + W), s1);
  }
  for (; d + W <= n; d += W) s0 = Vec::fma(Vec::load(a + d), Vec::load(b + d), s0);
  if (d < n) s1 = Vec::fma(load_partial(a + d, n - d), load_partial(b + d, n - d), s1);
  return (s0 + s1).hsum();
}

/// y[i] += alpha * x[i] over n.
template <class T>
inline void axpy(float* y,  // [n]
                 float alpha,
                 const T* x,  // [n]
                 std::int32_t n) {
  constexpr int W = Vec::kLanes;
  const Vec a = Vec::set1(alpha);
  std::int32_t d = 0;
  for (; d + W <= n; d += W) Vec::fma(a, Vec::load(x + d), Vec::load(y + d)).store(y + d);
  if (d < n) store_partial(Vec::fma(a, load_partial(x + d, n - d), load_partial(y + d, n - d)), y + d, n - d);
}

/// y[i] *= alpha over n.
inline void scale(float* y,  // [n]
                  float alpha, std::int32_t n) {
  constexpr int W = Vec::kLanes;
  const Vec a = Vec::set1(alpha);
  std::int32_t d = 0;
  for (; d + W <= n; d += W) (a * Vec::load(y + d)).store(y + d);
  for (; d < n; ++d) y[d] *= alpha;
}

/// Code c of a row of signed kBits-bit codes (8: one int8 per code; 4: code c in the low
/// nibble of byte c / 2 when c is even, the high nibble when odd, two's complement).
template <int kBits>
inline std::int32_t code_at(const std::uint8_t* row, std::int32_t c) {
  static_assert(kBits == 4 || kBits == 8, "4- or 8-bit codes");
  if constexpr (kBits == 8) {
    return static_cast<std::int8_t>(row[c]);
  } else {
    return (((row[c >> 1] >> ((c & 1) * 4)) & 0xF) ^ 8) - 8;  // (x ^ 8) - 8 sign-extends a nibble
  }
}

/// Codes j .. j + n - 1 of a code row (code_at's layout) as float lanes, the rest 0;
/// reads no byte past those codes. n < Vec::kLanes: the tail of a row.
template <int kBits>
inline Vec load_codes_partial(const std::uint8_t* row, std::int32_t j, int n) {
  float buf[Vec::kLanes] = {};
  for (int i = 0; i < n; ++i) buf[i] = static_cast<float>(code_at<kBits>(row, j + i));
  return Vec::load(buf);
}

/// Codes j .. j + Vec::kLanes - 1 of a code row (code_at's layout) as float lanes, j even;
/// reads exactly the bytes of those codes. Vector paths sign-extend in registers
/// (nibbles: split, interleave, (x ^ 8) - 8).
template <int kBits>
inline Vec load_codes(const std::uint8_t* row, std::int32_t j) {
  static_assert(kBits == 4 || kBits == 8, "4- or 8-bit codes");
#if defined(KVKIT_SIMD_AVX512) || defined(KVKIT_SIMD_AVX2)
  __m128i b;  // the codes as int8 lanes (16 for AVX-512, 8 for AVX2)
  if constexpr (kBits == 8) {
#if defined(KVKIT_SIMD_AVX512)
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j));
#else
    b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j));
#endif
  } else {
#if defined(KVKIT_SIMD_AVX512)
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j / 2));  // 8 bytes
#else
    std::int32_t w;
    std::memcpy(&w, row + j / 2, sizeof w);  // 4 bytes
    const __m128i x = _mm_cvtsi32_si128(w);
#endif
    const __m128i m = _mm_set1_epi8(0x0F), e = _mm_set1_epi8(8);
    const __m128i u = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    b = _mm_sub_epi8(_mm_xor_si128(u, e), e);
  }
#if defined(KVKIT_SIMD_AVX512)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
#endif
#else
  return load_codes_partial<kBits>(row, j, Vec::kLanes);
#endif
}

/// Codes j .. j + rest - 1 of a 4-bit code row (code_at's layout; j even, rest <= 2
/// Vec::kLanes), split by parity: even[i] = code j + 2i, odd[i] = code j + 2i + 1, lanes
/// past `rest` codes 0; reads no byte past those codes. A whole pair (rest == 2 kLanes) is
/// one byte per lane: zero-extended, then each nibble sign-extended by two shifts, so a
/// caller that keeps its dims in this even / odd order decodes 2 kLanes codes in 6 vector
/// operations.
inline void load_nibble_pairs(const std::uint8_t* row, std::int32_t j, int rest, Vec* even, Vec* odd) {
  constexpr int W = Vec::kLanes;
#if defined(KVKIT_SIMD_AVX512) || defined(KVKIT_SIMD_AVX2)
  if (rest == 2 * W) {
#if defined(KVKIT_SIMD_AVX512)
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j / 2)));
    even->v = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28));
    odd->v = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24), 28));
#else
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j / 2)));
    even->v = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
    odd->v = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 24), 28));
#endif
    return;
  }
#endif
  float e[W] = {}, o[W] = {};
  for (int i = 0; i < W; ++i) {
    if (2 * i < rest) e[i] = static_cast<float>(code_at<4>(row, j + 2 * i));
    if (2 * i + 1 < rest) o[i] = static_cast<float>(code_at<4>(row, j + 2 * i + 1));
  }
  *even = Vec::load(e);
  *odd = Vec::load(o);
}

// ---------------------------------------------------------------------------------------
// Exact array conversions (bit for bit the scalar converters of core/dtype.hpp).

/// dst[i] = float(src[i]) for binary16 bits, NaN payloads kept as the scalar converter keeps them.
inline void convert(const half_t* src,  // [n]
                    float* dst,         // [n]
                    std::size_t n) {
  std::size_t i = 0;
#if defined(KVKIT_SIMD_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 f = _mm512_cvtph_ps(h);
    const __m512i w = _mm512_cvtepu16_epi32(h);
    const __m512i em = _mm512_and_si512(w, _mm512_set1_epi32(0x7fff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(em, _mm512_set1_epi32(0x7c00));
    // The scalar converter rebiases NaNs like any exponent: payload kept, not quieted.
    const __m512i nb = _mm512_or_si512(
        _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16),
        _mm512_add_epi32(_mm512_slli_epi32(em, 13), _mm512_set1_epi32(0x70000000)));
    _mm512_storeu_ps(dst + i, _mm512_mask_mov_ps(f, nan, _mm512_castsi512_ps(nb)));
  }
#elif defined(KVKIT_SIMD_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256 f = _mm256_cvtph_ps(h);
    const __m256i w = _mm256_cvtepu16_epi32(h);
    const __m256i em = _mm256_and_si256(w, _mm256_set1_epi32(0x7fff));
    const __m256i nan = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7c00));
    const __m256i nb = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
        _mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(0x70000000)));
    _mm256_storeu_ps(dst + i, _mm256_blendv_ps(f, _mm256_castsi256_ps(nb), _mm256_castsi256_ps(nan)));
  }
#elif defined(KVKIT_SIMD_NEON)
  for (; i + 4 <= n; i += 4) {
    const uint16x4_t h = vld1_u16(reinterpret_cast<const std::uint16_t*>(src + i));
    const float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u16(h));
    const uint32x4_t w = vmovl_u16(h);
    const uint32x4_t em = vandq_u32(w, vdupq_n_u32(0x7fff));
    const uint32x4_t nan = vcgtq_u32(em, vdupq_n_u32(0x7c00));
    const uint32x4_t nb = vorrq_u32(vshlq_n_u32(vandq_u32(w, vdupq_n_u32(0x8000)), 16),
                                    vaddq_u32(vshlq_n_u32(em, 13), vdupq_n_u32(0x70000000)));
    vst1q_f32(dst + i, vbslq_f32(nan, vreinterpretq_f32_u32(nb), f));
  }
#endif
  for (; i < n; ++i) dst[i] = detail::half_bits_to_float(src[i].bits);
}

/// dst[i] = half_t(src[i]): round to nearest even, NaN -> sign | 0x7e00 as the scalar converter.
inline void convert(const float* src,  // [n]
                    half_t* dst,       // [n]
                    std::size_t n) {
  std::size_t i = 0;
#if defined(KVKIT_SIMD_AVX512)
  // AVX512F alone (-mavx512f) does not imply F16C, so use the 512-bit conversion.
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    const __m256i em = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
    const __m256i nan = _mm256_cmpgt_epi16(em, _mm256_set1_epi16(0x7c00));
    const __m256i qn = _mm256_or_si256(
        _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))), _mm256_set1_epi16(0x7e00));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_blendv_epi8(h, qn, nan));
  }
#elif defined(KVKIT_SIMD_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    const __m128i em = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    const __m128i nan = _mm_cmpgt_epi16(em, _mm_set1_epi16(0x7c00));
    const __m128i qn = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))),
                                    _mm_set1_epi16(0x7e00));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_blendv_epi8(h, qn, nan));
  }
#elif defined(KVKIT_SIMD_NEON)
  for (; i + 4 <= n; i += 4) {
    const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i)));
    const uint16x4_t em = vand_u16(h, vdup_n_u16(0x7fff));
    const uint16x4_t nan = vcgt_u16(em, vdup_n_u16(0x7c00));
    const uint16x4_t qn = vorr_u16(vand_u16(h, vdup_n_u16(0x8000)), vdup_n_u16(0x7e00));
    vst1_u16(reinterpret_cast<std::uint16_t*>(dst + i), vbsl_u16(nan, qn, h));
  }
#endif
  for (; i < n; ++i) dst[i].bits = detail::float_to_half_bits(src[i]);
}

/// dst[i] = float(src[i]) for bfloat16 (a 16-bit shift, exact).
inline void convert(const bfloat16_t* src,  // [n]
                    float* dst,             // [n]
                    std::size_t n) {
  std::size_t i = 0;
#if !defined(KVKIT_SIMD_SCALAR)
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) Vec::load(src + i).store(dst + i);
#endif
  for (; i < n; ++i) dst[i] = detail::bf16_bits_to_float(src[i].bits);
}

/// dst[i] = bfloat16_t(src[i]): round to nearest even, NaN -> (bits >> 16) | 0x40.
inline void convert(const float* src,  // [n]
                    bfloat16_t* dst,   // [n]
                    std::size_t n) {
  std::size_t i = 0;
#if defined(KVKIT_SIMD_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m512i x = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i hi = _mm512_srli_epi32(x, 16);
    const __m512i rnd = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                         _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, rnd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i out = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(out));
  }
#elif defined(KVKIT_SIMD_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i hi = _mm256_srli_epi32(x, 16);
    const __m256i rnd = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                         _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, rnd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i out = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // Pack 8 x u32 (all <= 0xffff) to 8 x u16: per-lane pack, then gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#elif defined(KVKIT_SIMD_NEON)
  for (; i + 4 <= n; i += 4) {
    const uint32x4_t x = vreinterpretq_u32_f32(vld1q_f32(src + i));
    const uint32x4_t hi = vshrq_n_u32(x, 16);
    const uint32x4_t rnd = vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(hi, vdupq_n_u32(1)));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(x, rnd), 16);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(x, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    const uint32x4_t out = vbslq_u32(nan, vorrq_u32(hi, vdupq_n_u32(0x40)), r);
    vst1_u16(reinterpret_cast<std::uint16_t*>(dst + i), vmovn_u32(out));
  }
#endif
  for (; i < n; ++i) dst[i].bits = detail::float_to_bf16_bits(src[i]);
}

/// float -> float: a copy (lets kernels call convert() for every T).
inline void convert(const float* src,  // [n]
                    float* dst,        // [n]
                    std::size_t n) {
  if (n > 0) std::memmove(dst, src, n * sizeof(float));
}

}  // namespace KVKIT_SIMD_NS
}  // namespace cpu
}  // namespace detail
}  // namespace kvkit
