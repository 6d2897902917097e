// CUDA kernels of lbcomm's compressed allreduce; the raw-pointer contract is csrc/kernels.h.
// No torch headers here so that nvcc stays quick; ops_cuda.cpp binds these to the ops.
//
// Work is cut into groups of consecutive elements that share one scale: a scale block
// (block > 0) or a kPartialBlock unit (block == 0). A group is handled by one warp (small
// blocks, several groups per thread block) or by a whole 256-thread block. Warp w of a group
// owns the 32-element words w, w + GW, ...; lane l owns element 32 * word + l, so loads are
// coalesced and __ballot_sync of a word is exactly one little-endian uint32 of packed bits.
// Block mode is one fused kernel: values stay in registers between the reduction and the
// writes; words beyond the register budget are recomputed from their inputs (read twice,
// the second time mostly from L2). Single-scale mode is three kernels: partial sums per unit,
// one fixed-shape finishing reduction, then the packing pass with the final scale. Each
// warp loads all its words' inputs before it computes with them (Src::fill), so that the
// memory latencies overlap: a warp that waits on one load at a time runs far below copy
// bandwidth.
// The capped decode (kernels.h; block mode, no weights) has kernels of its own
// (capped_group_kernel, unpack_octets_kernel<I, true>). The server's block mode for blocks
// of 128 to 4096 elements, and unpack without weights or caps, use four elements per lane
// instead (server_quad_kernel, unpack_quads_kernel): there one element per lane was bound
// by load or store instructions, not bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#ifndef LBCOMM_WITH_CUDA
#define LBCOMM_WITH_CUDA 1  // the launcher declarations in kernels.h are behind this switch
#endif
#include "kernels.h"

namespace lbcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFinishThreads = 1024;
constexpr int64_t kMaxGrid = int64_t{1} << 24;  // larger problems loop (grid-stride)
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float load_in(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load_in(const __half* x, int64_t i) { return __half2float(x[i]); }
__device__ __forceinline__ float load_in(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }

// sqrt(sum / count) in float64, rounded to fp32 once; 0 for a group without real elements.
__device__ __forceinline__ float rms(double sumsq, int64_t count) {
  return count > 0 ? __double2float_rn(sqrt(sumsq / static_cast<double>(count))) : 0.0f;
}

// The scale with its sign bit set when neg is 1 (scales are >= +0, so this is -scale);
// the same rule as the CPU kernels and lbcomm.reference, also for a NaN scale.
__device__ __forceinline__ float set_sign(float v, unsigned neg) {
  return __uint_as_float(__float_as_uint(v) | (neg << 31));
}

// Groups of elements sharing one scale: `nseg` segments of `seg` elements (chunks, or the
// whole tensor), each cut into groups of `group` elements (the last may be shorter).
// Group g's scale lives at scales[g]. Elements at index >= numel are padding.
struct Groups {
  int64_t seg, group, per_seg, count, numel;

  __device__ __forceinline__ void locate(int64_t g, int64_t& start, int64_t& len) const {
    const int64_t k = g / per_seg, b = g - k * per_seg;
    start = k * seg + b * group;
    len = min(group, seg - b * group);
  }
};

// Weight f (fp32 or bf16, read as its exact fp32 value).
__device__ __forceinline__ float load_weight(const void* w, InType t, int64_t f) {
  return t == InType::BF16 ? load_in(static_cast<const __nv_bfloat16*>(w), f) : load_in(static_cast<const float*>(w), f);
}

// Capped decode: d = cap < scale ? cap : scale (a NaN cap keeps the scale, a NaN scale stays).
__device__ __forceinline__ float cap_min(float cap, float scale) { return cap < scale ? cap : scale; }

// Capped decode: an error clamped to [-b, b], b = kCapErrorRatio * cap (one fp32 product);
// ordered comparisons, so a NaN error (or a NaN bound) leaves the error as it is.
__device__ __forceinline__ float clamp_cap(float e, float cap) {
  const float b = __fmul_rn(kCapErrorRatio, cap);
  return e > b ? b : (e < -b ? -b : e);
}

struct NoWeights {};  // the weights type of a worker without per-coordinate weights

// Phase 0 value of a real element: y = x + e (one fp32 rounding); with weights of type W
// (float or bf16, read as their exact fp32 values) y = x / w + e (the IEEE quotient, then
// the sum). W is a template argument so that each case compiles to only the loads it makes.
template <typename T, typename W>
struct WorkerSrc {
  static constexpr bool kWeighted = !std::is_same<W, NoWeights>::value;
  const T* x;
  const float* error;
  const W* weights;  // indexed like x (unused without weights)

  __device__ __forceinline__ float weight(int64_t f) const {
    if constexpr (kWeighted) {
      return load_in(weights, f);
    } else {
      return 1.0f;
    }
  }
  __device__ __forceinline__ static float value(float x, float w, float e) {
    return __fadd_rn(kWeighted ? __fdiv_rn(x, w) : x, e);
  }

  __device__ __forceinline__ float operator()(int64_t f, int64_t /*group*/) const {
    return value(load_in(x, f), weight(f), error[f]);
  }

  // The values of R words (word it * GW + wg of the group at start; 0 for pads and words
  // past the group's end): every load is issued before the arithmetic, whose division
  // would otherwise keep the loads of one word waiting for the previous word's.
  template <int GW, int R>
  __device__ __forceinline__ void fill(float (&v)[R], int64_t start, int64_t words, int64_t numel, int64_t /*g*/,
                                       int wg, int lane) const {
    float xs[R], ws[R], es[R];
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      const bool real = w < words && f < numel;
      xs[it] = real ? load_in(x, f) : 0.0f;
      ws[it] = real ? weight(f) : 1.0f;
      es[it] = real ? error[f] : 0.0f;
    }
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      v[it] = w < words && f < numel ? value(xs[it], ws[it], es[it]) : 0.0f;
    }
  }

  // Capped decode: a worker's values do not depend on the caps.
  __device__ __forceinline__ float capped(int64_t f, int64_t g, float /*cap*/) const { return (*this)(f, g); }
  template <int GW, int R>
  __device__ __forceinline__ void fill_capped(float (&v)[R], const float (&/*caps*/)[R], int64_t start, int64_t words,
                                              int64_t numel, int64_t g, int wg, int lane) const {
    fill<GW, R>(v, start, words, numel, g, wg, lane);
  }
};

