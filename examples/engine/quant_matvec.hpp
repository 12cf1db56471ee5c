#pragma once
// Matrix-vector products on GGML-quantized weights with 8-bit activations, for decode.
//
// Decode is bandwidth-bound: a float32 copy of SmolLM2-135M is 540 MB per token, its Q4_1 /
// Q8_0 blocks about 80 MB. So the weights stay in their GGUF blocks (pointers into the
// mapped file) and the activation vector is quantized once per projection to int8 blocks
// of 32, as llama.cpp's CPU backend does (q8_1 for Q4_1 weights, q8_0 for Q4_0 / Q8_0):
//
//   activation block (Q8Act): d = fp16(amax / 127), q_j = round_half_even(x_j * (127 / amax)),
//                              sum = sum_j q_j, s = fp16((amax / 127) * sum)
//   Q8_0 weight (f16 dw, int8 w[32]):          dot = dw * d * sum_j w_j q_j
//   Q4_0 weight (f16 dw, 16 bytes of nibbles): dot = dw * d * (sum_j n_j q_j - 8 * sum)
//   Q4_1 weight (f16 dw, f16 mw, nibbles):     dot = dw * d * sum_j n_j q_j + mw * s
// (nibble j of a Q4 block: byte j & 15 for j < 16, byte j-16 >> 4 for j >= 16). A row is
// the sum of its blocks' dots. The integer sums are exact on every path; only the float
// scale math (per-block products, the order of the float additions) differs between paths.
// F32 and F16 matrices (no blocks) use a float dot with the unquantized activations.
//
// Instruction sets are chosen at compile time from the consumer's flags, like simd.hpp:
//   __AVX512VNNI__ + VL + BW + DQ  -> vpdpbusd, two blocks per 512-bit vector    "avx512vnni"
//   __AVX2__                       -> vpmaddubsw + vpmaddwd, one block per vector  "avx2"
//   otherwise                      -> portable C++ (integer loops)                 "portable"
// KVKIT_SIMD_PORTABLE forces the portable path. Code lives in an inline namespace named
// after the path (no ODR merging across translation units built with other flags).
//
// Threading: quant_matvec splits the rows into tasks of kRowsPerTask rows, a count fixed
// by the shape only, and runs them on the executor of exec::Host (kvkit::ThreadPool);
// every row is computed by the same code whatever thread runs it, so outputs are bitwise
// identical for any thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/kernels/cpu/simd.hpp"

#if !defined(KVKIT_SIMD_PORTABLE) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KVKIT_QMV_VNNI 1
#define KVKIT_QMV_NS qmv_avx512vnni
#elif !defined(KVKIT_SIMD_PORTABLE) && defined(__AVX2__)
#define KVKIT_QMV_AVX2 1
#define KVKIT_QMV_NS qmv_avx2
#else
#define KVKIT_QMV_SCALAR 1
#define KVKIT_QMV_NS qmv_portable
#endif
#if !defined(KVKIT_QMV_SCALAR) || (defined(__F16C__) && !defined(KVKIT_SIMD_PORTABLE))
#include <immintrin.h>
#endif

namespace kvkit {
namespace engine {

/// Storage format of a weight matrix (GGML block layouts).
enum class QuantFormat : unsigned char { kF32, kF16, kQ8_0, kQ4_0, kQ4_1 };

/// "F32", "F16", "Q8_0", "Q4_0", "Q4_1".
inline const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kF32: return "F32";
    case QuantFormat::kF16: return "F16";
    case QuantFormat::kQ8_0: return "Q8_0";
    case QuantFormat::kQ4_0: return "Q4_0";
    case QuantFormat::kQ4_1: return "Q4_1";
  }
  return "?";
}

/// Elements per block and bytes per block of a format (F32/F16: one element).
inline int quant_block_elems(QuantFormat f) { return f == QuantFormat::kF32 || f == QuantFormat::kF16 ? 1 : 32; }
inline int quant_block_bytes(QuantFormat f) {
  switch (f) {
    case QuantFormat::kF32: return 4;
    case QuantFormat::kF16: return 2;
    case QuantFormat::kQ8_0: return 34;
    case QuantFormat::kQ4_0: return 18;
    case QuantFormat::kQ4_1: return 20;
  }
  return 0;
}

