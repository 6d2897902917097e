// Validation shared by the CPU and CUDA bodies of lbcomm::frozen_adamw_ (csrc/optim.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace lbcomm {

// bound: the optional clamp of each coordinate's step (must be >= 0).
void check_frozen_adamw(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& sqrt_v,
                        std::optional<double> bound);

}  // namespace lbcomm