// Phase 2 value of a real element: z = (sum_j +-a_j) * (1/p) + s, rank order, no FMA.
// Capped decode (the capped / fill_capped forms): rank j's term is +-d_j with
// d_j = cap_min(cap, a_j), the element's cap given by the caller (indexed like error).
struct ServerSrc {
  const uint8_t* packed;
  int64_t packed_stride;
  const float* scales;
  int64_t scales_stride;
  int64_t p;
  float inv_p;
  bool per_block;  // scale column = group index (block mode), else column 0
  const float* error;

  __device__ __forceinline__ float operator()(int64_t f, int64_t group) const { return sum<false>(f, group, 0.0f); }
  __device__ __forceinline__ float capped(int64_t f, int64_t group, float cap) const {
    return sum<true>(f, group, cap);
  }

  template <bool Cap>
  __device__ __forceinline__ float sum(int64_t f, int64_t group, float cap) const {
    // Byte loads: a warp reads 4 consecutive bytes per rank, and rows need no alignment.
    const uint8_t* bytes = packed + (f >> 3);
    const float* sc = scales + (per_block ? group : 0);
    const unsigned shift = static_cast<unsigned>(f & 7);
    float acc = 0.0f;
    for (int64_t j = 0; j < p; ++j) {
      const unsigned neg = (static_cast<unsigned>(bytes[j * packed_stride]) >> shift) & 1u;
      const float s = sc[j * scales_stride];
      acc = __fadd_rn(acc, set_sign(Cap ? cap_min(cap, s) : s, neg));
    }
    return __fadd_rn(__fmul_rn(acc, inv_p), error[f]);
  }

  // The values of R words as WorkerSrc::fill, rank by rank: one scale load and R byte loads
  // in flight per rank, where element by element each rank's loads waited for the last.
  // The sum runs over the ranks in the same order, so the values are those of operator().
  template <int GW, int R>
  __device__ __forceinline__ void fill(float (&v)[R], int64_t start, int64_t words, int64_t numel, int64_t g,
                                       int wg, int lane) const {
    fill_impl<GW, R, false>(v, v, start, words, numel, g, wg, lane);  // caps unused
  }
  // The same under the capped decode; caps[it]: this lane's cap in word it (any value for
  // pads and words past the end, whose values are 0 all the same).
  template <int GW, int R>
  __device__ __forceinline__ void fill_capped(float (&v)[R], const float (&caps)[R], int64_t start, int64_t words,
                                              int64_t numel, int64_t g, int wg, int lane) const {
    fill_impl<GW, R, true>(v, caps, start, words, numel, g, wg, lane);
  }

  template <int GW, int R, bool Cap>
  __device__ __forceinline__ void fill_impl(float (&v)[R], const float (&caps)[R], int64_t start, int64_t words,
                                            int64_t numel, int64_t g, int wg, int lane) const {
    float es[R], acc[R];
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      es[it] = w < words && f < numel ? error[f] : 0.0f;
      acc[it] = 0.0f;
    }
    const uint8_t* bytes = packed + ((start + static_cast<int64_t>(wg) * 32 + lane) >> 3);
    const unsigned shift = static_cast<unsigned>(lane & 7);  // start is a multiple of 32
    const float* sc = scales + (per_block ? g : 0);
    for (int64_t j = 0; j < p; ++j) {
      const float s = sc[j * scales_stride];
      unsigned b[R];
#pragma unroll
      for (int it = 0; it < R; ++it)
        b[it] = static_cast<int64_t>(it) * GW + wg < words ? bytes[j * packed_stride + it * GW * 4] : 0u;
#pragma unroll
      for (int it = 0; it < R; ++it)
        acc[it] = __fadd_rn(acc[it], set_sign(Cap ? cap_min(caps[it], s) : s, (b[it] >> shift) & 1u));
    }
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      v[it] = w < words && f < numel ? __fadd_rn(__fmul_rn(acc[it], inv_p), es[it]) : 0.0f;
    }
  }
};

struct Out {
  float* error_out;  // indexed like the values (flat or chunk-local)
  uint32_t* bits;    // packed words, word f / 32 holds element f
  float* scales;     // per-group scales (fused), or the final scale at [0] (apply)
  double* partials;  // per-group sums of squares (partial)
};

enum class Pass { kFused, kPartial, kApply };

// Sum of v over the GW warps of a group, identical in every thread; fixed order, so the
// result depends only on the data and the (fixed) thread layout.
template <int GW>
__device__ __forceinline__ double group_sum(double v, double* red, int warp) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);  // a+b == b+a: lanes agree
  if constexpr (GW == 1) {
    return v;
  } else {
    __syncthreads();  // the previous group's readers of red are done
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    double t = 0.0;
#pragma unroll
    for (int w = 0; w < GW; ++w) t += red[w];
    return t;
  }
}