/// A non-owning row-major matrix [rows, cols] in one of the formats; row r starts at
/// data + r * row_bytes. cols is a multiple of 32 for the block formats.
struct QMatrix {
  QuantFormat format = QuantFormat::kF32;
  std::int32_t rows = 0;
  std::int32_t cols = 0;
  const unsigned char* data = nullptr;  // [rows * row_bytes]
  std::size_t row_bytes = 0;

  /// Validates the geometry (throws kvkit::Error naming `what`).
  static QMatrix make(QuantFormat f, std::int32_t rows, std::int32_t cols, const void* data /* [rows * row bytes] */,
                      const char* what = "matrix") {
    KVKIT_CHECK(rows > 0 && cols > 0 && cols % quant_block_elems(f) == 0 && data != nullptr,
                "kvkit: quantized ", what, " [", rows, ", ", cols, "] of ", quant_format_name(f),
                ": cols must be a positive multiple of ", quant_block_elems(f));
    QMatrix m;
    m.format = f;
    m.rows = rows;
    m.cols = cols;
    m.data = static_cast<const unsigned char*>(data);
    m.row_bytes = static_cast<std::size_t>(cols / quant_block_elems(f)) * quant_block_bytes(f);
    return m;
  }
  const unsigned char* row(std::int32_t r) const { return data + static_cast<std::size_t>(r) * row_bytes; }
};

/// One quantized activation block of 32 values (see the file comment).
struct Q8Act {
  float d = 0.f;          // fp16-rounded scale
  float s = 0.f;          // fp16-rounded scale * sum (the Q4_1 offset term)
  std::int32_t sum = 0;   // sum of q (exact)
  std::int32_t pad = 0;
  alignas(16) std::int8_t q[32] = {};
};

/// An activation vector [n] as float and as Q8 blocks (n / 32 of them).
struct QActivation {
  const float* x = nullptr;   // [n]
  const Q8Act* q = nullptr;   // [n / 32]
  std::int32_t n = 0;
};

/// The projections of one llama layer and the classifier, as quantized views.
struct QuantLayer {
  QMatrix wq, wk, wv, wo, w1, w2, w3;  // w1 = gate, w2 = down, w3 = up
};
struct QuantWeights {
  std::vector<QuantLayer> layers;  // [n_layers]
  QMatrix classifier;              // [vocab, dim]
  std::shared_ptr<const void> owner;  // keeps the matrices' bytes (the mapped file) alive
};

namespace detail {

inline float fp16_round(float x) { return kvkit::detail::half_bits_to_float(kvkit::detail::float_to_half_bits(x)); }
// An fp16 scale of a block (F16C when the build has it: the scalar converter is not inlined).
inline float f16_at(const unsigned char* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(KVKIT_SIMD_PORTABLE)
  return _cvtsh_ss(h);
#else
  return kvkit::detail::half_bits_to_float(h);
#endif
}

}  // namespace detail

/// Quantizes x [n] (n a multiple of 32) into n / 32 Q8Act blocks; the same on every path
/// (round half to even in the default floating-point environment).
inline void quantize_activation(const float* x /* [n] */, std::int32_t n, Q8Act* out /* [n / 32] */) {
  for (std::int32_t b = 0; b < n / 32; ++b) {
    const float* v = x + static_cast<std::size_t>(b) * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    Q8Act& a = out[b];
    std::int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * id));
      a.q[j] = static_cast<std::int8_t>(q);
      sum += q;
    }
    a.sum = sum;
    a.d = detail::fp16_round(d);
    a.s = detail::fp16_round(d * static_cast<float>(sum));
  }
}

