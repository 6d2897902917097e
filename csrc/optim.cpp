// The frozen-variance AdamW update of OneBitAdam's compression stage as one fused op
// (lbcomm/optim/kernels.py wraps it; the pure-torch sequence it replaces is
// lbcomm.optim.functional.frozen_adamw_). With v the frozen variance:
//
//   d = sqrt(v) / denom_scale + eps;  p = p * keep;  p = p + (neg_step * m) / d
//
// and with a bound B (the optimizers' max_update option), the step of each coordinate
// clamped to [-B, B] before it is added:
//
//   q = (neg_step * m) / d;  q = clamp(q, -B, B);  p = p * keep + q
//
// one pass that reads p, m, v and writes p. The square root is IEEE's (correctly rounded,
// as the fallback's fp64 root rounded to fp32, so both agree on every ISA; torch's fp32
// CPU sqrt is neither correctly rounded nor fast, and staging it took longer than this
// whole pass). The rest rounds exactly as torch's CPU ops (div by a scalar, add of a
// scalar, mul by a scalar, addcdiv: (value * m) / d, then the add; mul, div_, clamp_, add_;
// all correctly rounded IEEE operations, so an unclamped coordinate gets bitwise the
// unbounded update).
// Built with -ffp-contract=off so that nothing is fused into an FMA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "ops.h"
#include "optim.h"