// Pack one word of values (pads are +0, bit 0) and write their errors (pads 0).
// error_out[f] may alias the error input: the caller has read error[f] already.
__device__ __forceinline__ void emit(const Out& out, int64_t word, int64_t f, bool real, float v, float scale,
                                     int lane) {
  const unsigned bits = __ballot_sync(kFullMask, (__float_as_uint(v) >> 31) != 0u);
  if (lane == 0) out.bits[word] = bits;
  out.error_out[f] = real ? __fsub_rn(v, copysignf(scale, v)) : 0.0f;
}

// emit under the capped decode: error = v - copysign(cap_min(cap, scale), v), clamped to
// +-kCapErrorRatio * cap; the bits as emit's. cap: the element's (unused for pads).
__device__ __forceinline__ void emit_capped(const Out& out, int64_t word, int64_t f, bool real, float v, float scale,
                                            float cap, int lane) {
  const unsigned bits = __ballot_sync(kFullMask, (__float_as_uint(v) >> 31) != 0u);
  if (lane == 0) out.bits[word] = bits;
  out.error_out[f] = real ? clamp_cap(__fsub_rn(v, copysignf(cap_min(cap, scale), v)), cap) : 0.0f;
}

// GW warps per group (1 or kWarps); R words per warp loaded together by Src::fill and kept
// in registers; a group of more words recomputes the rest element by element.
template <class Src, int GW, int R, Pass P>
__global__ void __launch_bounds__(kThreads) group_kernel(Src src, Groups gs, Out out) {
  static_assert(GW == 1 || GW == kWarps, "a group is one warp or the whole block");
  static_assert(R > 0, "at least one word per warp in registers");
  constexpr int kGroupsPerBlock = kWarps / GW;
  __shared__ double red[kWarps];
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int wg = warp % GW;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroupsPerBlock;
  // g is uniform over the threads of a group, so ballots and __syncthreads are safe.
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + warp / GW; g < gs.count; g += stride) {
    int64_t start, len;
    gs.locate(g, start, len);
    const int64_t words = len >> 5;
    const int64_t iters = (words + GW - 1) / GW;  // words per warp, rounded up
    float keep[R];
    src.template fill<GW, R>(keep, start, words, gs.numel, g, wg, lane);
    float scale;
    if constexpr (P != Pass::kApply) {
      double ss = 0.0;  // pads add +0; fp32 squares are exact in float64
#pragma unroll
      for (int it = 0; it < R; ++it) ss += static_cast<double>(keep[it]) * static_cast<double>(keep[it]);
#pragma unroll 4
      for (int64_t it = R; it < iters; ++it) {
        const int64_t w = it * GW + wg, f = start + w * 32 + lane;
        const float v = (w < words && f < gs.numel) ? src(f, g) : 0.0f;
        ss += static_cast<double>(v) * static_cast<double>(v);
      }
      const double total = group_sum<GW>(ss, red, warp);
      if constexpr (P == Pass::kPartial) {
        if (wg == 0 && lane == 0) out.partials[g] = total;
        continue;
      }
      const int64_t real = min(max(gs.numel - start, int64_t{0}), len);
      scale = rms(total, real);
      if (wg == 0 && lane == 0) out.scales[g] = scale;
    } else {
      scale = out.scales[0];  // written by finish_kernel earlier on the stream
    }
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      if (w < words) emit(out, (start >> 5) + w, f, f < gs.numel, keep[it], scale, lane);
    }
#pragma unroll 4
    for (int64_t it = R; it < iters; ++it) {
      const int64_t w = it * GW + wg, f = start + w * 32 + lane;
      if (w < words) {
        const bool real = f < gs.numel;
        emit(out, (start >> 5) + w, f, real, real ? src(f, g) : 0.0f, scale, lane);  // reads e[f] before writing
      }
    }
  }
}

// group_kernel's fused pass under the capped decode (block mode; kernels.h): the values
// come from Src's capped forms, cap is indexed like them (flat for the worker, chunk-local
// for the server) and read for real elements only. s1 is the block's RMS as in
// group_kernel; the block scale is the RMS of the real values with cap >= s1, summed in
// the same order as s1's sum (s1 when there are none); the errors are emit_capped's.
template <class Src, int GW, int R>
__global__ void __launch_bounds__(kThreads) capped_group_kernel(Src src, Groups gs, Out out, const float* cap) {
  static_assert(GW == 1 || GW == kWarps, "a group is one warp or the whole block");
  static_assert(R > 0, "at least one word per warp in registers");
  constexpr int kGroupsPerBlock = kWarps / GW;
  __shared__ double red[kWarps];
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int wg = warp % GW;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroupsPerBlock;
  // g is uniform over the threads of a group, so ballots and __syncthreads are safe.
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + warp / GW; g < gs.count; g += stride) {
    int64_t start, len;
    gs.locate(g, start, len);
    const int64_t words = len >> 5;
    const int64_t iters = (words + GW - 1) / GW;  // words per warp, rounded up
    float caps[R], keep[R];
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      caps[it] = w < words && f < gs.numel ? cap[f] : 0.0f;  // pads: not read, not used
    }
    src.template fill_capped<GW, R>(keep, caps, start, words, gs.numel, g, wg, lane);
    double ss = 0.0;  // pads add +0; fp32 squares are exact in float64
#pragma unroll
    for (int it = 0; it < R; ++it) ss += static_cast<double>(keep[it]) * static_cast<double>(keep[it]);
