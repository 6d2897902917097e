// OneBitLamb's update direction over one range of a parameter as one fused op, roots
// included (lbcomm/optim/kernels.py wraps it and holds the pure-torch sequence, which runs
// where the op cannot). The roots are IEEE's (correctly rounded, as in the compression
// stage's other fused ops: torch's fp32 CPU sqrt is not correctly rounded on every host).
// Per coordinate, each operation rounded as torch's CPU ops round it:
//
//   d = sqrt(v) / scale + eps
//   with v_fresh: r = sqrt(v_fresh) / scale + eps;  q = d / r into `ratio` (f's ratio; the
//   caller takes torch.amax of it)
//   u = (m / bc1) / d, then clamped to [-B, B] with a bound B
//
// Ten torch passes over the range (two roots, the two denominators, the ratio, the
// quotient, the clamp) become one that reads v, v_fresh and m and writes u and q. Built
// with -ffp-contract=off (no FMA) and -fno-math-errno (sqrt vectorizes to the IEEE root).
//
// lbcomm::implied_variance_, the fresh variance from the reduced momentum (before the
// direction, in the momentum's sink), one pass instead of six torch ones:
//
//   g = (m_new - m * b1) / (1 - b1);  v_fresh = fma((1 - b2) * g, g, v_fresh * b2);  m = m_new
//
// the fma as torch's CPU addcmul_ rounds v + (w * t1) * t2 (its vectorized kernels fuse the
// last multiply-add).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "kernels.h"

namespace lbcomm {
namespace {

// One range; F: with the fresh variance (q written to ratio); B: clamped. No reduction in
// the loop, so that it vectorizes (the ratio's max is torch.amax over q afterwards).
template <bool F, bool B>
__attribute__((target_clones("avx512f", "avx2", "default"))) void direction_range(
    float* __restrict u, const float* __restrict m, const float* __restrict v, const float* __restrict vf,
    float* __restrict q, int64_t n, float s, float e, float b1, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = std::sqrt(v[i]) / s + e;
    if (F) q[i] = d / (std::sqrt(vf[i]) / s + e);
    float x = (m[i] / b1) / d;
    if (B) {
      x = x < lo ? lo : x;  // a NaN stays NaN, as torch.clamp_
      x = x > hi ? hi : x;
    }
    u[i] = x;
  }
}

void lamb_direction_cpu(at::Tensor& u, const at::Tensor& m, const at::Tensor& v, const std::optional<at::Tensor>& vf,
                        at::Tensor& ratio, double scale, double eps, double bc1, std::optional<double> bound) {
  const char* op = "lbcomm::lamb_direction_";
  const int64_t n = u.numel();
  const at::Tensor* ts[] = {&u, &m, &v, vf.has_value() ? &*vf : &v, vf.has_value() ? &ratio : &v};
  for (const at::Tensor* t : ts) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": u, exp_avg, exp_avg_sq, exp_avg_sq_fresh and ratio ",
                     "must be Float, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu() && t->numel() == n, op,
                      ": u, exp_avg, exp_avg_sq, exp_avg_sq_fresh and ratio must be contiguous CPU tensors of ", n,
                      " elements");
  }
  TORCH_CHECK_VALUE(!bound.has_value() || *bound >= 0, op, ": bound must be >= 0, got ", bound.value_or(0.0));
  // torch rounds each Python float to the tensor's dtype before the elementwise op
  const float s = static_cast<float>(scale), e = static_cast<float>(eps), b1 = static_cast<float>(bc1);
  const float hi = bound.has_value() ? static_cast<float>(*bound) : 0.0f, lo = -hi;
  float* pu = u.data_ptr<float>();
  const float* pm = m.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  if (vf.has_value()) {
    const float* pf = vf->data_ptr<float>();
    float* pq = ratio.data_ptr<float>();
    bound ? direction_range<true, true>(pu, pm, pv, pf, pq, n, s, e, b1, lo, hi)
          : direction_range<true, false>(pu, pm, pv, pf, pq, n, s, e, b1, lo, hi);
  } else {
    bound ? direction_range<false, true>(pu, pm, pv, nullptr, nullptr, n, s, e, b1, lo, hi)
          : direction_range<false, false>(pu, pm, pv, nullptr, nullptr, n, s, e, b1, lo, hi);
  }
}

// The fused multiply-add needs the FMA instructions to vectorize: a body built for AVX2 + FMA,
// taken where the CPU has both (target_clones would pick "arch=haswell" by architecture, not
// by these two features), and the portable one (std::fma through libm: the same bits).
__attribute__((always_inline)) inline void implied_loop(float* __restrict vf, const float* __restrict mn,
                                                        float* __restrict m, int64_t n, float b1, float c1, float b2,
                                                        float c2) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = (mn[i] - m[i] * b1) / c1;
    vf[i] = std::fma(c2 * g, g, vf[i] * b2);
    m[i] = mn[i];
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void implied_range_fma(float* vf, const float* mn, float* m, int64_t n, float b1,
                                                             float c1, float b2, float c2) {
  implied_loop(vf, mn, m, n, b1, c1, b2, c2);
}
#endif

void implied_range(float* vf, const float* mn, float* m, int64_t n, float b1, float c1, float b2, float c2) {
#if defined(__x86_64__)
  // the compressing kernels' check (AVX2, FMA and F16C; off with LBCOMM_DISABLE_AVX2=1)
  if (cpu::has_avx2()) return implied_range_fma(vf, mn, m, n, b1, c1, b2, c2);
#endif
  implied_loop(vf, mn, m, n, b1, c1, b2, c2);
}

void implied_variance_cpu(at::Tensor& vf, const at::Tensor& mn, at::Tensor& m, double b1, double b2) {
  const char* op = "lbcomm::implied_variance_";
  const int64_t n = vf.numel();
  const at::Tensor* ts[] = {&vf, &mn, &m};
  for (const at::Tensor* t : ts) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": v_fresh, m_new and m must be Float, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu() && t->numel() == n, op,
                      ": v_fresh, m_new and m must be contiguous CPU tensors of ", n, " elements");
  }
  // each Python float rounded to fp32, as torch's ops take them
  implied_range(vf.data_ptr<float>(), mn.data_ptr<float>(), m.data_ptr<float>(), n, static_cast<float>(b1),
                static_cast<float>(1 - b1), static_cast<float>(b2), static_cast<float>(1 - b2));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lbcomm, m) {
  m.def("lamb_direction_(Tensor(a!) u, Tensor exp_avg, Tensor exp_avg_sq, Tensor? exp_avg_sq_fresh, "
        "Tensor(b!) ratio, float scale, float eps, float bc1, float? bound) -> ()");
  m.def("implied_variance_(Tensor(a!) v_fresh, Tensor m_new, Tensor(b!) m, float b1, float b2) -> ()");
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) {
  m.impl("lamb_direction_", &lamb_direction_cpu);
  m.impl("implied_variance_", &implied_variance_cpu);
}

}  // namespace lbcomm