inline namespace KVKIT_QMV_NS {

/// Name of the compiled-in path: "avx512vnni", "avx2" or "portable".
inline const char* quant_isa() {
#if defined(KVKIT_QMV_VNNI)
  return "avx512vnni";
#elif defined(KVKIT_QMV_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

#if !defined(KVKIT_QMV_SCALAR)
namespace qdetail {

// 32 unsigned nibbles of a Q4 block (element order) from its 16 bytes.
inline __m256i nibbles(const unsigned char* qs /* [16] */) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, m);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// 8 int32 partial sums of u[j] * s[j] (u unsigned, s signed bytes), exact.
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(KVKIT_QMV_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 8 int32 partial sums of w[j] * a[j] for signed w (|w| * sign(a, w): no overflow, exact).
inline __m256i dot_ss(__m256i w, __m256i a) {
  return dot_us(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
}

// Q4_0's signed values nibble - 8 (in [-8, 7]).
inline __m256i nibbles_q4_0(const unsigned char* qs /* [16] */) {
  return _mm256_sub_epi8(nibbles(qs), _mm256_set1_epi8(8));
}

inline __m256i load_act(const Q8Act& a) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q)); }

#if defined(KVKIT_QMV_VNNI)
// Two blocks' 32-byte quants in one 512-bit vector (lanes 0-7: first block).
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// 16 int32 partial sums of w * a for two blocks; w unsigned (Q4_1) or signed.
template <bool kSigned>
inline __m512i dot2(__m512i w, __m512i a) {
  if (kSigned) {
    a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);  // sign(a, w)
    w = _mm512_abs_epi8(w);
  }
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
}

// acc += float(i) * (s0 in lanes 0-7, s1 in lanes 8-15).
inline __m512 fma2(__m512i i, float s0, float s1, __m512 acc) {
  const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, acc);
}
#endif

inline std::int32_t hsum_i32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
  return _mm_cvtsi128_si32(x);
}

inline float hsum_ps(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

}  // namespace qdetail
#endif

/// The exact integer part of one block's dot: sum_j w_j q_j with w the block's signed
/// values before scaling (Q8_0: w; Q4_0: nibble - 8; Q4_1: nibble). For tests.
inline std::int32_t block_dot_int(QuantFormat f, const unsigned char* blk /* [block bytes] */, const Q8Act& a) {
#if !defined(KVKIT_QMV_SCALAR)
  using namespace qdetail;
  switch (f) {
    case QuantFormat::kQ8_0:
      return hsum_i32(dot_ss(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), load_act(a)));
    case QuantFormat::kQ4_0: return hsum_i32(dot_ss(nibbles_q4_0(blk + 2), load_act(a)));
    case QuantFormat::kQ4_1: return hsum_i32(dot_us(nibbles(blk + 4), load_act(a)));
    default: break;
  }
#else
  // Widen to a small int array first: the plain loop below vectorizes (SSE2 pmaddwd).
  std::int8_t w[32];
  switch (f) {
    case QuantFormat::kQ8_0: std::memcpy(w, blk + 2, 32); break;
    case QuantFormat::kQ4_0:
    case QuantFormat::kQ4_1: {
      const unsigned char* qs = blk + (f == QuantFormat::kQ4_0 ? 2 : 4);
      const int off = f == QuantFormat::kQ4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        w[j] = static_cast<std::int8_t>((qs[j] & 0x0f) - off);
        w[j + 16] = static_cast<std::int8_t>((qs[j] >> 4) - off);
      }
      break;
    }
    default: fail("kvkit: block_dot_int: ", quant_format_name(f), " has no blocks");
  }
  std::int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += static_cast<std::int16_t>(w[j]) * static_cast<std::int16_t>(a.q[j]);
  return s;
#endif
#if !defined(KVKIT_QMV_SCALAR)
  fail("kvkit: block_dot_int: ", quant_format_name(f), " has no blocks");
#endif
}

