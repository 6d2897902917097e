// CUDA body of lbcomm::frozen_adamw_ (see csrc/optim.cpp): one pass over p, m, v (IEEE root) with the
// rounding of torch's CUDA op sequence. Built with --fmad=false; the one FMA torch's
// addcdiv kernel gets from nvcc's default contraction is written out.
#include <cuda_runtime.h>

#include "optim_kernels.h"

namespace lbcomm {
namespace cuda {
namespace {

__global__ void frozen_adamw_kernel(float* __restrict__ p, const float* __restrict__ m, const float* __restrict__ v,
                                    long long n, float inv_scale, float eps, float keep, float neg_step) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float d = __fadd_rn(__fmul_rn(__fsqrt_rn(v[i]), inv_scale), eps);
    const float w = __fmul_rn(p[i], keep);
    p[i] = __fmaf_rn(neg_step, __fdiv_rn(m[i], d), w);
  }
}

// torch.mul(m, neg_step).div_(d).clamp_(-bound, bound); p.mul_(keep).add_(q): tensor-tensor
// division is IEEE division, clamp keeps a NaN, add with alpha 1 is one rounding.
__global__ void frozen_adamw_bounded_kernel(float* __restrict__ p, const float* __restrict__ m,
                                            const float* __restrict__ v, long long n, float inv_scale, float eps,
                                            float keep, float neg_step, float bound) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float d = __fadd_rn(__fmul_rn(__fsqrt_rn(v[i]), inv_scale), eps);
    float q = __fdiv_rn(__fmul_rn(neg_step, m[i]), d);
    q = q > bound ? bound : (q < -bound ? -bound : q);
    p[i] = __fadd_rn(__fmul_rn(p[i], keep), q);
  }
}

}  // namespace

int frozen_adamw(float* p, const float* m, const float* v, long long n, float inv_scale, float eps, float keep,
                 float neg_step, int bounded, float bound, void* stream) {
  if (n == 0) return 0;
  const int threads = 256;
  const long long want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65535 ? want : 65535);
  if (bounded) {
    frozen_adamw_bounded_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(p, m, v, n, inv_scale, eps,
                                                                                           keep, neg_step, bound);
  } else {
    frozen_adamw_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(p, m, v, n, inv_scale, eps, keep,
                                                                                   neg_step);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace lbcomm
