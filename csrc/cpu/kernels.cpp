// CPU kernels of lbcomm: portable scalar code plus AVX2 bodies chosen at run time.
// Each kernel works on one cache-sized unit at a time (a scale block, or kPartialBlock
// elements in single-scale mode): pass A writes y (or z) into error_out and reduces its
// squares, pass B re-reads that unit from cache, packs the sign bits and writes the error.
// No torch headers: the caller (ops.cpp) owns threading and validation.
#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LBCOMM_X86 1
#endif

namespace lbcomm {
namespace cpu {
namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    int shift = 0;  // subnormal half: normalize the mantissa
    while (!(man & 0x400u)) {
      man <<= 1;
      ++shift;
    }
    return bits_to_float(sign | (static_cast<uint32_t>(113 - shift) << 23) | ((man & 0x3ffu) << 13));
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

inline float load_x(const void* x, InType t, int64_t i) {
  switch (t) {
    case InType::F16: return half_to_float(static_cast<const uint16_t*>(x)[i]);
    case InType::BF16: return bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    default: return static_cast<const float*>(x)[i];
  }
}

inline float rms(double sumsq, int64_t count) {
  return count > 0 ? static_cast<float>(std::sqrt(sumsq / static_cast<double>(count))) : 0.0f;
}

inline int64_t clamp_real(int64_t numel, int64_t start, int64_t len) {
  const int64_t r = numel - start;
  return r <= 0 ? 0 : (r < len ? r : len);
}

// ---------------------------------------------------------------- scalar bodies
// y = x + e (x / w + e with weights) over [i0, real) of a unit starting at flat index
// `start`, into dst[i]; returns the sum of y^2.
double worker_y_scalar(const WorkerArgs& a, int64_t start, int64_t i0, int64_t real, float* dst) {
  double s = 0.0;
  for (int64_t i = i0; i < real; ++i) {
    float x = load_x(a.x, a.xtype, start + i);
    if (a.weights) x = x / load_x(a.weights, a.wtype, start + i);
    const float y = x + a.error[start + i];
    dst[i] = y;
    s += static_cast<double>(y) * y;
  }
  return s;
}

// ---- the capped decode (kernels.h): d_i = cap_i < scale ? cap_i : scale
inline float capped(float cap, float sc) { return cap < sc ? cap : sc; }

// z = (sum_j +-a_j) * inv_p + s over [i0, real) of a chunk-local unit at `start`; with
// kCapped every rank's value decoded under the cap (cap[i]: the unit's caps).
template <bool kCapped>
double server_z_scalar_t(const ServerArgs& a, int64_t start, int64_t i0, int64_t real, int64_t scale_col,
                         float inv_p, const float* cap) {
  double s = 0.0;
  for (int64_t i = i0; i < real; ++i) {
    const int64_t idx = start + i;
    float acc = 0.0f;
    for (int64_t j = 0; j < a.p; ++j) {
      const float sc = a.scales[j * a.scales_stride + scale_col];
      const float d = kCapped ? capped(cap[i], sc) : sc;
      const bool neg = (a.packed[j * a.packed_stride + (idx >> 3)] >> (idx & 7)) & 1;
      acc += neg ? -std::fabs(d) : d;  // the sign bit set, as the AVX2 body does
    }
    const float prod = acc * inv_p;  // separate rounding: -ffp-contract=off
    const float z = prod + a.error[idx];
    a.error_out[idx] = z;
    s += static_cast<double>(z) * z;
  }
  return s;
}
double server_z_scalar(const ServerArgs& a, int64_t start, int64_t i0, int64_t real, int64_t scale_col,
                       float inv_p) {
  return server_z_scalar_t<false>(a, start, i0, real, scale_col, inv_p, nullptr);
}
double server_z_capped_scalar(const ServerArgs& a, int64_t start, int64_t i0, int64_t real, int64_t scale_col,
                              float inv_p, const float* cap) {
  return server_z_scalar_t<true>(a, start, i0, real, scale_col, inv_p, cap);
}

// Pack signbit(v) for [i0, len) of a unit whose first element is bit 0 of out[0]
// (i0 % 8 == 0) and write the error v - copysign(scale, v) to err (which may be v);
// slots >= real get error 0 and bit 0.
void sign_pack_scalar(const float* v, float* err, uint8_t* out, int64_t i0, int64_t real, int64_t len, float scale) {
  for (int64_t w = i0; w < len; w += 8) {
    uint32_t byte = 0;
    for (int t = 0; t < 8; ++t) {
      const int64_t i = w + t;
      if (i < real) {
        const float y = v[i];
        byte |= static_cast<uint32_t>(std::signbit(y)) << t;
        err[i] = y - std::copysign(scale, y);
      } else {
        err[i] = 0.0f;
      }
    }
    out[w >> 3] = static_cast<uint8_t>(byte);
  }
}

inline float clamp_cap(float e, float cap) {
  const float b = kCapErrorRatio * cap;
  return e > b ? b : (e < -b ? -b : e);
}

// Sum of v^2 (float64) and count over [i0, real) where cap_i >= s1.
double masked_sq_scalar(const float* v, const float* cap, int64_t i0, int64_t real, float s1, int64_t& count) {
  double s = 0.0;
  for (int64_t i = i0; i < real; ++i) {
    if (cap[i] >= s1) {
      s += static_cast<double>(v[i]) * v[i];
      ++count;
    }
  }
  return s;
}

// sign_pack_scalar with the capped decode: err = clamp(v - copysign(d_i, v), +-3 cap_i).
void sign_pack_capped_scalar(const float* v, float* err, uint8_t* out, const float* cap, int64_t i0, int64_t real,
                             int64_t len, float scale) {
  for (int64_t w = i0; w < len; w += 8) {
    uint32_t byte = 0;
    for (int t = 0; t < 8; ++t) {
      const int64_t i = w + t;
      if (i < real) {
        const float y = v[i];
        byte |= static_cast<uint32_t>(std::signbit(y)) << t;
        err[i] = clamp_cap(y - std::copysign(capped(cap[i], scale), y), cap[i]);
      } else {
        err[i] = 0.0f;
      }
    }
    out[w >> 3] = static_cast<uint8_t>(byte);
  }
}

void unpack_capped_scalar(const uint8_t* bits, float* out, const float* cap, int64_t i0, int64_t i1, float sc) {
  for (int64_t i = i0; i < i1; ++i) {
    const float d = capped(cap[i], sc);
    out[i] = ((bits[i >> 3] >> (i & 7)) & 1) ? -std::fabs(d) : d;
  }
}

// Decode [i0, i1) of chunk row k, a range within one scale block (constant scale), times
// the weights w[woff + i] (of type wt) when given.
void unpack_scalar(const uint8_t* bits, float* out, int64_t i0, int64_t i1, float sc, const void* w, InType wt,
                   int64_t woff) {
  for (int64_t i = i0; i < i1; ++i) {
    const float v = ((bits[i >> 3] >> (i & 7)) & 1) ? -std::fabs(sc) : sc;
    out[i] = w ? v * load_x(w, wt, woff + i) : v;
  }
}

// ---------------------------------------------------------------- AVX2 bodies
#ifdef LBCOMM_X86
#define LBCOMM_AVX2 __attribute__((target("avx2,fma,f16c")))

LBCOMM_AVX2 inline __m256 load8(const void* x, InType t, int64_t i) {
  switch (t) {
    case InType::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i)));
    case InType::BF16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    default: return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  }
}

