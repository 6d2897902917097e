// CUDA bindings of the lbcomm ops (schemas in csrc/ops.cpp, kernels in kernels.cu).
// Validation and output allocation are shared with the CPU path (ops.h); the kernels run
// on the current stream of the inputs' device.
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels.h"
#include "ops.h"

namespace lbcomm {
namespace {

// Guards the device of t when it is a CUDA tensor; otherwise guards nothing and lets the
// prepare_* checks report the device mismatch with the op's name.
c10::cuda::OptionalCUDAGuard guard_for(const at::Tensor& t) {
  return c10::cuda::OptionalCUDAGuard(t.is_cuda() ? std::make_optional(t.device()) : std::nullopt);
}

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, "lbcomm::", op, ": CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor> worker_compress_cuda(const at::Tensor& x, const at::Tensor& error,
                                                        std::optional<int64_t> block_size,
                                                        const std::optional<at::Tensor>& error_out,
                                                        const std::optional<at::Tensor>& weights,
                                                        const std::optional<at::Tensor>& cap,
                                                        const std::optional<at::Tensor>& cap_table,
                                                        const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  const auto guard = guard_for(error);
  WorkerLaunch launch = prepare_worker(x, error, block_size, error_out, weights, cap, {cap_table, cap_starts, cap_lo});
  check_launch(cuda::worker_compress(launch.args, current_stream()), "worker_compress");
  return std::make_tuple(launch.packed, launch.scales);
}

std::tuple<at::Tensor, at::Tensor> server_compress_cuda(const at::Tensor& packed, const at::Tensor& scales,
                                                        const at::Tensor& error, std::optional<int64_t> block_size,
                                                        std::optional<int64_t> numel,
                                                        const std::optional<at::Tensor>& error_out,
                                                        const std::optional<at::Tensor>& cap,
                                                        const std::optional<at::Tensor>& cap_table,
                                                        const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  const auto guard = guard_for(error);
  ServerLaunch launch = prepare_server(packed, scales, error, block_size, numel, error_out, cap,
                                       {cap_table, cap_starts, cap_lo});
  check_launch(cuda::server_compress(launch.args, current_stream()), "server_compress");
  return std::make_tuple(launch.packed, launch.scales);
}

at::Tensor unpack_cuda(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                       std::optional<int64_t> block_size) {
  const auto guard = guard_for(packed);
  UnpackLaunch launch = prepare_unpack(packed, scales, numel, block_size);
  check_launch(cuda::unpack(launch.args, current_stream()), "unpack");
  return launch.out;
}

void unpack_into_cuda(const at::Tensor& packed, const at::Tensor& scales, std::optional<int64_t> block_size,
                      const at::Tensor& out, const std::optional<at::Tensor>& weights,
                      const std::optional<at::Tensor>& cap, const std::optional<at::Tensor>& cap_table,
                      const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  const auto guard = guard_for(packed);
  UnpackLaunch launch = prepare_unpack_into(packed, scales, block_size, out, weights, cap,
                                              {cap_table, cap_starts, cap_lo});
  check_launch(cuda::unpack(launch.args, current_stream()), "unpack_into");
}

}  // namespace

TORCH_LIBRARY_IMPL(lbcomm, CUDA, m) {
  m.impl("worker_compress", kernel<WorkerCompressFn>(&worker_compress_cuda));
  m.impl("server_compress", kernel<ServerCompressFn>(&server_compress_cuda));
  m.impl("unpack", kernel<UnpackFn>(&unpack_cuda));
  m.impl("unpack_into", kernel<UnpackIntoFn>(&unpack_into_cuda));
}

}  // namespace lbcomm
