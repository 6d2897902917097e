// Validation shared by the CPU and CUDA bodies of lbcomm::frozen_adamw_ (csrc/optim.cpp).
#pragma once
#include <ATen/core/Tensor.h>

namespace lbcomm {

void check_frozen_adamw(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& sqrt_v);

}  // namespace lbcomm
