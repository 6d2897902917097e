// CUDA body of lbcomm::frozen_adamw_ (see csrc/optim.cpp): one pass over p, m, sqrt(v) with the
// rounding of torch's CUDA op sequence. Built with --fmad=false; the one FMA torch's
// addcdiv kernel gets from nvcc's default contraction is written out.
#include <cuda_runtime.h>

#include "optim_kernels.h"

namespace lbcomm {
namespace cuda {
namespace {

__global__ void frozen_adamw_kernel(float* __restrict__ p, const float* __restrict__ m, const float* __restrict__ r,
                                    long long n, float inv_scale, float eps, float keep, float neg_step) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float d = __fadd_rn(__fmul_rn(r[i], inv_scale), eps);
    const float w = __fmul_rn(p[i], keep);
    p[i] = __fmaf_rn(neg_step, __fdiv_rn(m[i], d), w);
  }
}

}  // namespace

int frozen_adamw(float* p, const float* m, const float* r, long long n, float inv_scale, float eps, float keep,
                 float neg_step, void* stream) {
  if (n == 0) return 0;
  const int threads = 256;
  const long long want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65535 ? want : 65535);
  frozen_adamw_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(p, m, r, n, inv_scale, eps, keep,
                                                                                 neg_step);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace lbcomm