// Squares of 8 floats accumulated in float64: exact products, no overflow for any fp32.
LBCOMM_AVX2 inline void acc_sq(__m256 y, __m256d& lo, __m256d& hi) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
  lo = _mm256_fmadd_pd(a, a, lo);
  hi = _mm256_fmadd_pd(b, b, hi);
}

LBCOMM_AVX2 inline double hsum(__m256d lo, __m256d hi) {
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(lo, hi));
  return (t[0] + t[1]) + (t[2] + t[3]);
}

LBCOMM_AVX2 double worker_y_avx2(const WorkerArgs& a, int64_t start, int64_t real, float* dst) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= real; i += 8) {
    __m256 x = load8(a.x, a.xtype, start + i);
    if (a.weights) x = _mm256_div_ps(x, load8(a.weights, a.wtype, start + i));  // IEEE quotient, as scalar
    const __m256 y = _mm256_add_ps(x, _mm256_loadu_ps(a.error + start + i));
    _mm256_storeu_ps(dst + i, y);
    acc_sq(y, lo, hi);
  }
  return hsum(lo, hi) + worker_y_scalar(a, start, i, real, dst);
}

// kSignLut[byte] lane t = 0x80000000 iff bit t of byte is set: one load turns 8 packed
// signs into the sign bits to OR onto a scale (8 KiB, stays in L1 next to a block).
struct SignLut {
  alignas(32) uint32_t v[256][8];
  SignLut() {
    for (int b = 0; b < 256; ++b)
      for (int t = 0; t < 8; ++t) v[b][t] = ((b >> t) & 1) ? 0x80000000u : 0u;
  }
};
const SignLut kSignLut;

