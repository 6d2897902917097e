// Raw-pointer launcher of the CUDA body of lbcomm::frozen_adamw_ (no torch headers, so
// that nvcc stays quick; csrc/optim.cpp has the op and its CPU body).
#pragma once

namespace lbcomm {
namespace cuda {
// p = fma(neg_step, m / d, p * keep) with d = sqrt(v) * inv_scale + eps (the IEEE root, as
// the CPU body's): torch's CUDA ops (a scalar divisor becomes a multiply by its reciprocal; addcdiv is
// a + alpha * (b / c), contracted to an FMA). With bounded != 0 the torch sequence of the
// clamped step instead: q = (neg_step * m) / d; q = clamp(q, -bound, bound); p = p * keep + q.
// Returns a cudaError_t.
int frozen_adamw(float* p, const float* m, const float* v, long long n, float inv_scale, float eps, float keep,
                 float neg_step, int bounded, float bound, void* stream);
}  // namespace cuda
}  // namespace lbcomm