/// Row r of w times the activation (see the file comment for the formula).
inline float row_dot(const QMatrix& w, std::int32_t r, const QActivation& a) {
  const unsigned char* p = w.row(r);
  const std::int32_t nb = w.cols / 32;
  switch (w.format) {
    case QuantFormat::kF32:
      return kvkit::detail::cpu::dot(a.x, reinterpret_cast<const float*>(p), w.cols);
    case QuantFormat::kF16:
      return kvkit::detail::cpu::dot(a.x, reinterpret_cast<const half_t*>(p), w.cols);
    default: break;
  }
#if !defined(KVKIT_QMV_SCALAR)
  using namespace qdetail;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float extra = 0.f;  // the per-block offset terms of Q4_1 (mw * s)
  std::int32_t b = 0;
  const Q8Act* q = a.q;
  switch (w.format) {
    case QuantFormat::kQ8_0: {
#if defined(KVKIT_QMV_VNNI)
      __m512 acc = _mm512_setzero_ps();
      for (; b + 2 <= nb; b += 2, p += 68) {
        const __m512i wv = join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)));
        acc = fma2(dot2<true>(wv, join(load_act(q[b]), load_act(q[b + 1]))), detail::f16_at(p) * q[b].d,
                   detail::f16_at(p + 34) * q[b + 1].d, acc);
      }
      acc0 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#endif
      for (; b + 2 <= nb; b += 2, p += 68) {
        const __m256i i0 = dot_ss(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), load_act(q[b]));
        const __m256i i1 = dot_ss(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)), load_act(q[b + 1]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(detail::f16_at(p) * q[b].d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(detail::f16_at(p + 34) * q[b + 1].d), acc1);
      }
      for (; b < nb; ++b, p += 34) {
        const __m256i i0 = dot_ss(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), load_act(q[b]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(detail::f16_at(p) * q[b].d), acc0);
      }
      break;
    }
    case QuantFormat::kQ4_0: {
#if defined(KVKIT_QMV_VNNI)
      __m512 acc = _mm512_setzero_ps();
      for (; b + 2 <= nb; b += 2, p += 36) {
        const __m512i wv = join(nibbles_q4_0(p + 2), nibbles_q4_0(p + 20));
        acc = fma2(dot2<true>(wv, join(load_act(q[b]), load_act(q[b + 1]))), detail::f16_at(p) * q[b].d,
                   detail::f16_at(p + 18) * q[b + 1].d, acc);
      }
      acc0 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#endif
      for (; b < nb; ++b, p += 18) {
        const __m256i i0 = dot_ss(nibbles_q4_0(p + 2), load_act(q[b]));
        const __m256 sc = _mm256_set1_ps(detail::f16_at(p) * q[b].d);
        if (b & 1)
          acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), sc, acc1);
        else
          acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), sc, acc0);
      }
      break;
    }
    case QuantFormat::kQ4_1: {
#if defined(KVKIT_QMV_VNNI)
      __m512 acc = _mm512_setzero_ps();
      for (; b + 2 <= nb; b += 2, p += 40) {
        const __m512i wv = join(nibbles(p + 4), nibbles(p + 24));
        acc = fma2(dot2<false>(wv, join(load_act(q[b]), load_act(q[b + 1]))), detail::f16_at(p) * q[b].d,
                   detail::f16_at(p + 20) * q[b + 1].d, acc);
        extra += detail::f16_at(p + 2) * q[b].s + detail::f16_at(p + 22) * q[b + 1].s;
      }
      acc0 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#endif
      for (; b + 2 <= nb; b += 2, p += 40) {
        const __m256i i0 = dot_us(nibbles(p + 4), load_act(q[b]));
        const __m256i i1 = dot_us(nibbles(p + 24), load_act(q[b + 1]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(detail::f16_at(p) * q[b].d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(detail::f16_at(p + 20) * q[b + 1].d), acc1);
        extra += detail::f16_at(p + 2) * q[b].s + detail::f16_at(p + 22) * q[b + 1].s;
      }
      for (; b < nb; ++b, p += 20) {
        const __m256i i0 = dot_us(nibbles(p + 4), load_act(q[b]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(detail::f16_at(p) * q[b].d), acc0);
        extra += detail::f16_at(p + 2) * q[b].s;
      }
      break;
    }
    default: break;
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1)) + extra;
#else
  float acc = 0.f, extra = 0.f;
  const int bb = quant_block_bytes(w.format);
  for (std::int32_t b = 0; b < nb; ++b, p += bb) {
    const std::int32_t i = block_dot_int(w.format, p, a.q[b]);
    acc += static_cast<float>(i) * (detail::f16_at(p) * a.q[b].d);
    if (w.format == QuantFormat::kQ4_1) extra += detail::f16_at(p + 2) * a.q[b].s;
  }
  return acc + extra;
#endif
}

