// CUDA binding of lbcomm::frozen_adamw_ (schema and checks in csrc/optim.cpp, kernel in optim.cu).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "ops.h"
#include "optim.h"
#include "optim_kernels.h"

namespace lbcomm {
namespace {

void frozen_adamw_cuda(at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                       double denom_scale, double eps, double keep, double neg_step, std::optional<double> bound) {
  check_frozen_adamw(param, exp_avg, exp_avg_sq, bound);
  const c10::cuda::CUDAGuard guard(param.device());
  // torch's CUDA division by a scalar multiplies by the reciprocal, computed in float
  const float inv_scale = 1.0f / static_cast<float>(denom_scale);
  const int err = cuda::frozen_adamw(param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                                     param.numel(), inv_scale, static_cast<float>(eps), static_cast<float>(keep),
                                     static_cast<float>(neg_step), bound.has_value() ? 1 : 0,
                                     static_cast<float>(bound.value_or(0.0)), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "lbcomm::frozen_adamw_: CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY_IMPL(lbcomm, CUDA, m) { m.impl("frozen_adamw_", kernel<FrozenAdamwFn>(&frozen_adamw_cuda)); }

}  // namespace lbcomm