LBCOMM_AVX2 inline __m256 sign_bits(uint32_t byte) {
  return _mm256_load_ps(reinterpret_cast<const float*>(kSignLut.v[byte]));
}

LBCOMM_AVX2 inline void server_finish8(const ServerArgs& a, int64_t idx, __m256 acc, __m256 vinv, __m256d& lo,
                                       __m256d& hi) {
  const __m256 z = _mm256_add_ps(_mm256_mul_ps(acc, vinv), _mm256_loadu_ps(a.error + idx));
  _mm256_storeu_ps(a.error_out + idx, z);
  acc_sq(z, lo, hi);
}

// The p-way decode is the bottleneck (not memory), so 32 elements go per iteration: one
// 4-byte load per rank feeds four independent accumulators (ILP, less loop overhead).
// Each accumulator still sums ranks j = 0..p-1 in order from +0, as the reference does.
LBCOMM_AVX2 double server_z_avx2(const ServerArgs& a, int64_t start, int64_t real, int64_t scale_col, float inv_p) {
  const __m256 vinv = _mm256_set1_ps(inv_p);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  const int64_t p = a.p, pstride = a.packed_stride, sstride = a.scales_stride;
  const float* scales = a.scales + scale_col;
  int64_t i = 0;
  for (; i + 32 <= real; i += 32) {
    const int64_t idx = start + i;
    const uint8_t* bits = a.packed + (idx >> 3);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t j = 0; j < p; ++j) {
      uint32_t w;  // bits of elements idx .. idx + 31, LSB first
      std::memcpy(&w, bits + j * pstride, 4);
      // scales are >= +0, so OR-ing the sign bit gives -scale exactly where the bit is set
      const __m256 sc = _mm256_set1_ps(scales[j * sstride]);
      c0 = _mm256_add_ps(c0, _mm256_or_ps(sc, sign_bits(w & 0xffu)));
      c1 = _mm256_add_ps(c1, _mm256_or_ps(sc, sign_bits((w >> 8) & 0xffu)));
      c2 = _mm256_add_ps(c2, _mm256_or_ps(sc, sign_bits((w >> 16) & 0xffu)));
      c3 = _mm256_add_ps(c3, _mm256_or_ps(sc, sign_bits(w >> 24)));
    }
    server_finish8(a, idx, c0, vinv, lo, hi);
    server_finish8(a, idx + 8, c1, vinv, lo, hi);
    server_finish8(a, idx + 16, c2, vinv, lo, hi);
    server_finish8(a, idx + 24, c3, vinv, lo, hi);
  }
  // Only a chunk's last unit can end off a multiple of 32 (at numel).
  return hsum(lo, hi) + server_z_scalar(a, start, i, real, scale_col, inv_p);
}

inline bool aligned32(const float* p) { return (reinterpret_cast<uintptr_t>(p) & 31) == 0; }

LBCOMM_AVX2 void sign_pack_avx2(const float* v, float* err, uint8_t* out, int64_t real, int64_t len, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  // Errors going to another buffer than v are streamed: a normal store would first read
  // each line of that buffer (write-allocate), 4 more bytes of traffic per element.
  const bool stream = err != v && aligned32(err);
  int64_t i = 0;
  for (; i + 8 <= real; i += 8) {
    const __m256 y = _mm256_loadu_ps(v + i);
    out[i >> 3] = static_cast<uint8_t>(_mm256_movemask_ps(y));  // lane t -> bit t: LSB first
    // copysign(scale, y) for scale >= 0 is scale | signbit(y); a NaN scale stays NaN.
    const __m256 e = _mm256_sub_ps(y, _mm256_or_ps(vs, _mm256_and_ps(y, signmask)));
    if (stream) {
      _mm256_stream_ps(err + i, e);
    } else {
      _mm256_storeu_ps(err + i, e);
    }
  }
  sign_pack_scalar(v, err, out, i, real, len, scale);
}