#if !defined(KVKIT_QMV_SCALAR)
namespace qdetail {

// Rows per register block of quant_matmul's SIMD path (AVX-512 has 32 vector registers:
// 2 rows x kMmTokens tokens of accumulators fit; AVX2's 16 hold one row's).
#if defined(KVKIT_QMV_VNNI)
inline constexpr int kMmRows = 2;
#else
inline constexpr int kMmRows = 1;
#endif
// Tokens per register block of quant_matmul's SIMD path.
inline constexpr int kMmTokens = 4;

// y[k * ldy + i] = row_dot(w, r0 + i, acts[k]) for i < NR, k < NT, bit for bit: each weight
// block is loaded and unpacked once (nibbles, |w| and sign mask, fp16 scales) and dotted
// with NT tokens' blocks, and each activation block with NR rows. Per (row, token) the
// float operations are row_dot's in its order: the same per-lane accumulators over the
// same blocks (the scale products dw * d are the same single float products, taken lane
// by lane), the same horizontal sum, then + extra. The integer sums are exact.
template <int NR, int NT>
inline void row_dot_block(const QMatrix& w, std::int32_t r0, const QActivation* acts /* [NT] */,
                          float* y /* [(NT - 1) * ldy + NR] */, std::size_t ldy) {
  const std::int32_t nb = w.cols / 32;
  const Q8Act* q[NT];
  for (int k = 0; k < NT; ++k) q[k] = acts[k].q;
  const unsigned char* p[NR];
  for (int i = 0; i < NR; ++i) p[i] = w.row(r0 + i);
  __m256 acc0[NR][NT], acc1[NR][NT];
  float extra[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int k = 0; k < NT; ++k) {
      acc0[i][k] = _mm256_setzero_ps();
      acc1[i][k] = _mm256_setzero_ps();
      extra[i][k] = 0.f;
    }
  std::int32_t b = 0;
  const int bb = quant_block_bytes(w.format);
#if defined(KVKIT_QMV_VNNI)
  // Two blocks per 512-bit vector, as row_dot: acc (16 lanes) over the pairs, folded into
  // acc0; the odd last block goes to acc0 below.
  {
    __m512 acc[NR][NT];
    for (int i = 0; i < NR; ++i)
      for (int k = 0; k < NT; ++k) acc[i][k] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
      __m512i av[NT];
      __m512 dv[NT];
      for (int k = 0; k < NT; ++k) {
        av[k] = join(load_act(q[k][b]), load_act(q[k][b + 1]));
        dv[k] = _mm512_insertf32x8(_mm512_set1_ps(q[k][b].d), _mm256_set1_ps(q[k][b + 1].d), 1);
      }
      for (int i = 0; i < NR; ++i) {
        const unsigned char* pb = p[i] + static_cast<std::size_t>(b) * bb;
        const unsigned char* pc = pb + bb;
        const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(detail::f16_at(pb)), _mm256_set1_ps(detail::f16_at(pc)), 1);
        if (w.format == QuantFormat::kQ4_1) {
          const __m512i wv = join(nibbles(pb + 4), nibbles(pc + 4));
          const float m0 = detail::f16_at(pb + 2), m1 = detail::f16_at(pc + 2);
          for (int k = 0; k < NT; ++k) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, av[k]);
            acc[i][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, dv[k]), acc[i][k]);
            extra[i][k] += m0 * q[k][b].s + m1 * q[k][b + 1].s;
          }
        } else {
          const __m512i wv = w.format == QuantFormat::kQ8_0
                                 ? join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 2)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + 2)))
                                 : join(nibbles_q4_0(pb + 2), nibbles_q4_0(pc + 2));
          const __mmask64 neg = _mm512_movepi8_mask(wv);
          const __m512i wabs = _mm512_abs_epi8(wv);
          for (int k = 0; k < NT; ++k) {
            const __m512i as = _mm512_mask_sub_epi8(av[k], neg, _mm512_setzero_si512(), av[k]);
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, as);
            acc[i][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, dv[k]), acc[i][k]);
          }
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int k = 0; k < NT; ++k)
        acc0[i][k] = _mm256_add_ps(_mm512_castps512_ps256(acc[i][k]), _mm512_extractf32x8_ps(acc[i][k], 1));
  }