#pragma unroll 4
    for (int64_t it = R; it < iters; ++it) {
      const int64_t w = it * GW + wg, f = start + w * 32 + lane;
      const float v = (w < words && f < gs.numel) ? src.capped(f, g, cap[f]) : 0.0f;
      ss += static_cast<double>(v) * static_cast<double>(v);
    }
    const int64_t real = min(max(gs.numel - start, int64_t{0}), len);
    const float s1 = rms(group_sum<GW>(ss, red, warp), real);
    // The sum of squares and the count of the real values with cap >= s1 (a count in
    // float64 is exact, and group_sum adds it up like the sums).
    double ms = 0.0, mc = 0.0;
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      if (w < words && f < gs.numel && caps[it] >= s1) {
        ms += static_cast<double>(keep[it]) * static_cast<double>(keep[it]);
        mc += 1.0;
      }
    }
#pragma unroll 4
    for (int64_t it = R; it < iters; ++it) {
      const int64_t w = it * GW + wg, f = start + w * 32 + lane;
      if (w < words && f < gs.numel) {
        const float c = cap[f];
        if (c >= s1) {
          const float v = src.capped(f, g, c);
          ms += static_cast<double>(v) * static_cast<double>(v);
          mc += 1.0;
        }
      }
    }
    const double msum = group_sum<GW>(ms, red, warp);
    const double mcount = group_sum<GW>(mc, red, warp);
    const float scale = mcount > 0.0 ? rms(msum, static_cast<int64_t>(mcount)) : s1;
    if (wg == 0 && lane == 0) out.scales[g] = scale;
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t w = static_cast<int64_t>(it) * GW + wg, f = start + w * 32 + lane;
      if (w < words) emit_capped(out, (start >> 5) + w, f, f < gs.numel, keep[it], scale, caps[it], lane);
    }
#pragma unroll 4
    for (int64_t it = R; it < iters; ++it) {
      const int64_t w = it * GW + wg, f = start + w * 32 + lane;
      if (w < words) {
        const bool real_f = f < gs.numel;
        const float c = real_f ? cap[f] : 0.0f;
        // reads e[f] before writing it
        emit_capped(out, (start >> 5) + w, f, real_f, real_f ? src.capped(f, g, c) : 0.0f, scale, c, lane);
      }
    }
  }
}

// Single-scale mode: sum the per-unit partials with a fixed shape (independent of how the
// partials were produced) and write the scale to scales[0 .. n_out).
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(const double* partials, int64_t count, int64_t real, float* scales, int64_t n_out) {
  __shared__ double red[kFinishThreads / 32];
  __shared__ float result;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kFinishThreads) s += partials[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kFinishThreads / 32; ++w) t += red[w];
    result = rms(t, real);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n_out; i += kFinishThreads) scales[i] = result;
}

// ---- Block-mode server pass, four elements per lane ----
// The server's cost is load instructions, not bytes: with one element per lane a warp
// spends one load per rank on each 32-element word, each fetching 4 bytes of sign bits.
// Here lane l owns elements 4l .. 4l+3 of a 128-element slab, so one load per rank covers
// four words, and the error, cap and error_out traffic moves as float4. The arithmetic of
// an element is ServerSrc::sum's (rank order, no FMA); the scale sums are group_kernel's
// and capped_group_kernel's over the same values.
constexpr int kSlab = 128;  // elements of one warp-wide quad row

// Spread the 8 bits of `byte` to bits 0, 4, ..., 28.
__device__ __forceinline__ unsigned spread_nibbles(unsigned byte) {
  unsigned x = byte & 0xffu;
  x = (x | (x << 12)) & 0x000F000Fu;
  x = (x | (x << 6)) & 0x03030303u;
  return (x | (x << 3)) & 0x11111111u;
}

// The 4 packed words of a slab from the lanes' quads: word k holds lanes 8k .. 8k+7, lane
// l's element t at bit 4 (l - 8k) + t. Lane k < 4 writes word k if the group has it.
__device__ __forceinline__ void emit_slab_bits(uint32_t* bits, int64_t word0, int64_t words_left, const float (&v)[4],
                                               int lane) {
  unsigned b[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) b[t] = __ballot_sync(kFullMask, (__float_as_uint(v[t]) >> 31) != 0u);
  if (lane < 4 && lane < words_left) {
    unsigned w = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) w |= spread_nibbles(b[t] >> (8 * lane)) << t;
    bits[word0 + lane] = w;
  }
}

// Four floats at p + f, as one float4 when vec (p 16-byte aligned; f is a multiple of 4)
// and all four are below n; else each below n, 0 past it.
__device__ __forceinline__ void load4(float (&d)[4], const float* p, int64_t f, int64_t n, bool vec) {
  if (vec && f + 4 <= n) {
    const float4 q = *reinterpret_cast<const float4*>(p + f);
    d[0] = q.x, d[1] = q.y, d[2] = q.z, d[3] = q.w;
  } else {
#pragma unroll
    for (int t = 0; t < 4; ++t) d[t] = f + t < n ? p[f + t] : 0.0f;
  }
}

__device__ __forceinline__ void store4(float* p, int64_t f, const float (&d)[4], int64_t n, bool vec) {
  if (vec && f + 4 <= n) {
    *reinterpret_cast<float4*>(p + f) = make_float4(d[0], d[1], d[2], d[3]);
  } else {
#pragma unroll
    for (int t = 0; t < 4; ++t)
      if (f + t < n) p[f + t] = d[t];
  }
}

