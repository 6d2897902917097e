// The pass of OneBitLamb's clean-norm estimate over one range of a parameter as one fused
// op (lbcomm/optim/lamb_norm.py wraps it and holds the pure-torch sequence it replaces,
// which runs where the op cannot). Per coordinate, in fp32 with torch's roundings:
//
//   d = sqrt(v) / denom_scale + eps;  q = d bc1;  u0 = m / q;  y = ml / q
//   with a bound B: u0 = clamp(u0, -B, B), y = clamp(y, -B, B), edge = |u0| >= edge_at
//   edge |= masked (the momentum mask)
//
// and over the range, in fp64 (the products of two fp32 values are exact in fp64):
//
//   acc[0] += sum over the non-edge coordinates of y u0
//   acc[1] += sum of u0 theta;  acc[2] += sum of theta^2        (when theta is given)
//   acc[3] += the number of edge coordinates
//
// The edge coordinates are numbered on from acc[3]; those numbered in [skip, skip +
// positions.numel()) have base + their index in the range written to positions (nothing
// else is written). The sums run in a fixed order on one thread (8 lanes of every 8th
// element, then the lanes in order): the same bits on every rank and thread count.
// sqrt is IEEE's (correctly rounded, the same on every ISA; torch's vectorized sqrt is not,
// see csrc/optim.cpp), so u0 may differ from the direction's (m / bc1) / d by an ulp or two:
// the edge's threshold (edge_at, below the bound by far more) allows for that. Built with
// -ffp-contract=off (no FMA).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace lbcomm {
namespace {

constexpr int64_t kBlock = 512;
constexpr int kLanes = 8;  // the fp64 sums: lane l adds the elements j = l (mod 8), then the lanes in order

// One block's u0, y (0 on the edge: only its products off the edge are summed) and edge
// flags, without branches (vectorized; B: with the bound). Cloned per ISA: the divisions
// dominate. ml (the rank's own momentum) is fp32 or bf16, widened exactly to fp32.
template <bool B, typename L>
__attribute__((target_clones("avx512f", "avx2", "default"))) void clean_block(
    const float* __restrict m, const float* __restrict v, const L* __restrict ml, int64_t n, float s, float e,
    float c1, float b, float at_b, float* __restrict u0, float* __restrict y, uint8_t* __restrict edge) {
  for (int64_t j = 0; j < n; ++j) {
    const float q = (std::sqrt(v[j]) / s + e) * c1;
    float u = m[j] / q;
    float w = static_cast<float>(ml[j]) / q;
    if (B) {  // torch.clamp_: a NaN stays NaN
      u = u > b ? b : (u < -b ? -b : u);
      w = w > b ? b : (w < -b ? -b : w);
    }
    const bool at = B && std::fabs(u) >= at_b;
    u0[j] = u;
    y[j] = at ? 0.0f : w;
    edge[j] = static_cast<uint8_t>(at);
  }
}

// The masked coordinates join the edge (y = 0 there).
void mark_masked(const bool* __restrict mk, int64_t n, float* __restrict y, uint8_t* __restrict edge) {
  for (int64_t j = 0; j < n; ++j) {
    edge[j] |= static_cast<uint8_t>(mk[j]);
    y[j] = mk[j] ? 0.0f : y[j];
  }
}

// sums[0][l] += y u0, sums[1][l] += u0 theta, sums[2][l] += theta^2 (theta given) over the
// elements j = l (mod 8); returns the edge count. n is a multiple of 8 except in a range's
// last block.
__attribute__((target_clones("avx512f", "avx2", "default"))) int64_t clean_sums(
    const float* __restrict u0, const float* __restrict y, const uint8_t* __restrict edge,
    const float* __restrict th, int64_t n, double (*__restrict sums)[kLanes]) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) count += edge[j];
  double p[kLanes], ut[kLanes], tt[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    p[l] = sums[0][l];
    ut[l] = sums[1][l];
    tt[l] = sums[2][l];
  }
  const int64_t whole = n - n % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) p[l] += static_cast<double>(y[j + l]) * static_cast<double>(u0[j + l]);
  }
  for (int64_t j = whole; j < n; ++j) p[j % kLanes] += static_cast<double>(y[j]) * static_cast<double>(u0[j]);
  if (th != nullptr) {
    for (int64_t j = 0; j < whole; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const double t = th[j + l];
        ut[l] += static_cast<double>(u0[j + l]) * t;
        tt[l] += t * t;
      }
    }
    for (int64_t j = whole; j < n; ++j) {
      const double t = th[j];
      ut[j % kLanes] += static_cast<double>(u0[j]) * t;
      tt[j % kLanes] += t * t;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    sums[0][l] = p[l];
    sums[1][l] = ut[l];
    sums[2][l] = tt[l];
  }
  return count;
}