LBCOMM_AVX2 void unpack_avx2(const uint8_t* bits, float* out, int64_t i0, int64_t i1, float sc, const void* w,
                             InType wt, int64_t woff, bool stream) {
  const __m256 vs = _mm256_set1_ps(sc);
  int64_t i = i0;  // i0 % 8 == 0: segments start on block or unit boundaries
  if (w) {
    for (; i + 8 <= i1; i += 8)
      _mm256_storeu_ps(out + i,
                       _mm256_mul_ps(_mm256_or_ps(vs, sign_bits(bits[i >> 3])), load8(w, wt, woff + i)));
  } else if (stream && aligned32(out + i)) {
    for (; i + 8 <= i1; i += 8) _mm256_stream_ps(out + i, _mm256_or_ps(vs, sign_bits(bits[i >> 3])));
  } else {
    for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(out + i, _mm256_or_ps(vs, sign_bits(bits[i >> 3])));
  }
  unpack_scalar(bits, out, i, i1, sc, w, wt, woff);
}

// ---- the capped decode, AVX2 (MINPS(a, b) is a < b ? a : b: the scalar `capped`)
LBCOMM_AVX2 double masked_sq_avx2(const float* v, const float* cap, int64_t real, float s1, int64_t& count) {
  const __m256 vs1 = _mm256_set1_ps(s1);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= real; i += 8) {
    const __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(cap + i), vs1, _CMP_GE_OQ);
    count += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(keep)));
    acc_sq(_mm256_and_ps(_mm256_loadu_ps(v + i), keep), lo, hi);
  }
  return hsum(lo, hi) + masked_sq_scalar(v, cap, i, real, s1, count);
}

// As server_z_avx2, 32 elements per iteration; each rank's value is min(cap, scale) with
// the sign bit OR-ed on, which is the scalar `neg ? -|d| : d` for every d (also d < 0).
LBCOMM_AVX2 double server_z_capped_avx2(const ServerArgs& a, int64_t start, int64_t real, int64_t scale_col,
                                        float inv_p, const float* cap) {
  const __m256 vinv = _mm256_set1_ps(inv_p);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  const int64_t p = a.p, pstride = a.packed_stride, sstride = a.scales_stride;
  const float* scales = a.scales + scale_col;
  int64_t i = 0;
  for (; i + 32 <= real; i += 32) {
    const int64_t idx = start + i;
    const uint8_t* bits = a.packed + (idx >> 3);
    const __m256 k0 = _mm256_loadu_ps(cap + i), k1 = _mm256_loadu_ps(cap + i + 8);
    const __m256 k2 = _mm256_loadu_ps(cap + i + 16), k3 = _mm256_loadu_ps(cap + i + 24);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t j = 0; j < p; ++j) {
      uint32_t w;
      std::memcpy(&w, bits + j * pstride, 4);
      const __m256 sc = _mm256_set1_ps(scales[j * sstride]);
      c0 = _mm256_add_ps(c0, _mm256_or_ps(_mm256_min_ps(k0, sc), sign_bits(w & 0xffu)));
      c1 = _mm256_add_ps(c1, _mm256_or_ps(_mm256_min_ps(k1, sc), sign_bits((w >> 8) & 0xffu)));
      c2 = _mm256_add_ps(c2, _mm256_or_ps(_mm256_min_ps(k2, sc), sign_bits((w >> 16) & 0xffu)));
      c3 = _mm256_add_ps(c3, _mm256_or_ps(_mm256_min_ps(k3, sc), sign_bits(w >> 24)));
    }
    server_finish8(a, idx, c0, vinv, lo, hi);
    server_finish8(a, idx + 8, c1, vinv, lo, hi);
    server_finish8(a, idx + 16, c2, vinv, lo, hi);
    server_finish8(a, idx + 24, c3, vinv, lo, hi);
  }
  return hsum(lo, hi) + server_z_capped_scalar(a, start, i, real, scale_col, inv_p, cap);
}

