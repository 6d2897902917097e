// Validation shared by the CPU and CUDA bodies of lbcomm::frozen_adamw_ (csrc/optim.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace lbcomm {

// The C++ signature of frozen_adamw_'s kernels on every backend (see kernel<Fn> in ops.h).
using FrozenAdamwFn = void(at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           double denom_scale, double eps, double keep, double neg_step, std::optional<double> bound);

// bound: the optional clamp of each coordinate's step (must be >= 0).
void check_frozen_adamw(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        std::optional<double> bound);

}  // namespace lbcomm