#else
  // One block per 256-bit vector, as row_dot: Q8_0 and Q4_1 pairs to (acc0, acc1), Q4_0
  // even blocks to acc0 and odd ones to acc1; the odd last block goes to acc0 below.
  for (; b + 2 <= nb; b += 2) {
    __m256i a0[NT], a1[NT];
    for (int k = 0; k < NT; ++k) {
      a0[k] = load_act(q[k][b]);
      a1[k] = load_act(q[k][b + 1]);
    }
    for (int i = 0; i < NR; ++i) {
      const unsigned char* pb = p[i] + static_cast<std::size_t>(b) * bb;
      const unsigned char* pc = pb + bb;
      const float dw0 = detail::f16_at(pb), dw1 = detail::f16_at(pc);
      if (w.format == QuantFormat::kQ4_1) {
        const __m256i w0 = nibbles(pb + 4), w1 = nibbles(pc + 4);
        const float m0 = detail::f16_at(pb + 2), m1 = detail::f16_at(pc + 2);
        for (int k = 0; k < NT; ++k) {
          const __m256i i0 = dot_us(w0, a0[k]), i1 = dot_us(w1, a1[k]);
          acc0[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(dw0 * q[k][b].d), acc0[i][k]);
          acc1[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(dw1 * q[k][b + 1].d), acc1[i][k]);
          extra[i][k] += m0 * q[k][b].s + m1 * q[k][b + 1].s;
        }
      } else {
        const __m256i w0 = w.format == QuantFormat::kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 2))
                                                          : nibbles_q4_0(pb + 2);
        const __m256i w1 = w.format == QuantFormat::kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + 2))
                                                          : nibbles_q4_0(pc + 2);
        const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
        for (int k = 0; k < NT; ++k) {
          const __m256i i0 = dot_us(u0, _mm256_sign_epi8(a0[k], w0));
          const __m256i i1 = dot_us(u1, _mm256_sign_epi8(a1[k], w1));
          acc0[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(dw0 * q[k][b].d), acc0[i][k]);
          acc1[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(dw1 * q[k][b + 1].d), acc1[i][k]);
        }
      }
    }
  }
#endif
  if (b < nb) {  // the odd last block (b even): acc0 on every path and format
    for (int i = 0; i < NR; ++i) {
      const unsigned char* pb = p[i] + static_cast<std::size_t>(b) * bb;
      const float dw = detail::f16_at(pb);
      if (w.format == QuantFormat::kQ4_1) {
        const __m256i w0 = nibbles(pb + 4);
        const float m = detail::f16_at(pb + 2);
        for (int k = 0; k < NT; ++k) {
          const __m256i i0 = dot_us(w0, load_act(q[k][b]));
          acc0[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(dw * q[k][b].d), acc0[i][k]);
          extra[i][k] += m * q[k][b].s;
        }
      } else {
        const __m256i w0 = w.format == QuantFormat::kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 2))
                                                          : nibbles_q4_0(pb + 2);
        for (int k = 0; k < NT; ++k) {
          const __m256i i0 = dot_ss(w0, load_act(q[k][b]));
          acc0[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(dw * q[k][b].d), acc0[i][k]);
        }
      }
    }
  }
  for (int k = 0; k < NT; ++k)
    for (int i = 0; i < NR; ++i)
      y[static_cast<std::size_t>(k) * ldy + static_cast<std::size_t>(i)] =
          hsum_ps(_mm256_add_ps(acc0[i][k], acc1[i][k])) + extra[i][k];
}

}  // namespace qdetail
#endif

}  // namespace KVKIT_QMV_NS

/// Rows per task of quant_matvec (fixed: the split depends on the shape only).
inline constexpr std::int32_t kRowsPerTask = 32;

/// One product of a fused call: y [w.rows] = w * activation.
struct QMatvecOut {
  const QMatrix* w = nullptr;
  float* y = nullptr;  // [w->rows]
};

