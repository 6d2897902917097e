// The pass of OneBitLamb's clean-norm estimate over one range of a parameter as one fused
// op (lbcomm/optim/lamb_norm.py wraps it and holds the pure-torch sequence it replaces,
// which runs where the op cannot). Per coordinate, in fp32 with torch's roundings:
//
//   with a gradient g: ml <- ml + w (g - ml)  (three roundings, no FMA), stored in ml's dtype
//   r = 1 / ((sqrt(v) * (1 / denom_scale) + eps) bc1);  u0 = m r;  y = ml r
//   with a bound B: u0 = clamp(u0, -B, B), y = clamp(y, -B, B), edge = |u0| >= edge_at
//   edge |= masked (the momentum mask)
//
// and over the range, in fp64 (the products of two fp32 values are exact in fp64):
//
//   acc[0] += sum over the non-edge coordinates of y u0
//   acc[1] += the number of edge coordinates
//
// One division and one root per coordinate: the pass is bound by them (u0 and y by one
// reciprocal instead of a division each). The weight decay's terms of the norm are not
// here: the caller takes them from the direction's norms, which it computes anyway.
//
// lamb_advance_local_ makes the first step alone.
//
// With every > 1 the pass covers the runs of kBlock elements 0, every, 2 every, ... of the
// range only (for a parameter too large to pass over whole at every step,
// lbcomm/optim/lamb_norm.py): ml is advanced there only, the rest counts 0 edge coordinates
// and adds nothing.
//
// counts[b] = the edge coordinates in block b (kEdgeBlock elements) of the range: the sampled
// edge coordinates are then found by lamb_edge_find_, which passes again over the blocks
// holding them only (small blocks, so that a few hundred draws look at few elements),
// instead of every edge position being written (most coordinates can sit at the bound).
// The sums run in a fixed order on one thread (8 lanes of every 8th element, then the lanes
// in order): the same bits on every rank and thread count.
// sqrt is IEEE's (correctly rounded, the same on every ISA; torch's vectorized sqrt is not,
// see csrc/optim.cpp), so the edge is the same on every rank; u0 may differ from the
// direction's (m / bc1) / d by a few ulps: the edge's threshold (edge_at, below the bound by
// far more) allows for that. Built with
// -ffp-contract=off (no FMA).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <vector>