// GW warps per group (1 or kWarps), R slabs per warp, all in registers (the launcher picks
// R so that a group's slabs fit). vec: error, error_out and cap are 16-byte aligned;
// words4: the packed rows are 4-byte aligned (base and stride). Four blocks per SM where R
// allows it: the kernel waits on memory, and more groups in flight hide more of the wait.
template <int GW, int R, bool Cap>
__global__ void __launch_bounds__(kThreads, R <= 2 ? 4 : 2) server_quad_kernel(ServerSrc src, Groups gs, Out out,
                                                                              const float* cap, bool vec, bool words4) {
  static_assert(GW == 1 || GW == kWarps, "a group is one warp or the whole block");
  constexpr int kGroupsPerBlock = kWarps / GW;
  __shared__ double red[kWarps];
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int wg = warp % GW;
  const unsigned shift = static_cast<unsigned>(lane & 1) * 4u;  // slabs start at multiples of 8
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroupsPerBlock;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + warp / GW; g < gs.count; g += stride) {
    int64_t start, len;
    gs.locate(g, start, len);
    const int64_t words = len >> 5;
    // slab it * GW + wg; this lane's quad is word (4 * slab + lane / 8) of the group
    bool ok[R];
    int64_t f[R];
    float v[R][4], c[R][4], e[R][4], acc[R][4];
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t sl = static_cast<int64_t>(it) * GW + wg;
      ok[it] = 4 * sl + (lane >> 3) < words;
      f[it] = start + sl * kSlab + 4 * lane;
      const int64_t n = ok[it] ? gs.numel : 0;  // pads and quads past the group: not read
      load4(e[it], src.error, f[it], n, vec);
      if constexpr (Cap) load4(c[it], cap, f[it], n, vec);
#pragma unroll
      for (int t = 0; t < 4; ++t) acc[it][t] = 0.0f;
    }
    const float* sc = src.scales + g;
    // Rank j's term of this lane's quad in slab it; nib: the quad's 4 sign bits.
    auto add_rank = [&](int it, float s, unsigned nib) {
#pragma unroll
      for (int t = 0; t < 4; ++t)
        acc[it][t] = __fadd_rn(acc[it][t], set_sign(Cap ? cap_min(c[it][t], s) : s, (nib >> t) & 1u));
    };
    if (words4) {
      // Lane 4u + k loads word k of the slab for rank j0 + u, so one load instruction
      // covers eight ranks; the lanes that own a word's elements take it by shuffle, and
      // lane u's load of rank j0 + u's scale serves the warp the same way.
      const uint32_t* rows = reinterpret_cast<const uint32_t*>(src.packed) + (start >> 5) + (lane & 3);
      const int64_t row_words = src.packed_stride / 4;
      const int mine = lane >> 2;
      for (int64_t j0 = 0; j0 < src.p; j0 += 8) {
        const int nr = src.p - j0 < 8 ? static_cast<int>(src.p - j0) : 8;
        const float s_mine = (lane & 7) < nr ? sc[(j0 + (lane & 7)) * src.scales_stride] : 0.0f;
        unsigned x[R];
#pragma unroll
        for (int it = 0; it < R; ++it) {
          const int64_t sl = static_cast<int64_t>(it) * GW + wg;
          x[it] = mine < nr && 4 * sl + (lane & 3) < words ? rows[(j0 + mine) * row_words + 4 * sl] : 0u;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (u >= nr) break;  // nr is uniform over the warp
          const float s = __shfl_sync(kFullMask, s_mine, u);
#pragma unroll
          for (int it = 0; it < R; ++it)
            add_rank(it, s, __shfl_sync(kFullMask, x[it], 4 * u + (lane >> 3)) >> (4 * (lane & 7)));
        }
      }
    } else {  // rows without 4-byte alignment: byte loads, four ranks' at a time
      const uint8_t* bytes = src.packed + (start >> 3) + (lane >> 1);
      for (int64_t j0 = 0; j0 < src.p; j0 += 4) {
        const int nr = src.p - j0 < 4 ? static_cast<int>(src.p - j0) : 4;
        float s[4];
        unsigned b[4][R];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          s[u] = u < nr ? sc[(j0 + u) * src.scales_stride] : 0.0f;
#pragma unroll
          for (int it = 0; it < R; ++it)
            b[u][it] = u < nr && ok[it]
                           ? bytes[(j0 + u) * src.packed_stride + (static_cast<int64_t>(it) * GW + wg) * (kSlab / 8)]
                           : 0u;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (u >= nr) break;
#pragma unroll
          for (int it = 0; it < R; ++it) add_rank(it, s[u], b[u][it] >> shift);
        }
      }
    }
    double ss = 0.0;  // pads add +0; fp32 squares are exact in float64
#pragma unroll
    for (int it = 0; it < R; ++it)
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const bool real = ok[it] && f[it] + t < gs.numel;
        v[it][t] = real ? __fadd_rn(__fmul_rn(acc[it][t], src.inv_p), e[it][t]) : 0.0f;
        ss += static_cast<double>(v[it][t]) * static_cast<double>(v[it][t]);
      }
    const int64_t real_count = min(max(gs.numel - start, int64_t{0}), len);
    const float s1 = rms(group_sum<GW>(ss, red, warp), real_count);
    float scale = s1;
    if constexpr (Cap) {  // the RMS of the real values with cap >= s1 (s1 if none)
      double ms = 0.0, mc = 0.0;
#pragma unroll
      for (int it = 0; it < R; ++it)
#pragma unroll
        for (int t = 0; t < 4; ++t)
          if (ok[it] && f[it] + t < gs.numel && c[it][t] >= s1) {
            ms += static_cast<double>(v[it][t]) * static_cast<double>(v[it][t]);
            mc += 1.0;
          }
      const double msum = group_sum<GW>(ms, red, warp);
      const double mcount = group_sum<GW>(mc, red, warp);
      if (mcount > 0.0) scale = rms(msum, static_cast<int64_t>(mcount));
    }
    if (wg == 0 && lane == 0) out.scales[g] = scale;