LBCOMM_AVX2 void sign_pack_capped_avx2(const float* v, float* err, uint8_t* out, const float* cap, int64_t real,
                                       int64_t len, float scale) {
  const __m256 vs = _mm256_set1_ps(scale), ratio = _mm256_set1_ps(kCapErrorRatio);
  const __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  int64_t i = 0;
  for (; i + 8 <= real; i += 8) {
    const __m256 y = _mm256_loadu_ps(v + i), c = _mm256_loadu_ps(cap + i);
    out[i >> 3] = static_cast<uint8_t>(_mm256_movemask_ps(y));
    // copysign(d, y) = |d| | signbit(y)
    const __m256 d = _mm256_andnot_ps(signmask, _mm256_min_ps(c, vs));
    const __m256 e = _mm256_sub_ps(y, _mm256_or_ps(d, _mm256_and_ps(y, signmask)));
    // e > b ? b : (e < -b ? -b : e); ordered compares leave a NaN as it is
    const __m256 b = _mm256_mul_ps(ratio, c), nb = _mm256_xor_ps(b, signmask);
    const __m256 low = _mm256_blendv_ps(e, nb, _mm256_cmp_ps(e, nb, _CMP_LT_OQ));
    _mm256_storeu_ps(err + i, _mm256_blendv_ps(low, b, _mm256_cmp_ps(e, b, _CMP_GT_OQ)));
  }
  sign_pack_capped_scalar(v, err, out, cap, i, real, len, scale);
}

// min(cap, scale) with the sign bit OR-ed on: the scalar `neg ? -|d| : d` (see above).
LBCOMM_AVX2 void unpack_capped_avx2(const uint8_t* bits, float* out, const float* cap, int64_t i0, int64_t i1,
                                    float sc, bool stream) {
  const __m256 vs = _mm256_set1_ps(sc);
  int64_t i = i0;
  if (stream && aligned32(out + i)) {
    for (; i + 8 <= i1; i += 8) {
      _mm256_stream_ps(out + i, _mm256_or_ps(_mm256_min_ps(_mm256_loadu_ps(cap + i), vs), sign_bits(bits[i >> 3])));
    }
  }
  for (; i + 8 <= i1; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_or_ps(_mm256_min_ps(_mm256_loadu_ps(cap + i), vs), sign_bits(bits[i >> 3])));
  }
  unpack_capped_scalar(bits, out, cap, i, i1, sc);
}
#endif  // LBCOMM_X86

// LBCOMM_DISABLE_AVX2=1 forces the portable path (the tests check both against the reference).
bool detect_avx2() {
#ifdef LBCOMM_X86
  const char* off = std::getenv("LBCOMM_DISABLE_AVX2");
  if (off && off[0] == '1') return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const bool kAvx2 = detect_avx2();

double worker_y(const WorkerArgs& a, int64_t start, int64_t real, float* dst) {
#ifdef LBCOMM_X86
  if (kAvx2) return worker_y_avx2(a, start, real, dst);
#endif
  return worker_y_scalar(a, start, 0, real, dst);
}

double server_z(const ServerArgs& a, int64_t start, int64_t real, int64_t scale_col, float inv_p) {
#ifdef LBCOMM_X86
  if (kAvx2) return server_z_avx2(a, start, real, scale_col, inv_p);
#endif
  return server_z_scalar(a, start, 0, real, scale_col, inv_p);
}

double server_z_capped(const ServerArgs& a, int64_t start, int64_t real, int64_t scale_col, float inv_p,
                       const float* cap) {
#ifdef LBCOMM_X86
  if (kAvx2) return server_z_capped_avx2(a, start, real, scale_col, inv_p, cap);
#endif
  return server_z_capped_scalar(a, start, 0, real, scale_col, inv_p, cap);
}

// The capped decode's block scale: the RMS over the coordinates with cap_i >= s1 (the
// block's RMS), or s1 when there is none.
float capped_scale(const float* v, const float* cap, int64_t real, float s1) {
  int64_t count = 0;
#ifdef LBCOMM_X86
  const double s = kAvx2 ? masked_sq_avx2(v, cap, real, s1, count) : masked_sq_scalar(v, cap, 0, real, s1, count);
#else
  const double s = masked_sq_scalar(v, cap, 0, real, s1, count);
#endif
  return count > 0 ? rms(s, count) : s1;
}

void sign_pack_capped(const float* v, float* err, uint8_t* out, const float* cap, int64_t real, int64_t len,
                      float scale) {
#ifdef LBCOMM_X86
  if (kAvx2) return sign_pack_capped_avx2(v, err, out, cap, real, len, scale);
#endif
  sign_pack_capped_scalar(v, err, out, cap, 0, real, len, scale);
}

void sign_pack(const float* v, float* err, uint8_t* out, int64_t real, int64_t len, float scale) {
#ifdef LBCOMM_X86
  if (kAvx2) return sign_pack_avx2(v, err, out, real, len, scale);
#endif
  sign_pack_scalar(v, err, out, 0, real, len, scale);
}

// Per-thread staging for one block's values (y), so the new error can go straight to a
// separate error_out buffer; blocks larger than this stage in error_out itself.
constexpr int64_t kStageMax = 16384;
float* stage_buffer() {
  alignas(64) thread_local float buf[kStageMax];
  return buf;
}

// The caps of a call's elements [start, start + real): a view of the caps buffer, or (a
// CapTable) computed into a per-thread buffer that the next unit reuses; nullptr: none.
const float* unit_caps(const float* cap, const CapTable& t, int64_t start, int64_t real) {
  if (cap) return cap + start;
  if (!t.v) return nullptr;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < real + 1) buf.resize(real + 1);  // never empty: nullptr means "no caps"
  table_caps(t, start, real, buf.data());
  return buf.data();
}