namespace lbcomm {

void check_frozen_adamw(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        std::optional<double> bound) {
  const char* op = "lbcomm::frozen_adamw_";
  TORCH_CHECK_VALUE(!bound.has_value() || *bound >= 0.0, op, ": bound must be >= 0 (or None), got ",
                    bound.value_or(0.0));
  for (const auto* t : {&param, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": expected float32 tensors, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": expected contiguous tensors, got strides ", t->strides());
    TORCH_CHECK_VALUE(t->device() == param.device(), op, ": expected all tensors on ", param.device(), ", got ",
                      t->device());
  }
  TORCH_CHECK_VALUE(exp_avg.numel() == param.numel() && exp_avg_sq.numel() == param.numel(), op,
                    ": param, exp_avg and exp_avg_sq must have as many elements, got ", param.numel(), ", ",
                    exp_avg.numel(), " and ", exp_avg_sq.numel());
}

namespace {

// Cloned per ISA (picked at load time): the divisions dominate, and wider vectors divide
// more per cycle. Every clone computes the same correctly rounded IEEE operations.
__attribute__((target_clones("avx512f", "avx2", "default"))) void frozen_adamw_range(
    float* p, const float* m, const float* v, int64_t lo, int64_t hi, float s, float e, float k, float a) {
  for (int64_t i = lo; i < hi; ++i) {
    const float d = std::sqrt(v[i]) / s + e;
    const float w = p[i] * k;
    p[i] = w + (a * m[i]) / d;
  }
}

// The same with the step clamped to [-b, b] (a NaN step stays NaN, as torch.clamp_ keeps it).
__attribute__((target_clones("avx512f", "avx2", "default"))) void frozen_adamw_bounded_range(
    float* p, const float* m, const float* v, int64_t lo, int64_t hi, float s, float e, float k, float a, float b) {
  for (int64_t i = lo; i < hi; ++i) {
    const float d = std::sqrt(v[i]) / s + e;
    float q = (a * m[i]) / d;
    q = q > b ? b : (q < -b ? -b : q);
    p[i] = p[i] * k + q;
  }
}

// The same with the capped decode's caps applied here rather than by the decode: the
// momentum, decoded uncapped (+-scale), becomes sign(m) min(|m|, c) with c = sqrt(v) ca + cb
// (decode_caps_range's roundings, from the root the denominator takes) and is written back
// (every value, unchanged ones too): bitwise the value the capped decode would have written
// (csrc/cpu/kernels.cpp: `capped`, MINPS; a NaN cap leaves m). b = +inf: no step bound
// (the clamp then changes nothing, NaN included).
__attribute__((target_clones("avx512f", "avx2", "default"))) void frozen_adamw_capped_range(
    float* p, float* m, const float* v, int64_t lo, int64_t hi, float s, float e, float k, float a, float b,
    float ca, float cb) {
  for (int64_t i = lo; i < hi; ++i) {
    const float r = std::sqrt(v[i]);
    const float c = r * ca + cb;
    // branch-free, so that it vectorizes: where caps bind is data-dependent
    const float mi = c < std::fabs(m[i]) ? std::copysign(c, m[i]) : m[i];
    m[i] = mi;
    const float d = r / s + e;
    float q = (a * mi) / d;
    q = q > b ? b : (q < -b ? -b : q);
    p[i] = p[i] * k + q;
  }
}

void frozen_adamw_cpu(at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      double denom_scale, double eps, double keep, double neg_step, std::optional<double> bound) {
  check_frozen_adamw(param, exp_avg, exp_avg_sq, bound);
  float* p = param.data_ptr<float>();
  const float* m = exp_avg.data_ptr<float>();
  const float* v = exp_avg_sq.data_ptr<float>();
  // torch turns each Python float into the tensor's dtype before the elementwise op
  const float s = static_cast<float>(denom_scale), e = static_cast<float>(eps);
  const float k = static_cast<float>(keep), a = static_cast<float>(neg_step);
  if (bound.has_value()) {
    const float b = static_cast<float>(*bound);
    at::parallel_for(0, param.numel(), 1 << 15,
                     [&](int64_t lo, int64_t hi) { frozen_adamw_bounded_range(p, m, v, lo, hi, s, e, k, a, b); });
    return;
  }
  at::parallel_for(0, param.numel(), 1 << 15,
                   [&](int64_t lo, int64_t hi) { frozen_adamw_range(p, m, v, lo, hi, s, e, k, a); });
}

// frozen_adamw_ that first caps the momentum in place (frozen_adamw_capped_range): the
// 1-bit optimizers' update when the reducer left the result's caps to it (CPU only).
void frozen_adamw_capped_cpu(at::Tensor& param, at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                             double denom_scale, double eps, double keep, double neg_step, std::optional<double> bound,
                             double cap_a, double cap_b) {
  check_frozen_adamw(param, exp_avg, exp_avg_sq, bound);
  TORCH_CHECK_VALUE(param.device().is_cpu(), "lbcomm::frozen_adamw_capped_: CPU tensors only, got ", param.device());
  TORCH_CHECK_VALUE(cap_a >= 0.0 && cap_b >= 0.0, "lbcomm::frozen_adamw_capped_: the cap coefficients must be >= 0, got ",
                    cap_a, " and ", cap_b);
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  const float* v = exp_avg_sq.data_ptr<float>();
  const float s = static_cast<float>(denom_scale), e = static_cast<float>(eps);
  const float k = static_cast<float>(keep), a = static_cast<float>(neg_step);
  const float b = bound.has_value() ? static_cast<float>(*bound) : std::numeric_limits<float>::infinity();
  const float ca = static_cast<float>(cap_a), cb = static_cast<float>(cap_b);
  at::parallel_for(0, param.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    frozen_adamw_capped_range(p, m, v, lo, hi, s, e, k, a, b, ca, cb);
  });
}

// The capped decode's caps (lbcomm/optim/bounds.py), out = (sqrt(v) a + b) s, in one pass
// instead of four. Its sqrt is IEEE's (correctly rounded: the fp64 root rounded to fp32,
// which the torch fallback and the reference take, so they agree on every ISA); then the
// multiply, the add and the scale, each rounded as torch's ops round them.
__attribute__((target_clones("avx512f", "avx2", "default"))) void decode_caps_range(
    float* __restrict out, const float* __restrict v, int64_t lo, int64_t hi, float a, float b, float s) {
  for (int64_t i = lo; i < hi; ++i) out[i] = (std::sqrt(v[i]) * a + b) * s;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void decode_caps_range(
    float* __restrict out, const float* __restrict v, int64_t lo, int64_t hi, float a, float b) {
  for (int64_t i = lo; i < hi; ++i) out[i] = std::sqrt(v[i]) * a + b;
}

}  // namespace

namespace cpu {
void table_caps(const CapTable& t, int64_t i0, int64_t n, float* out) {
  const int64_t lo = t.lo + i0, hi = lo + n;
  // the parameter holding lo: the last start <= lo
  int64_t p = std::upper_bound(t.starts, t.starts + t.params + 1, lo) - t.starts - 1;
  for (int64_t x = lo; x < hi; ++p) {
    const int64_t end = std::min(hi, t.starts[p + 1]);
    const float a = t.table[3 * p], b = t.table[3 * p + 1], s = t.table[3 * p + 2];
    float* dst = out + (x - lo);
    if (std::isinf(b) && b > 0) {
      std::fill(dst, dst + (end - x), std::numeric_limits<float>::infinity());
    } else if (s == 1.0f) {
      decode_caps_range(dst, t.v + x, 0, end - x, a, b);
    } else {
      decode_caps_range(dst, t.v + x, 0, end - x, a, b, s);
    }
    x = end;
  }
}
}  // namespace cpu

CapTable check_cap_table(const at::Tensor& v, const at::Tensor& starts, const at::Tensor& table, int64_t lo,
                         int64_t n, const char* op) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&v, &table}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": the variance and the cap table must be Float, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu(), op,
                      ": the variance and the cap table must be contiguous CPU tensors");
  }
  TORCH_CHECK_TYPE(starts.scalar_type() == at::kLong, op, ": starts must be Long, got ", starts.scalar_type());
  TORCH_CHECK_VALUE(starts.is_contiguous() && starts.device().is_cpu() && starts.dim() == 1 && starts.numel() >= 2, op,
                    ": starts must be a contiguous 1-D CPU tensor of at least 2 offsets");
  const int64_t params = starts.numel() - 1, hi = lo + n;
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == params && table.size(1) == 3, op,
                    ": table must be [", params, ", 3] (a, b, s per parameter), got ", table.sizes());
  const int64_t* st = starts.data_ptr<int64_t>();
  for (int64_t p = 0; p < params; ++p) {
    TORCH_CHECK_VALUE(st[p + 1] >= st[p], op, ": starts must not decrease");
  }
  TORCH_CHECK_VALUE(lo >= st[0] && hi <= st[params] && hi <= v.numel(), op, ": the range [", lo, ", ", hi,
                    ") must lie in the layout [", st[0], ", ", st[params], ") and in v (", v.numel(), " elements)");
  return CapTable{v.data_ptr<float>(), lo, st, table.data_ptr<float>(), params};
}