namespace lbcomm {
namespace {

constexpr int64_t kBlock = 512;      // the pass's elements per block (its arrays on the stack; SAMPLE_RUN)
constexpr int64_t kEdgeBlock = 128;  // the edge counts' block (kBlock is a multiple of it)
static_assert(kBlock % kEdgeBlock == 0, "a pass block holds whole count blocks");
constexpr int kLanes = 8;  // the fp64 sums: lane l adds the elements j = l (mod 8), then the lanes in order

// ml's element: fp32, or bf16 as its bits (uint16_t), widened exactly and stored rounded to
// nearest even (NaN kept a quiet NaN), as torch converts; bit operations only, so that the
// block's loop stays vectorized.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float narrow(float x, float*) { return x; }
inline uint16_t narrow(float x, uint16_t*) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

// 1 / (d bc1) with d = sqrt(v) (1 / denom_scale) + eps (s: 1 / denom_scale): the one
// definition the pass and the search share, so that both find the same edge.
inline float inv_q(float v, float s, float e, float c1) { return 1.0f / ((std::sqrt(v) * s + e) * c1); }

// One block's u0, y (0 on the edge: only its products off the edge are summed) and edge
// flags, without branches (vectorized; B: with the bound; T: ml advanced by g first).
// Cloned per ISA (wider vectors on hosts that have them).
template <bool B, bool T, typename L>
__attribute__((target_clones("avx512f", "avx2", "default"))) void clean_block(
    const float* __restrict m, const float* __restrict v, L* __restrict ml, const float* __restrict g, float w,
    int64_t n, float s, float e, float c1, float b, float at_b, float* __restrict u0, float* __restrict y,
    uint8_t* __restrict edge) {
  for (int64_t j = 0; j < n; ++j) {
    const float r = inv_q(v[j], s, e, c1);
    float a = widen(ml[j]);
    if (T) {
      const L stored = narrow((g[j] - a) * w + a, ml);
      ml[j] = stored;
      a = widen(stored);
    }
    float u = m[j] * r;
    float x = a * r;
    if (B) {  // torch.clamp_: a NaN stays NaN
      u = u > b ? b : (u < -b ? -b : u);
      x = x > b ? b : (x < -b ? -b : x);
    }
    const bool at = B && std::fabs(u) >= at_b;
    u0[j] = u;
    y[j] = at ? 0.0f : x;
    edge[j] = static_cast<uint8_t>(at);
  }
}

// One block's edge flags alone, as clean_block sets them (the search for the sampled
// coordinates: u0 only, no ml).
template <bool B>
__attribute__((target_clones("avx512f", "avx2", "default"))) void edge_block(
    const float* __restrict m, const float* __restrict v, int64_t n, float s, float e, float c1, float b,
    float at_b, uint8_t* __restrict edge) {
  for (int64_t j = 0; j < n; ++j) {
    float u = m[j] * inv_q(v[j], s, e, c1);
    if (B) u = u > b ? b : (u < -b ? -b : u);
    edge[j] = static_cast<uint8_t>(B && std::fabs(u) >= at_b);
  }
}

// ml <- ml + w (g - ml), g null: zero; the update of clean_block, alone (the parameters
// whose pass does not run: no estimate in their group, or no compression).
template <typename L>
__attribute__((target_clones("avx512f", "avx2", "default"))) void advance_block(
    L* __restrict ml, const float* __restrict g, float w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float a = widen(ml[j]);
    ml[j] = narrow(((g == nullptr ? 0.0f : g[j]) - a) * w + a, ml);
  }
}

// The masked coordinates join the edge (y = 0 there).
void mark_masked(const bool* __restrict mk, int64_t n, float* __restrict y, uint8_t* __restrict edge) {
  for (int64_t j = 0; j < n; ++j) {
    edge[j] |= static_cast<uint8_t>(mk[j]);
    y[j] = mk[j] ? 0.0f : y[j];
  }
}

// cnt[b] = the edge flags set in the b-th kEdgeBlock elements of edge[0, n); returns their sum.
int64_t edge_counts(const uint8_t* __restrict edge, int64_t n, int64_t* __restrict cnt) {
  int64_t total = 0;
  for (int64_t lo = 0; lo < n; lo += kEdgeBlock) {
    const int64_t hi = std::min(n, lo + kEdgeBlock);
    uint32_t c = 0;  // a byte sum that vectorizes (a 64-bit one widens every byte first)
    for (int64_t j = lo; j < hi; ++j) c += edge[j];
    cnt[lo / kEdgeBlock] = c;
    total += c;
  }
  return total;
}

// sums[l] += y u0 over the elements j = l (mod 8). n is a multiple of 8 except in a range's
// last block.
__attribute__((target_clones("avx512f", "avx2", "default"))) void clean_sums(
    const float* __restrict u0, const float* __restrict y, int64_t n, double* __restrict sums) {
  double p[kLanes];
  for (int l = 0; l < kLanes; ++l) p[l] = sums[l];
  const int64_t whole = n - n % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) p[l] += static_cast<double>(y[j + l]) * static_cast<double>(u0[j + l]);
  }
  for (int64_t j = whole; j < n; ++j) p[j % kLanes] += static_cast<double>(y[j]) * static_cast<double>(u0[j]);
  for (int l = 0; l < kLanes; ++l) sums[l] = p[l];
}

double lanes_total(const double* lanes) {
  double t = 0.0;
  for (int l = 0; l < kLanes; ++l) t += lanes[l];
  return t;
}