#pragma unroll
    for (int it = 0; it < R; ++it) {
      const int64_t sl = static_cast<int64_t>(it) * GW + wg;
      if (4 * sl >= words) continue;  // uniform over the warp: the ballots below are safe
      emit_slab_bits(out.bits, (start >> 5) + 4 * sl, words - 4 * sl, v[it], lane);
      float r[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const bool real = f[it] + t < gs.numel;
        if constexpr (Cap) {
          r[t] = real ? clamp_cap(__fsub_rn(v[it][t], copysignf(cap_min(c[it][t], scale), v[it][t])), c[it][t]) : 0.0f;
        } else {
          r[t] = real ? __fsub_rn(v[it][t], copysignf(scale, v[it][t])) : 0.0f;
        }
      }
      store4(out.error_out, f[it], r, ok[it] ? start + len : 0, vec);  // pads of the chunk get 0
    }
  }
}

// unpack without weights or caps: 4 elements (half a packed byte, one scale) per thread,
// rows on blockIdx.y, so that a warp's float4 stores write 512 contiguous bytes (eight
// elements per thread left every store instruction half of each sector it touched; four
// quads per thread, loaded together, measured slower than one). out is flat [numel], row k
// at k * m. I: the type of the in-row index arithmetic, 32-bit where m fits (its division
// by the block is several times cheaper). vec: out is 16-byte aligned.
template <typename I>
__global__ void __launch_bounds__(kThreads) unpack_quads_kernel(UnpackArgs a, bool vec) {
  const I m = static_cast<I>(a.m), block = static_cast<I>(a.block);
  const I quads = m >> 2;  // m % 8 == 0: a quad is in one row and half of one byte
  for (int64_t k = blockIdx.y; k < a.p; k += gridDim.y) {
    const int64_t row = k * a.m;
    const uint8_t* bytes = a.packed + k * a.packed_stride;
    const float* sc = a.scales + k * a.scales_stride;
    for (I q = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; q < quads; q += gridDim.x * kThreads) {
      const I i = q << 2;
      const int64_t f = row + static_cast<int64_t>(i);
      if (f >= a.numel) break;  // later quads of the row are past numel too
      const unsigned nib = static_cast<unsigned>(bytes[i >> 3]) >> (i & 4);
      const float s = sc[block > 0 ? i / block : 0];
      float v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) v[t] = set_sign(s, (nib >> t) & 1u);
      store4(a.out, f, v, a.numel, vec);
    }
  }
}

// unpack with weights or caps: 8 elements (one packed byte, one scale) per thread; out is
// flat [numel]. (unpack_quads_kernel's layout measured 5-14 % slower with these loads.) I: the
// type of the index arithmetic, 32-bit where p * m fits (its divisions are several times
// cheaper than 64-bit ones, which otherwise dominate this kernel). Cap: the capped decode
// (a.cap indexed like out, no weights); vec4 then also means a.cap is 16-byte aligned.
template <typename I, bool Cap>
__global__ void __launch_bounds__(kThreads) unpack_octets_kernel(UnpackArgs a, bool vec4) {
  const I m = static_cast<I>(a.m), block = static_cast<I>(a.block);
  const int64_t octets = (a.numel + 7) >> 3;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; q < octets; q += stride) {
    const I f = static_cast<I>(q << 3), k = f / m, i = f - k * m;  // m % 8 == 0: an octet is in one row
    const unsigned byte = a.packed[static_cast<int64_t>(k) * a.packed_stride + (i >> 3)];
    const float s = a.scales[static_cast<int64_t>(k) * a.scales_stride + (block > 0 ? i / block : 0)];
    float v[8];
    if constexpr (Cap) {
      float c[8];
      if (vec4 && f + 8 <= a.numel) {
        const float4* cp = reinterpret_cast<const float4*>(a.cap + f);
        const float4 c0 = cp[0], c1 = cp[1];
        c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w;
        c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
      } else {
#pragma unroll
        for (int t = 0; t < 8; ++t) c[t] = f + t < a.numel ? a.cap[f + t] : s;  // past numel: not read, not written
      }
#pragma unroll
      for (int t = 0; t < 8; ++t) v[t] = set_sign(cap_min(c[t], s), (byte >> t) & 1u);
    } else {  // launched with weights only (without them, unpack_quads_kernel)
#pragma unroll
      for (int t = 0; t < 8; ++t) v[t] = set_sign(s, (byte >> t) & 1u);
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (f + t < a.numel) v[t] = __fmul_rn(v[t], load_weight(a.weights, a.wtype, f + t));
    }
    if (vec4 && f + 8 <= a.numel) {
      float4* o = reinterpret_cast<float4*>(a.out + f);
      o[0] = make_float4(v[0], v[1], v[2], v[3]);
      o[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (f + t < a.numel) a.out[f + t] = v[t];
    }
  }
}

int64_t grid_for(int64_t items, int64_t per_block) {
  const int64_t blocks = ceil_div(items, per_block);
  return blocks < kMaxGrid ? blocks : kMaxGrid;
}

int last_error() { return static_cast<int>(cudaGetLastError()); }

bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Cap: capped_group_kernel (P must be kFused) with the caps `cap`, else group_kernel.
template <class Src, int GW, int R, Pass P, bool Cap = false>
int launch_groups(const Src& src, const Groups& gs, const Out& out, cudaStream_t stream, const float* cap = nullptr) {
  const int64_t grid = grid_for(gs.count, kWarps / GW);
  if constexpr (Cap) {
    static_assert(P == Pass::kFused, "the capped decode is block mode only");
    capped_group_kernel<Src, GW, R><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(src, gs, out, cap);
  } else {
    group_kernel<Src, GW, R, P><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(src, gs, out);
  }
  return last_error();
}

// Block mode: pick the layout from the words per group so that typical blocks stay in
// registers (up to 512 elements per warp group, 4096 per block group). Cap: the capped
// decode with the caps `cap`.
template <class Src, bool Cap = false>
int launch_fused(const Src& src, const Groups& gs, const Out& out, cudaStream_t stream, const float* cap = nullptr) {
  const int64_t words = (gs.group < gs.seg ? gs.group : gs.seg) / 32;
  if (words <= 1) return launch_groups<Src, 1, 1, Pass::kFused, Cap>(src, gs, out, stream, cap);
  if (words <= 2) return launch_groups<Src, 1, 2, Pass::kFused, Cap>(src, gs, out, stream, cap);
  if (words <= 4) return launch_groups<Src, 1, 4, Pass::kFused, Cap>(src, gs, out, stream, cap);
  if (words <= 8) return launch_groups<Src, 1, 8, Pass::kFused, Cap>(src, gs, out, stream, cap);
  if (words <= 16) return launch_groups<Src, 1, 16, Pass::kFused, Cap>(src, gs, out, stream, cap);
  const int64_t per_warp = ceil_div(words, kWarps);
  if (per_warp <= 4) return launch_groups<Src, kWarps, 4, Pass::kFused, Cap>(src, gs, out, stream, cap);
  if (per_warp <= 8) return launch_groups<Src, kWarps, 8, Pass::kFused, Cap>(src, gs, out, stream, cap);
  return launch_groups<Src, kWarps, 16, Pass::kFused, Cap>(src, gs, out, stream, cap);
}

template <int GW, int R, bool Cap>
int launch_server_quad(const ServerSrc& src, const Groups& gs, const Out& out, cudaStream_t st, const float* cap,
                       bool vec) {
  const int64_t grid = grid_for(gs.count, kWarps / GW);
  const bool words4 = aligned(src.packed, 4) && src.packed_stride % 4 == 0;
  server_quad_kernel<GW, R, Cap><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(src, gs, out, cap, vec, words4);
  return last_error();
}

// Block mode of the server: server_quad_kernel for groups of 128 to 4096 elements (all in
// registers), launch_fused otherwise. Cap: the capped decode with the caps `cap`.
template <bool Cap>
int launch_server_blocks(const ServerSrc& src, const Groups& gs, const Out& out, cudaStream_t st, const float* cap) {
  const int64_t words = (gs.group < gs.seg ? gs.group : gs.seg) / 32;
  const int64_t slabs = ceil_div(words, 4), per_warp = ceil_div(slabs, kWarps);
  const bool vec = aligned(src.error, 16) && aligned(out.error_out, 16) && (!Cap || aligned(cap, 16));
  if (words < 4 || per_warp > 4) return launch_fused<ServerSrc, Cap>(src, gs, out, st, cap);
  if (slabs <= 1) return launch_server_quad<1, 1, Cap>(src, gs, out, st, cap, vec);
  if (slabs <= 2) return launch_server_quad<1, 2, Cap>(src, gs, out, st, cap, vec);
  if (slabs <= 4) return launch_server_quad<1, 4, Cap>(src, gs, out, st, cap, vec);
  if (per_warp <= 1) return launch_server_quad<kWarps, 1, Cap>(src, gs, out, st, cap, vec);
  if (per_warp <= 2) return launch_server_quad<kWarps, 2, Cap>(src, gs, out, st, cap, vec);
  return launch_server_quad<kWarps, 4, Cap>(src, gs, out, st, cap, vec);
}

// Single-scale mode over kPartialBlock units: partials, finish, pack.
template <class Src>
int launch_single(const Src& src, const Groups& gs, const Out& out, double* partials, float* scales, int64_t n_scales,
                  cudaStream_t stream) {
  Out part = out;
  part.partials = partials;
  constexpr int kWordsPerWarp = kPartialBlock / 32 / kWarps;  // a unit's words all in registers
  int err = launch_groups<Src, kWarps, kWordsPerWarp, Pass::kPartial>(src, gs, part, stream);
  if (err != 0) return err;
  const int64_t total = gs.seg < gs.numel ? gs.seg : gs.numel;
  finish_kernel<<<1, kFinishThreads, 0, stream>>>(partials, gs.count, total, scales, n_scales);
  if ((err = last_error()) != 0) return err;
  Out apply = out;
  apply.scales = scales;
  return launch_groups<Src, kWarps, kWordsPerWarp, Pass::kApply>(src, gs, apply, stream);
}

