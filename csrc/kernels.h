// Raw-pointer interface of the lbcomm kernels, shared by the CPU and CUDA implementations.
// No torch headers here: the CUDA translation units include this and must compile fast.
//
// Layout (lbcomm/wire.py): a padded tensor of n = p * m elements is p chunks of m elements;
// m and the block size B are multiples of 32 so that every block starts on a 32-bit word
// of packed bits. Each chunk is cut into nb = ceil(m / B) blocks (the last may be shorter);
// block == 0 means "no blocks": one worker scale for all real elements, one server scale
// per chunk. Elements at flat index >= numel ("real" count) are padding: they read as 0,
// carry no error (error_out = 0), are packed as bit 0 and are not counted in any scale.
// Bit order: element i of a chunk is bit (i % 8) of byte (i / 8), LSB first; bit set means
// signbit(value) set, i.e. the element decodes to -scale, otherwise +scale.
#pragma once
#include <cstdint>

namespace lbcomm {

enum class InType : int { F32 = 0, F16 = 1, BF16 = 2 };

constexpr int64_t kAlign = 32;          // m and block sizes are multiples of this
constexpr int64_t kPartialBlock = 2048;  // work unit of the single-scale (block == 0) mode
constexpr float kCapErrorRatio = 3.0f;   // capped decode: |error_i| <= kCapErrorRatio * cap_i

// Capped decode (cap != nullptr; block > 0, no weights): every coordinate i carries a bound
// cap_i >= 0 (+inf: none), the same on every rank. A value is decoded as
// sgn * d_i with d_i = (cap_i < scale ? cap_i : scale) wherever it is decoded (the server's
// sum, the final unpack). A compressing pass computes its values v (y or z) as usual, then
//   s1 = RMS of the block's real v; the block scale is the RMS over the real coordinates
//   with cap_i >= s1 (float64 sum, fp32 result), or s1 when there is none;
//   error_i = v_i - copysign(d_i, v_i), then clamped to [-b_i, b_i], b_i = kCapErrorRatio * cap_i
//   (one fp32 product; written as e > b ? b : (e < -b ? -b : e), so a NaN stays NaN).
// The sign bits are those of v, as without a cap: the wire format does not change.
//
// The caps come from a buffer (cap) or, on the CPU, from the optimizer's variance (ctab,
// when cap is nullptr and ctab.v is not): element i of a call then has the cap
// (sqrt(v[lo + i]) a_p + b_p) s_p, p the parameter with starts[p] <= lo + i < starts[p + 1],
// each operation rounded, the root correctly rounded (s_p == 1: no multiply; b_p == +inf:
// +inf, uncapped). The kernels compute a unit's caps into a per-thread buffer as they go, so
// no caps buffer is written and read back (cpu::table_caps, also lbcomm::decode_caps_table_).
struct CapTable {
  const float* v = nullptr;         // the variance, flat (nullptr: no table)
  int64_t lo = 0;                   // the flat index of the call's element 0
  const int64_t* starts = nullptr;  // [params + 1], non-decreasing
  const float* table = nullptr;     // [params, 3]: a, b, s per parameter
  int64_t params = 0;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Scale-groups per chunk: the number of scale slots a chunk carries.
inline int64_t num_blocks(int64_t m, int64_t block) { return block > 0 ? ceil_div(m, block) : 1; }

// Phase 0. y = x + e (x / w + e with per-coordinate weights, fp32 or bf16 read as their exact
// fp32 values: the fp32 quotient, then the sum, two roundings); one RMS scale per block (or
// one for everything when block == 0);
// packed[k, :] holds the sign bits of chunk k; error_out = y - scale * sgn(y).
// error and error_out may alias (in-place update).
struct WorkerArgs {
  const void* x;        // numel elements of type xtype, contiguous
  InType xtype;
  int64_t numel;        // real elements, <= p * m
  const float* error;   // [p * m]
  float* error_out;     // [p * m]
  int64_t p, m, block;
  uint8_t* packed;      // [p, m / 8] contiguous
  float* scales;        // [p, num_blocks(m, block)] contiguous
  double* partials;     // block == 0 only: ceil_div(p * m, kPartialBlock) doubles of scratch
  const void* weights;  // nullptr, or numel weights w > 0 indexed like x (divide x by them)
  InType wtype;         // F32 or BF16 (read as their exact fp32 values)
  const float* cap;     // nullptr, or numel caps indexed like x (capped decode, see above)
  CapTable ctab;        // the caps from the variance (CPU, cap == nullptr), indexed like x
};

// Phase 2. z = (sum_j sgn_j * a_j) * (1 / p) + s, accumulated in fp32 over j = 0..p-1 in
// order, then multiplied, then added (no fused multiply-add, so every backend rounds alike);
// one RMS scale per block of z; packed_out = sign bits of z; error_out = z - scale * sgn(z).
struct ServerArgs {
  const uint8_t* packed;  // row j at packed + j * packed_stride, m / 8 bytes
  int64_t packed_stride;  // bytes
  const float* scales;    // row j at scales + j * scales_stride, num_blocks(m, block) floats
  int64_t scales_stride;  // floats
  int64_t p, m, block;
  int64_t numel;          // real elements of this chunk, <= m (a prefix)
  const float* error;     // [m]
  float* error_out;       // [m], may alias error
  uint8_t* packed_out;    // [m / 8]
  float* scales_out;      // [num_blocks(m, block)]
  double* partials;       // block == 0 only: ceil_div(m, kPartialBlock) doubles of scratch
  const float* cap;       // nullptr, or numel caps of this chunk indexed like error (capped decode)
  CapTable ctab;          // the caps from the variance (CPU, cap == nullptr), indexed like error
};

// Phase 3 decode: out[k * m + i] = sgn(bit) * scales[k, block of i], for flat index < numel;
// with weights, that value times weights[k * m + i] (one fp32 product).
struct UnpackArgs {
  const uint8_t* packed;
  int64_t packed_stride;  // bytes between rows
  const float* scales;
  int64_t scales_stride;  // floats between rows
  int64_t p, m, block;
  int64_t numel;          // elements written, <= p * m
  float* out;
  const void* weights;    // nullptr, or numel weights indexed like out (multiply by them)
  InType wtype;           // F32 or BF16 (read as their exact fp32 values)
  const float* cap;       // nullptr, or numel caps indexed like out (capped decode; no weights)
  CapTable ctab;          // the caps from the variance (CPU, cap == nullptr), indexed like out
};

// CPU kernels (csrc/cpu/kernels.cpp). Work is split into independent units so the caller
// can run them on a thread pool; the unit ranges are [begin, end) of the counts below.
namespace cpu {
int64_t worker_units(const WorkerArgs& a);
void worker_pass(const WorkerArgs& a, int pass, int64_t begin, int64_t end);
int worker_num_passes(const WorkerArgs& a);
int64_t server_units(const ServerArgs& a);
void server_pass(const ServerArgs& a, int pass, int64_t begin, int64_t end);
int server_num_passes(const ServerArgs& a);
void finish_single_scale(double* partials, int64_t count, int64_t real, float* scales, int64_t n_out);
int64_t unpack_units(const UnpackArgs& a);
void unpack_range(const UnpackArgs& a, int64_t begin, int64_t end);
bool has_avx2();
// The caps of a call's elements [i0, i0 + n) from a CapTable (see above), into out[0, n).
void table_caps(const CapTable& t, int64_t i0, int64_t n, float* out);
}  // namespace cpu

#ifdef LBCOMM_WITH_CUDA
// CUDA launchers (csrc/cuda/kernels.cu). `stream` is a cudaStream_t; they return a
// cudaError_t (0 on success) from the launch so the caller can report it.
namespace cuda {
int worker_compress(const WorkerArgs& a, void* stream);
int server_compress(const ServerArgs& a, void* stream);
int unpack(const UnpackArgs& a, void* stream);
}  // namespace cuda
#endif

}  // namespace lbcomm