// A unit: [start, start + len) in flat (worker) or chunk-local (server) indices.
struct Unit {
  int64_t start, len, scale_index;
};

Unit worker_unit(const WorkerArgs& a, int64_t u) {
  if (a.block > 0) {
    const int64_t nb = num_blocks(a.m, a.block), k = u / nb, b = u % nb;
    const int64_t off = b * a.block, len = a.m - off < a.block ? a.m - off : a.block;
    return {k * a.m + off, len, u};
  }
  const int64_t start = u * kPartialBlock, n = a.p * a.m;
  return {start, n - start < kPartialBlock ? n - start : kPartialBlock, 0};
}

Unit server_unit(const ServerArgs& a, int64_t u) {
  const int64_t unit = a.block > 0 ? a.block : kPartialBlock;
  const int64_t start = u * unit;
  return {start, a.m - start < unit ? a.m - start : unit, a.block > 0 ? u : 0};
}

// One unit of either phase. Pass 0 writes the unit's values (y or z) into `vals` via
// `values(real)`, which returns their sum of squares; in block mode the scale follows at
// once and the unit is packed while in cache, its errors written to `err` (pads 0). In
// single-scale mode pass 0 only records the partial sum and pass 1 packs with the final
// scale (then vals is err: the values wait in error_out between the passes).
// `cap` (the unit's caps, or nullptr) selects the capped decode (block mode only).
template <class Values>
void run_unit(const Unit& un, int64_t u, int pass, int64_t real, int64_t block, const float* vals, float* err,
              uint8_t* packed, float* scales, double* partials, const float* cap, const Values& values) {
  if (pass == 0) {
    const double s = values(real);
    if (block == 0) {
      partials[u] = s;
      return;
    }
    scales[un.scale_index] = cap ? capped_scale(vals, cap, real, rms(s, real)) : rms(s, real);
  }
  if (cap) {
    sign_pack_capped(vals, err, packed + (un.start >> 3), cap, real, un.len, scales[un.scale_index]);
  } else {
    sign_pack(vals, err, packed + (un.start >> 3), real, un.len, scales[un.scale_index]);
  }
}

}  // namespace

bool has_avx2() { return kAvx2; }

int64_t worker_units(const WorkerArgs& a) {
  return a.block > 0 ? a.p * num_blocks(a.m, a.block) : ceil_div(a.p * a.m, kPartialBlock);
}
int worker_num_passes(const WorkerArgs& a) { return a.block > 0 ? 1 : 2; }

// Block mode: pass 0 does everything per block. Single-scale mode: pass 0 writes y and
// the partial sums, the caller reduces them (finish_single_scale), pass 1 packs.
void worker_pass(const WorkerArgs& a, int pass, int64_t begin, int64_t end) {
  const bool stage = a.block > 0 && a.block <= kStageMax && a.error_out != a.error;
  for (int64_t u = begin; u < end; ++u) {
    const Unit un = worker_unit(a, u);
    float* err = a.error_out + un.start;
    float* vals = stage ? stage_buffer() : err;
    const int64_t real = clamp_real(a.numel, un.start, un.len);
    run_unit(un, u, pass, real, a.block, vals, err, a.packed, a.scales, a.partials,
             unit_caps(a.cap, a.ctab, un.start, real), [&](int64_t r) { return worker_y(a, un.start, r, vals); });
  }
#ifdef LBCOMM_X86
  // Streamed (non-temporal) stores are weakly ordered: fence once per range, not per unit.
  if (stage) _mm_sfence();
#endif
}

