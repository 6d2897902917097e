// OneBitLamb's update direction over one range of a parameter as one fused op, after its
// roots (lbcomm/optim/kernels.py wraps it and holds the pure-torch sequence it replaces,
// which runs where the op cannot). On entry root_v = torch.sqrt(v) and, with `fresh`,
// u = torch.sqrt(v_fresh): torch's roots, so the direction keeps AdamW's denominator bit
// for bit. Per coordinate, each operation rounded as torch's CPU ops round it:
//
//   d = root_v / scale + eps
//   with fresh: r = u / scale + eps;  q = d / r, written over root_v (f's ratio; the caller
//   takes torch.amax of it)
//   u = (m / bc1) / d, then clamped to [-B, B] with a bound B
//
// Eight torch passes over the range (the two denominators, the ratio, the quotient, the
// clamp) become one that reads root_v, u and m and writes u and q. Built with
// -ffp-contract=off (no FMA).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>

namespace lbcomm {
namespace {

// One range; F: with the fresh root in u (q written over root_v); B: clamped. No reduction
// in the loop, so that it vectorizes (the ratio's max is torch.amax over q afterwards).
template <bool F, bool B>
__attribute__((target_clones("avx512f", "avx2", "default"))) void direction_range(
    float* __restrict u, const float* __restrict m, float* __restrict rv, int64_t n, float s, float e, float b1,
    float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = rv[i] / s + e;
    if (F) rv[i] = d / (u[i] / s + e);
    float x = (m[i] / b1) / d;
    if (B) {
      x = x < lo ? lo : x;  // a NaN stays NaN, as torch.clamp_
      x = x > hi ? hi : x;
    }
    u[i] = x;
  }
}

void lamb_direction_cpu(at::Tensor& u, const at::Tensor& m, at::Tensor& root_v, double scale, double eps, double bc1,
                        std::optional<double> bound, bool fresh) {
  const char* op = "lbcomm::lamb_direction_";
  const int64_t n = u.numel();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&u, &m, &root_v}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": u, exp_avg and root_v must be Float, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu() && t->numel() == n, op,
                      ": u, exp_avg and root_v must be contiguous CPU tensors of ", n, " elements");
  }
  TORCH_CHECK_VALUE(!bound.has_value() || *bound >= 0, op, ": bound must be >= 0, got ", bound.value_or(0.0));
  // torch rounds each Python float to the tensor's dtype before the elementwise op
  const float s = static_cast<float>(scale), e = static_cast<float>(eps), b1 = static_cast<float>(bc1);
  const float hi = bound.has_value() ? static_cast<float>(*bound) : 0.0f, lo = -hi;
  float* pu = u.data_ptr<float>();
  const float* pm = m.data_ptr<float>();
  float* pr = root_v.data_ptr<float>();
  if (fresh) {
    bound ? direction_range<true, true>(pu, pm, pr, n, s, e, b1, lo, hi)
          : direction_range<true, false>(pu, pm, pr, n, s, e, b1, lo, hi);
  } else {
    bound ? direction_range<false, true>(pu, pm, pr, n, s, e, b1, lo, hi)
          : direction_range<false, false>(pu, pm, pr, n, s, e, b1, lo, hi);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lbcomm, m) {
  m.def("lamb_direction_(Tensor(a!) u, Tensor exp_avg, Tensor(b!) root_v, float scale, float eps, float bc1, "
        "float? bound, bool fresh) -> ()");
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) { m.impl("lamb_direction_", &lamb_direction_cpu); }

}  // namespace lbcomm