void check(const at::Tensor& t, const char* name, int64_t n, at::ScalarType type, const char* op) {
  TORCH_CHECK_TYPE(t.scalar_type() == type, op, ": ", name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous() && t.device().is_cpu(), op, ": ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(n < 0 || t.numel() == n, op, ": ", name, " must have ", n, " elements, got ", t.numel());
}

// The constants of a pass, as torch turns each Python float into the tensors' dtype
// before an elementwise op (s: 1 / denom_scale, taken in fp64 first).
struct Consts {
  float s, e, c1, b, at_b;
  bool bounded;
  Consts(double bc1, double denom_scale, double eps, std::optional<double> bound, double edge_at)
      : s(static_cast<float>(1.0 / denom_scale)), e(static_cast<float>(eps)), c1(static_cast<float>(bc1)),
        b(static_cast<float>(bound.value_or(0.0))), at_b(static_cast<float>(edge_at)), bounded(bound.has_value()) {}
};

// clean_block for ml's dtype, the bound and the tracking known at run time.
template <typename L>
void run_block(const Consts& c, const float* m, const float* v, L* ml, const float* g, float w, int64_t k,
               float* u0, float* y, uint8_t* edge) {
  if (c.bounded) {
    if (g != nullptr) {
      clean_block<true, true>(m, v, ml, g, w, k, c.s, c.e, c.c1, c.b, c.at_b, u0, y, edge);
    } else {
      clean_block<true, false>(m, v, ml, g, w, k, c.s, c.e, c.c1, c.b, c.at_b, u0, y, edge);
    }
  } else if (g != nullptr) {
    clean_block<false, true>(m, v, ml, g, w, k, c.s, c.e, c.c1, c.b, c.at_b, u0, y, edge);
  } else {
    clean_block<false, false>(m, v, ml, g, w, k, c.s, c.e, c.c1, c.b, c.at_b, u0, y, edge);
  }
}

int64_t edge_blocks(int64_t n) { return (n + kEdgeBlock - 1) / kEdgeBlock; }

void lamb_clean_pass_cpu(at::Tensor& acc, at::Tensor& counts, const at::Tensor& m, const at::Tensor& v,
                         at::Tensor& ml, const std::optional<at::Tensor>& grad, double weight,
                         const std::optional<at::Tensor>& masked, double bc1,
                         double denom_scale, double eps, std::optional<double> bound, double edge_at,
                         int64_t every) {
  const char* op = "lbcomm::lamb_clean_pass_";
  const int64_t n = m.numel();
  TORCH_CHECK_VALUE(every >= 1, op, ": every must be >= 1, got ", every);
  check(acc, "acc", 2, at::kDouble, op);
  check(counts, "counts", edge_blocks(n), at::kLong, op);
  check(m, "exp_avg", n, at::kFloat, op);
  check(v, "exp_avg_sq", n, at::kFloat, op);
  TORCH_CHECK_TYPE(ml.scalar_type() == at::kFloat || ml.scalar_type() == at::kBFloat16, op,
                   ": exp_avg_local must be Float or BFloat16, got ", ml.scalar_type());
  check(ml, "exp_avg_local", n, ml.scalar_type(), op);
  if (grad.has_value()) check(*grad, "grad", n, at::kFloat, op);
  if (masked.has_value()) check(*masked, "masked", n, at::kBool, op);
  double* a = acc.data_ptr<double>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  const float* pm = m.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const bool half = ml.scalar_type() == at::kBFloat16;
  float* pl = half ? nullptr : ml.data_ptr<float>();
  // bf16's bits (at::BFloat16 holds its uint16_t and nothing else)
  uint16_t* pb = half ? reinterpret_cast<uint16_t*>(ml.data_ptr<at::BFloat16>()) : nullptr;
  const float* pg = grad.has_value() ? grad->data_ptr<float>() : nullptr;
  const float w = static_cast<float>(weight);
  const bool* mk = masked.has_value() ? masked->data_ptr<bool>() : nullptr;
  const Consts c(bc1, denom_scale, eps, bound, edge_at);
  double sums[kLanes] = {};
  int64_t seen = 0;
  float u0[kBlock], y[kBlock];
  uint8_t edge[kBlock];
  // every > 1: the runs 0, every, 2 every, ... of kBlock elements only (the rest untouched,
  // counted 0); whole blocks, so that the skipped memory is not fetched ahead
  const int64_t step = kBlock * every;
  if (every > 1) std::fill(cnt, cnt + edge_blocks(n), int64_t{0});
  for (int64_t lo = 0; lo < n; lo += step) {
    const int64_t k = std::min(kBlock, n - lo);
    const float* g = pg == nullptr ? nullptr : pg + lo;
    if (half) {
      run_block(c, pm + lo, pv + lo, pb + lo, g, w, k, u0, y, edge);
    } else {
      run_block(c, pm + lo, pv + lo, pl + lo, g, w, k, u0, y, edge);
    }
    if (mk != nullptr) mark_masked(mk + lo, k, y, edge);
    clean_sums(u0, y, k, sums);
    seen += edge_counts(edge, k, cnt + lo / kEdgeBlock);
  }
  a[0] += lanes_total(sums);
  a[1] += static_cast<double>(seen);
}

void lamb_advance_local_cpu(at::Tensor& ml, const std::optional<at::Tensor>& grad, double weight) {
  const char* op = "lbcomm::lamb_advance_local_";
  const int64_t n = ml.numel();
  TORCH_CHECK_TYPE(ml.scalar_type() == at::kFloat || ml.scalar_type() == at::kBFloat16, op,
                   ": exp_avg_local must be Float or BFloat16, got ", ml.scalar_type());
  check(ml, "exp_avg_local", n, ml.scalar_type(), op);
  if (grad.has_value()) check(*grad, "grad", n, at::kFloat, op);
  const float* g = grad.has_value() ? grad->data_ptr<float>() : nullptr;
  if (ml.scalar_type() == at::kBFloat16) {
    advance_block(reinterpret_cast<uint16_t*>(ml.data_ptr<at::BFloat16>()), g, static_cast<float>(weight), n);
  } else {
    advance_block(ml.data_ptr<float>(), g, static_cast<float>(weight), n);
  }
}

// out[i] = the index in the range of its draws[i]-th edge coordinate (numbered from 0 in
// the range, in any order; counts: the pass's per-block counts over the same range): the
// draws are visited in ascending order, and each block holding one has its edge flags
// computed again, as the pass computed them.
void lamb_edge_find_cpu(at::Tensor& out, const at::Tensor& draws, const at::Tensor& counts, const at::Tensor& m,
                        const at::Tensor& v, const std::optional<at::Tensor>& masked, double bc1, double denom_scale,
                        double eps, std::optional<double> bound, double edge_at) {
  const char* op = "lbcomm::lamb_edge_find_";
  const int64_t n = m.numel(), k = draws.numel(), nb = edge_blocks(n);
  check(draws, "draws", -1, at::kLong, op);
  check(out, "out", k, at::kLong, op);
  check(counts, "counts", nb, at::kLong, op);
  check(m, "exp_avg", n, at::kFloat, op);
  check(v, "exp_avg_sq", n, at::kFloat, op);
  if (masked.has_value()) check(*masked, "masked", n, at::kBool, op);
  const int64_t* d = draws.data_ptr<int64_t>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const float* pm = m.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const bool* mk = masked.has_value() ? masked->data_ptr<bool>() : nullptr;
  const Consts c(bc1, denom_scale, eps, bound, edge_at);
  std::vector<int64_t> order(k);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [d](int64_t x, int64_t y) { return d[x] < d[y]; });
  uint8_t edge[kEdgeBlock];
  int64_t blk = 0, before = 0, ready = -1;  // before: the edge coordinates ahead of block blk
  int64_t j = -1, rank = -1;                // in block ready: rank + 1 edge flags in [0, j]
  for (const int64_t i : order) {
    TORCH_CHECK_VALUE(d[i] >= 0, op, ": draws must be >= 0, got ", d[i]);
    while (blk < nb && before + cnt[blk] <= d[i]) before += cnt[blk++];
    TORCH_CHECK_VALUE(blk < nb, op, ": draw ", d[i], " is past the range's edge coordinates (", before, ")");
    const int64_t lo = blk * kEdgeBlock, len = std::min(kEdgeBlock, n - lo);
    if (ready != blk) {
      if (c.bounded) {
        edge_block<true>(pm + lo, pv + lo, len, c.s, c.e, c.c1, c.b, c.at_b, edge);
      } else {
        edge_block<false>(pm + lo, pv + lo, len, c.s, c.e, c.c1, c.b, c.at_b, edge);
      }
      if (mk != nullptr) {
        for (int64_t t = 0; t < len; ++t) edge[t] |= static_cast<uint8_t>(mk[lo + t]);
      }
      ready = blk;
      j = rank = -1;
    }
    while (rank < d[i] - before) {
      ++j;
      TORCH_CHECK_VALUE(j < len, op, ": the block's edge flags do not match its count");
      rank += edge[j];
    }
    o[i] = lo + j;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lbcomm, m) {
  m.def("lamb_clean_pass_(Tensor(a!) acc, Tensor(b!) counts, Tensor exp_avg, Tensor exp_avg_sq, "
        "Tensor(c!) exp_avg_local, Tensor? grad, float weight, Tensor? masked, float bc1, "
        "float denom_scale, float eps, float? bound, float edge_at, int every=1) -> ()");
  m.def("lamb_advance_local_(Tensor(a!) exp_avg_local, Tensor? grad, float weight) -> ()");
  m.def("lamb_edge_find_(Tensor(a!) out, Tensor draws, Tensor counts, Tensor exp_avg, Tensor exp_avg_sq, "
        "Tensor? masked, float bc1, float denom_scale, float eps, float? bound, float edge_at) -> ()");
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) {
  m.impl("lamb_clean_pass_", &lamb_clean_pass_cpu);
  m.impl("lamb_edge_find_", &lamb_edge_find_cpu);
  m.impl("lamb_advance_local_", &lamb_advance_local_cpu);
}

}  // namespace lbcomm