template <typename T, typename W, bool Cap = false>
int worker_launch(const WorkerArgs& a, cudaStream_t stream) {
  const WorkerSrc<T, W> src{static_cast<const T*>(a.x), a.error, static_cast<const W*>(a.weights)};
  const int64_t n = a.p * a.m;
  const int64_t numel = a.numel < 0 ? 0 : a.numel;
  Out out{a.error_out, reinterpret_cast<uint32_t*>(a.packed), a.scales, nullptr};
  if constexpr (Cap) {  // block > 0 (worker_typed checks): caps indexed like x, flat
    const int64_t nb = num_blocks(a.m, a.block);
    return launch_fused<WorkerSrc<T, W>, true>(src, Groups{a.m, a.block, nb, a.p * nb, numel}, out, stream, a.cap);
  }
  if (a.block > 0) {
    const int64_t nb = num_blocks(a.m, a.block);
    return launch_fused(src, Groups{a.m, a.block, nb, a.p * nb, numel}, out, stream);
  }
  if (a.partials == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t units = ceil_div(n, kPartialBlock);
  return launch_single(src, Groups{n, kPartialBlock, units, units, numel}, out, a.partials, a.scales, a.p, stream);
}

template <typename T>
int worker_typed(const WorkerArgs& a, cudaStream_t stream) {
  if (a.cap != nullptr) {  // the capped decode: block mode without weights only
    if (a.block == 0 || a.weights != nullptr) return static_cast<int>(cudaErrorInvalidValue);
    return worker_launch<T, NoWeights, true>(a, stream);
  }
  if (a.weights == nullptr) return worker_launch<T, NoWeights>(a, stream);
  if (a.wtype == InType::BF16) return worker_launch<T, __nv_bfloat16>(a, stream);
  return worker_launch<T, float>(a, stream);
}

}  // namespace

int worker_compress(const WorkerArgs& a, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (a.p <= 0 || a.m <= 0) {
    // No elements: only the single-scale mode has outputs, p scales of 0 (no real elements).
    if (a.p > 0 && a.block == 0) return static_cast<int>(cudaMemsetAsync(a.scales, 0, a.p * sizeof(float), s));
    return 0;
  }
  if (a.m % kAlign != 0 || a.block < 0 || a.block % kAlign != 0 || !aligned(a.packed, 4))
    return static_cast<int>(cudaErrorInvalidValue);
  switch (a.xtype) {
    case InType::F32: return worker_typed<float>(a, s);
    case InType::F16: return worker_typed<__half>(a, s);
    case InType::BF16: return worker_typed<__nv_bfloat16>(a, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int server_compress(const ServerArgs& a, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.m <= 0) {
    // An empty chunk: only the single-scale mode has an output, one scale of 0.
    if (a.block == 0) return static_cast<int>(cudaMemsetAsync(a.scales_out, 0, sizeof(float), st));
    return 0;
  }
  if (a.m % kAlign != 0 || a.block < 0 || a.block % kAlign != 0 || a.p < 1 || !aligned(a.packed_out, 4))
    return static_cast<int>(cudaErrorInvalidValue);
  const float inv_p = 1.0f / static_cast<float>(a.p);  // host IEEE division, as the reference
  const ServerSrc src{a.packed, a.packed_stride, a.scales, a.scales_stride, a.p, inv_p, a.block > 0, a.error};
  const int64_t numel = a.numel < 0 ? 0 : a.numel;
  Out out{a.error_out, reinterpret_cast<uint32_t*>(a.packed_out), a.scales_out, nullptr};
  if (a.cap != nullptr) {  // the capped decode, block mode only: caps indexed like error
    if (a.block == 0) return static_cast<int>(cudaErrorInvalidValue);
    const int64_t nb = num_blocks(a.m, a.block);
    return launch_server_blocks<true>(src, Groups{a.m, a.block, nb, nb, numel}, out, st, a.cap);
  }
  if (a.block > 0) {
    const int64_t nb = num_blocks(a.m, a.block);
    return launch_server_blocks<false>(src, Groups{a.m, a.block, nb, nb, numel}, out, st, nullptr);
  }
  if (a.partials == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t units = ceil_div(a.m, kPartialBlock);
  return launch_single(src, Groups{a.m, kPartialBlock, units, units, numel}, out, a.partials, a.scales_out, 1, st);
}

int unpack(const UnpackArgs& a, void* stream) {
  if (a.numel <= 0) return 0;
  if (a.p <= 0 || a.m <= 0 || a.m % 8 != 0 || a.block < 0 || a.numel > a.p * a.m)
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t grid = grid_for(ceil_div(a.numel, 8), kThreads);
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.cap != nullptr) {  // the capped decode: block mode without weights only
    if (a.block == 0 || a.weights != nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const bool vec4 = aligned(a.out, 16) && aligned(a.cap, 16);
    if (a.p * a.m <= INT32_MAX)
      unpack_octets_kernel<uint32_t, true><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(a, vec4);
    else
      unpack_octets_kernel<int64_t, true><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(a, vec4);
    return last_error();
  }
  if (a.weights != nullptr) {
    if (a.p * a.m <= INT32_MAX)
      unpack_octets_kernel<uint32_t, false><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(a, aligned(a.out, 16));
    else
      unpack_octets_kernel<int64_t, false><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(a, aligned(a.out, 16));
    return last_error();
  }
  const int64_t rows = ceil_div(a.numel, a.m);
  const dim3 rows_grid(static_cast<unsigned>(grid_for(ceil_div(a.m, 4), kThreads)),
                       static_cast<unsigned>(rows < 65535 ? rows : 65535));
  if (a.m <= INT32_MAX)
    unpack_quads_kernel<uint32_t><<<rows_grid, kThreads, 0, st>>>(a, aligned(a.out, 16));
  else
    unpack_quads_kernel<int64_t><<<rows_grid, kThreads, 0, st>>>(a, aligned(a.out, 16));
  return last_error();
}

}  // namespace cuda
}  // namespace lbcomm