namespace {

void decode_caps_cpu(at::Tensor& out, const at::Tensor& v, double a, double b,
                     const std::optional<at::Tensor>& scale) {
  const char* op = "lbcomm::decode_caps_";
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &v}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": out and v must be Float, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu(), op, ": out and v must be contiguous CPU tensors");
  }
  TORCH_CHECK_VALUE(out.numel() == v.numel(), op, ": out and v must have as many elements, got ", out.numel(),
                    " and ", v.numel());
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->numel() == 1 && scale->scalar_type() == at::kFloat && scale->device().is_cpu(), op,
                      ": scale must be one Float on the CPU");
  }
  float* o = out.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  // torch turns each Python float into the tensor's dtype before the elementwise op
  const float fa = static_cast<float>(a), fb = static_cast<float>(b);
  if (scale.has_value()) {
    const float s = scale->item<float>();
    at::parallel_for(0, v.numel(), 1 << 15,
                     [&](int64_t lo, int64_t hi) { decode_caps_range(o, pv, lo, hi, fa, fb, s); });
  } else {
    at::parallel_for(0, v.numel(), 1 << 15, [&](int64_t lo, int64_t hi) { decode_caps_range(o, pv, lo, hi, fa, fb); });
  }
}

// decode_caps_table_: the caps of flat elements [lo, lo + out.numel()) of a layout of
// parameters (starts: int64 [P + 1], each parameter's first flat element and the end;
// table: fp32 [P, 3], per parameter (a, b, s)): out = (sqrt(v) a + b) s, the same operations
// as decode_caps_ (s == 1: no multiply; b == +inf: uncapped, +inf), so one call covers a
// range that spans many parameters instead of one call per parameter. The compressing ops
// compute the same caps unit by unit (kernels.h, CapTable) with cpu::table_caps.
void decode_caps_table_cpu(at::Tensor& out, const at::Tensor& v, int64_t lo, const at::Tensor& starts,
                           const at::Tensor& table) {
  const char* op = "lbcomm::decode_caps_table_";
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, op, ": out must be Float, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.device().is_cpu(), op, ": out must be a contiguous CPU tensor");
  const CapTable t = check_cap_table(v, starts, table, lo, out.numel(), op);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), 1 << 15, [&](int64_t i0, int64_t i1) { cpu::table_caps(t, i0, i1 - i0, o + i0); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lbcomm, m) {
  m.def("frozen_adamw_(Tensor(a!) param, Tensor exp_avg, Tensor exp_avg_sq, float denom_scale, float eps, "
        "float keep, float neg_step, float? bound=None) -> ()");
  m.def("frozen_adamw_capped_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor exp_avg_sq, float denom_scale, "
        "float eps, float keep, float neg_step, float? bound, float cap_a, float cap_b) -> ()");
  m.def("decode_caps_(Tensor(a!) out, Tensor v, float a, float b, Tensor? scale) -> ()");
  m.def("decode_caps_table_(Tensor(a!) out, Tensor v, int lo, Tensor starts, Tensor table) -> ()");
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) {
  m.impl("frozen_adamw_", kernel<FrozenAdamwFn>(&frozen_adamw_cpu));
  m.impl("frozen_adamw_capped_", &frozen_adamw_capped_cpu);
  m.impl("decode_caps_", &decode_caps_cpu);
  m.impl("decode_caps_table_", &decode_caps_table_cpu);
}

}  // namespace lbcomm