/// y_i = w_i * a for up to `n` matrices sharing one activation (e.g. q, k, v), as one job
/// of ceil(rows / kRowsPerTask) tasks per matrix on ex's executor (inline when ex has no
/// executor or one thread). Allocation-free.
inline void quant_matvec(exec::Host ex, const QMatvecOut* outs /* [n] */, int n, const QActivation& a) {
  struct Job {
    const QMatvecOut* outs;
    int n;
    const QActivation* a;
    int first[9];  // first task of each matrix, [n + 1]
  } job{outs, n, &a, {}};
  KVKIT_CHECK(n >= 1 && n <= 8, "kvkit: quant_matvec of ", n, " matrices (1 to 8)");
  for (int i = 0; i < n; ++i) {
    KVKIT_CHECK(outs[i].w->cols == a.n, "kvkit: quant_matvec: matrix of ", outs[i].w->cols,
                " columns times a vector of ", a.n);
    job.first[i + 1] = job.first[i] + (outs[i].w->rows + kRowsPerTask - 1) / kRowsPerTask;
  }
  auto task = [](void* arg, int t) {
    const Job& j = *static_cast<const Job*>(arg);
    int i = 0;
    while (t >= j.first[i + 1]) ++i;
    const QMatrix& w = *j.outs[i].w;
    const std::int32_t r0 = (t - j.first[i]) * kRowsPerTask, r1 = std::min(w.rows, r0 + kRowsPerTask);
    float* y = j.outs[i].y;
    for (std::int32_t r = r0; r < r1; ++r) y[r] = row_dot(w, r, *j.a);
  };
  const int tasks = job.first[n];
  if (ex.threads > 1 && ex.executor) {
    ex.executor.run(ex.executor.ctx, tasks, task, &job);
  } else {
    for (int t = 0; t < tasks; ++t) task(&job, t);
  }
}

/// Tokens per task of quant_matmul (fixed: the split depends on the shape only).
inline constexpr std::int32_t kTokensPerTask = 64;