void finish_single_scale(double* partials, int64_t count, int64_t real, float* scales, int64_t n_out) {
  double s = 0.0;
  for (int64_t i = 0; i < count; ++i) s += partials[i];  // fixed order: thread-count independent
  const float r = rms(s, real);
  for (int64_t i = 0; i < n_out; ++i) scales[i] = r;
}

int64_t server_units(const ServerArgs& a) { return ceil_div(a.m, a.block > 0 ? a.block : kPartialBlock); }
int server_num_passes(const ServerArgs& a) { return a.block > 0 ? 1 : 2; }

void server_pass(const ServerArgs& a, int pass, int64_t begin, int64_t end) {
  const float inv_p = 1.0f / static_cast<float>(a.p);
  for (int64_t u = begin; u < end; ++u) {
    const Unit un = server_unit(a, u);
    float* err = a.error_out + un.start;
    const int64_t real = clamp_real(a.numel, un.start, un.len);
    const float* cap = unit_caps(a.cap, a.ctab, un.start, real);
    run_unit(un, u, pass, real, a.block, err, err, a.packed_out, a.scales_out, a.partials, cap, [&](int64_t r) {
      return cap ? server_z_capped(a, un.start, r, un.scale_index, inv_p, cap)
                 : server_z(a, un.start, r, un.scale_index, inv_p);
    });
  }
}

constexpr int64_t kStreamMin = int64_t{1} << 20;  // elements (4 MiB of output): streamed stores from here

// Units of kPartialBlock elements per chunk row, chunk-major.
int64_t unpack_units(const UnpackArgs& a) { return a.p * ceil_div(a.m, kPartialBlock); }

void unpack_range(const UnpackArgs& a, int64_t begin, int64_t end) {
  const int64_t per_row = ceil_div(a.m, kPartialBlock);
  // Outputs larger than a core's caches are streamed (written without first reading each
  // line); smaller ones are written normally, so a reader right after finds them in cache.
  const bool stream = a.numel >= kStreamMin;
  (void)stream;  // x86 only
  for (int64_t u = begin; u < end; ++u) {
    const int64_t k = u / per_row, i0 = (u % per_row) * kPartialBlock;
    int64_t i1 = i0 + kPartialBlock < a.m ? i0 + kPartialBlock : a.m;
    const int64_t limit = a.numel - k * a.m;  // the output stops at numel
    if (limit <= i0) continue;
    if (limit < i1) i1 = limit;
    const uint8_t* bits = a.packed + k * a.packed_stride;
    float* out = a.out + k * a.m;
    for (int64_t s0 = i0; s0 < i1;) {  // segments of constant scale
      const int64_t b = a.block > 0 ? s0 / a.block : 0;
      const int64_t s1 = a.block > 0 ? std::min(i1, (b + 1) * a.block) : i1;
      const float sc = a.scales[k * a.scales_stride + b];
      if (a.cap || a.ctab.v) {
        // the segment's caps from index 0 (s0 is a multiple of 32: whole bytes of bits)
        const float* cap = unit_caps(a.cap, a.ctab, k * a.m + s0, s1 - s0);
#ifdef LBCOMM_X86
        if (kAvx2) {
          unpack_capped_avx2(bits + (s0 >> 3), out + s0, cap, 0, s1 - s0, sc, stream);
          s0 = s1;
          continue;
        }
#endif
        unpack_capped_scalar(bits + (s0 >> 3), out + s0, cap, 0, s1 - s0, sc);
        s0 = s1;
        continue;
      }
#ifdef LBCOMM_X86
      if (kAvx2) {
        unpack_avx2(bits, out, s0, s1, sc, a.weights, a.wtype, k * a.m, stream);
        s0 = s1;
        continue;
      }
#endif
      unpack_scalar(bits, out, s0, s1, sc, a.weights, a.wtype, k * a.m);
      s0 = s1;
    }
  }
#ifdef LBCOMM_X86
  if (stream) _mm_sfence();  // streamed stores are weakly ordered
#endif
}

}  // namespace cpu
}  // namespace lbcomm