// out[0..count) = first + the indices of the edge flags set, in order (nothing else written):
// when few are set, eight flags (bytes of 0 or 1) at a time, skipping the words without one;
// else every index written and the position advanced by the flag.
void record_edge(const uint8_t* edge, int64_t n, int64_t count, int64_t first, int64_t* out) {
  if (4 * count > n) {
    const int64_t kept = count < n ? out[count] : 0;  // the loop writes out[count] too: put it back
    int64_t w = 0;
    for (int64_t j = 0; j < n; ++j) {
      out[w] = first + j;
      w += edge[j];
    }
    if (count < n) out[count] = kept;
    return;
  }
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, edge + j, 8);
    while (w != 0) {
      *out++ = first + j + (__builtin_ctzll(w) >> 3);
      w &= w - 1;
    }
  }
  for (; j < n; ++j) {
    if (edge[j]) *out++ = first + j;
  }
}

double lanes_total(const double* lanes) {
  double t = 0.0;
  for (int l = 0; l < kLanes; ++l) t += lanes[l];
  return t;
}

void check(const at::Tensor& t, const char* name, int64_t n, at::ScalarType type) {
  const char* op = "lbcomm::lamb_clean_pass_";
  TORCH_CHECK_TYPE(t.scalar_type() == type, op, ": ", name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous() && t.device().is_cpu(), op, ": ", name, " must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(n < 0 || t.numel() == n, op, ": ", name, " must have ", n, " elements, got ", t.numel());
}

void lamb_clean_pass_cpu(at::Tensor& acc, at::Tensor& positions, const at::Tensor& m, const at::Tensor& v,
                         const at::Tensor& ml, const std::optional<at::Tensor>& theta,
                         const std::optional<at::Tensor>& masked, int64_t base, int64_t skip, double bc1,
                         double denom_scale, double eps, std::optional<double> bound, double edge_at) {
  const int64_t n = m.numel();
  check(acc, "acc", 4, at::kDouble);
  check(positions, "positions", -1, at::kLong);
  check(m, "exp_avg", n, at::kFloat);
  check(v, "exp_avg_sq", n, at::kFloat);
  TORCH_CHECK_TYPE(ml.scalar_type() == at::kFloat || ml.scalar_type() == at::kBFloat16,
                   "lbcomm::lamb_clean_pass_: exp_avg_local must be Float or BFloat16, got ", ml.scalar_type());
  check(ml, "exp_avg_local", n, ml.scalar_type());
  if (theta.has_value()) check(*theta, "theta", n, at::kFloat);
  if (masked.has_value()) check(*masked, "masked", n, at::kBool);
  double* a = acc.data_ptr<double>();
  int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t cap = positions.numel();
  const float* pm = m.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const bool half = ml.scalar_type() == at::kBFloat16;
  const float* pl = half ? nullptr : ml.data_ptr<float>();
  const c10::BFloat16* pb = half ? ml.data_ptr<c10::BFloat16>() : nullptr;
  const float* th = theta.has_value() ? theta->data_ptr<float>() : nullptr;
  const bool* mk = masked.has_value() ? masked->data_ptr<bool>() : nullptr;
  // torch turns each Python float into the tensors' dtype before the elementwise op
  const float s = static_cast<float>(denom_scale), e = static_cast<float>(eps), c1 = static_cast<float>(bc1);
  const float b = static_cast<float>(bound.value_or(0.0)), at_b = static_cast<float>(edge_at);
  const bool bounded = bound.has_value();
  double sums[3][kLanes] = {};
  int64_t seen = static_cast<int64_t>(a[3]);
  float u0[kBlock], y[kBlock];
  uint8_t edge[kBlock];
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t k = std::min(kBlock, n - lo);
    if (half) {
      if (bounded) {
        clean_block<true>(pm + lo, pv + lo, pb + lo, k, s, e, c1, b, at_b, u0, y, edge);
      } else {
        clean_block<false>(pm + lo, pv + lo, pb + lo, k, s, e, c1, b, at_b, u0, y, edge);
      }
    } else if (bounded) {
      clean_block<true>(pm + lo, pv + lo, pl + lo, k, s, e, c1, b, at_b, u0, y, edge);
    } else {
      clean_block<false>(pm + lo, pv + lo, pl + lo, k, s, e, c1, b, at_b, u0, y, edge);
    }
    if (mk != nullptr) mark_masked(mk + lo, k, y, edge);
    const int64_t count = clean_sums(u0, y, edge, th == nullptr ? nullptr : th + lo, k, sums);
    if (count == 0) continue;
    if (seen >= skip && seen + k <= skip + cap) {  // the whole block fits the window
      record_edge(edge, k, count, base + lo, pos + (seen - skip));
    } else {
      int64_t at = seen;
      for (int64_t j = 0; j < k; ++j) {
        if (edge[j]) {
          if (at >= skip && at - skip < cap) pos[at - skip] = base + lo + j;
          ++at;
        }
      }
    }
    seen += count;
  }
  a[0] += lanes_total(sums[0]);
  a[1] += lanes_total(sums[1]);
  a[2] += lanes_total(sums[2]);
  a[3] = static_cast<double>(seen);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lbcomm, m) {
  m.def("lamb_clean_pass_(Tensor(a!) acc, Tensor(b!) positions, Tensor exp_avg, Tensor exp_avg_sq, "
        "Tensor exp_avg_local, Tensor? theta, Tensor? masked, int base, int skip, float bc1, float denom_scale, "
        "float eps, float? bound, float edge_at) -> ()");
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) { m.impl("lamb_clean_pass_", &lamb_clean_pass_cpu); }

}  // namespace lbcomm