/// Batched form of quant_matvec for prefill: for each of `n` matrices sharing the T
/// activations acts[0, T) (e.g. q, k, v of T prompt tokens), y_i[t * rows_i + r] =
/// row_dot(w_i, r, acts[t]): column t of y_i is token t's product. Every output is the
/// same row_dot decode computes for that token alone, so prefill and token-by-token decode
/// agree bitwise on the projections. Tasks are (matrix, block of kRowsPerTask rows, block
/// of kTokensPerTask tokens), a split fixed by the shape: the rows of a task (a few KB of
/// quantized blocks) stay in cache while every token of its block passes over them, so the
/// weights are streamed from memory about once per kTokensPerTask tokens instead of once
/// per token, and outputs are bitwise identical for any thread count. Within a task each
/// weight block is unpacked once for several tokens: register blocks of 2 (AVX-512 VNNI) or
/// 1 (AVX2) rows x 4 tokens on the SIMD paths (qdetail::row_dot_block), all the task's
/// tokens on the portable path. Allocation-free.
inline void quant_matmul(exec::Host ex, const QMatvecOut* outs /* [n] */, int n,
                         const QActivation* acts /* [T] */, std::int32_t T) {
  struct Job {
    const QMatvecOut* outs;
    int n;
    const QActivation* acts;
    std::int32_t T, tok_blocks;
    int first[9];  // first task of each matrix, [n + 1]
  } job{outs, n, acts, T, (T + kTokensPerTask - 1) / kTokensPerTask, {}};
  KVKIT_CHECK(n >= 1 && n <= 8, "kvkit: quant_matmul of ", n, " matrices (1 to 8)");
  KVKIT_CHECK(T >= 0, "kvkit: quant_matmul of ", T, " tokens");
  if (T == 0) return;
  for (int i = 0; i < n; ++i) {
    for (std::int32_t t = 0; t < T; ++t)
      KVKIT_CHECK(outs[i].w->cols == acts[t].n, "kvkit: quant_matmul: matrix of ", outs[i].w->cols,
                  " columns times a vector of ", acts[t].n);
    job.first[i + 1] = job.first[i] + (outs[i].w->rows + kRowsPerTask - 1) / kRowsPerTask * job.tok_blocks;
  }
  auto task = [](void* arg, int t) {
    const Job& j = *static_cast<const Job*>(arg);
    int i = 0;
    while (t >= j.first[i + 1]) ++i;
    const QMatrix& w = *j.outs[i].w;
    const int local = t - j.first[i];
    const std::int32_t r0 = (local / j.tok_blocks) * kRowsPerTask, r1 = std::min(w.rows, r0 + kRowsPerTask);
    const std::int32_t t0 = (local % j.tok_blocks) * kTokensPerTask, t1 = std::min(j.T, t0 + kTokensPerTask);
    float* y = j.outs[i].y;
#if defined(KVKIT_QMV_SCALAR)
    if (w.format != QuantFormat::kF32 && w.format != QuantFormat::kF16) {
      // Portable path: unpacking a block's nibbles costs more than its integer dot, so each
      // weight block is unpacked once and dotted with every token of the task. Per token
      // the float operations are row_dot's, in its order (acc over blocks, then + extra).
      const std::int32_t nb = w.cols / 32, nt = t1 - t0;
      const int bb = quant_block_bytes(w.format);
      for (std::int32_t r = r0; r < r1; ++r) {
        float acc[kTokensPerTask] = {}, extra[kTokensPerTask] = {};
        const unsigned char* p = w.row(r);
        for (std::int32_t b = 0; b < nb; ++b, p += bb) {
          std::int16_t wv[32];
          if (w.format == QuantFormat::kQ8_0) {
            for (int e = 0; e < 32; ++e) wv[e] = static_cast<std::int8_t>(p[2 + e]);
          } else {
            const unsigned char* qs = p + (w.format == QuantFormat::kQ4_0 ? 2 : 4);
            const int off = w.format == QuantFormat::kQ4_0 ? 8 : 0;
            for (int e = 0; e < 16; ++e) {
              wv[e] = static_cast<std::int16_t>((qs[e] & 0x0f) - off);
              wv[e + 16] = static_cast<std::int16_t>((qs[e] >> 4) - off);
            }
          }
          const float dw = detail::f16_at(p);
          const float mw = w.format == QuantFormat::kQ4_1 ? detail::f16_at(p + 2) : 0.f;
          for (std::int32_t k = 0; k < nt; ++k) {
            const Q8Act& a = j.acts[t0 + k].q[b];
            std::int32_t dot = 0;
            for (int e = 0; e < 32; ++e) dot += wv[e] * static_cast<std::int16_t>(a.q[e]);
            acc[k] += static_cast<float>(dot) * (dw * a.d);
            if (w.format == QuantFormat::kQ4_1) extra[k] += mw * a.s;
          }
        }
        for (std::int32_t k = 0; k < nt; ++k)
          y[static_cast<std::size_t>(t0 + k) * static_cast<std::size_t>(w.rows) + r] = acc[k] + extra[k];
      }
      return;
    }
#else
    if (w.format != QuantFormat::kF32 && w.format != QuantFormat::kF16) {
      // SIMD paths: register blocks of kMmRows rows x kMmTokens tokens (row_dot_block), so
      // each weight block is unpacked once per kMmTokens tokens; the last rows and tokens
      // of a task that do not fill a block take the smaller forms. Bitwise row_dot.
      using qdetail::kMmRows;
      using qdetail::kMmTokens;
      const std::size_t ld = static_cast<std::size_t>(w.rows);
      std::int32_t tok = t0;
      for (; tok + kMmTokens <= t1; tok += kMmTokens) {
        float* yt = y + static_cast<std::size_t>(tok) * ld;
        std::int32_t r = r0;
        for (; r + kMmRows <= r1; r += kMmRows) qdetail::row_dot_block<kMmRows, kMmTokens>(w, r, j.acts + tok, yt + r, ld);
        for (; r < r1; ++r) qdetail::row_dot_block<1, kMmTokens>(w, r, j.acts + tok, yt + r, ld);
      }
      for (; tok < t1; ++tok) {
        float* yt = y + static_cast<std::size_t>(tok) * ld;
        std::int32_t r = r0;
        for (; r + kMmRows <= r1; r += kMmRows) qdetail::row_dot_block<kMmRows, 1>(w, r, j.acts + tok, yt + r, ld);
        for (; r < r1; ++r) yt[r] = row_dot(w, r, j.acts[tok]);
      }
      return;
    }
#endif
    for (std::int32_t tok = t0; tok < t1; ++tok) {
      float* yt = y + static_cast<std::size_t>(tok) * static_cast<std::size_t>(w.rows);
      for (std::int32_t r = r0; r < r1; ++r) yt[r] = row_dot(w, r, j.acts[tok]);
    }
  };
  const int tasks = job.first[n];
  if (ex.threads > 1 && ex.executor) {
    ex.executor.run(ex.executor.ctx, tasks, task, &job);
  } else {
    for (int t = 0; t < tasks; ++t) task(&job, t);
  }
}

/// Single-matrix convenience form of quant_matvec.
inline void quant_matvec(exec::Host ex, const QMatrix& w, const QActivation& a, float* y /* [w.rows] */) {
  const QMatvecOut o{&w, y};
  quant_matvec(ex, &o, 1, a);
}

}  // namespace engine
}  // namespace kvkit
