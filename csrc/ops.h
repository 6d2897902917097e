// Shape/dtype validation and argument building shared by the CPU and CUDA op bodies.
// The op schemas live in ops.cpp (TORCH_LIBRARY(lbcomm, m)).
#pragma once
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

#include "kernels.h"

namespace lbcomm {

// The C++ signature of each op's kernels. At import the dispatcher refuses a kernel whose
// signature differs from another backend's for the same op, even by one const; registering
// through kernel<Fn> makes that a compile error instead (CI compiles the CUDA bindings).
using WorkerCompressFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, const at::Tensor& error,
                                                           std::optional<int64_t> block_size,
                                                           const std::optional<at::Tensor>& error_out,
                                                           const std::optional<at::Tensor>& weights,
                                                           const std::optional<at::Tensor>& cap,
                                                           const std::optional<at::Tensor>& cap_table,
                                                           const std::optional<at::Tensor>& cap_starts, int64_t cap_lo);
using ServerCompressFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& packed, const at::Tensor& scales,
                                                           const at::Tensor& error, std::optional<int64_t> block_size,
                                                           std::optional<int64_t> numel,
                                                           const std::optional<at::Tensor>& error_out,
                                                           const std::optional<at::Tensor>& cap,
                                                           const std::optional<at::Tensor>& cap_table,
                                                           const std::optional<at::Tensor>& cap_starts, int64_t cap_lo);
using UnpackFn = at::Tensor(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                            std::optional<int64_t> block_size);
using UnpackIntoFn = void(const at::Tensor& packed, const at::Tensor& scales, std::optional<int64_t> block_size,
                          const at::Tensor& out, const std::optional<at::Tensor>& weights,
                          const std::optional<at::Tensor>& cap, const std::optional<at::Tensor>& cap_table,
                          const std::optional<at::Tensor>& cap_starts, int64_t cap_lo);
template <class Fn>
constexpr Fn* kernel(Fn* f) {
  return f;
}

// Everything a worker_compress launch needs; the tensors own the outputs and scratch.
struct WorkerLaunch {
  WorkerArgs args;
  at::Tensor packed, scales, partials;
  at::Tensor input;  // x made contiguous, kept alive for the launch
  at::Tensor weights;  // the weights made contiguous (or undefined), kept alive likewise
  at::Tensor cap;      // the caps made contiguous (or undefined), kept alive likewise
};
struct ServerLaunch {
  ServerArgs args;
  at::Tensor packed, scales, partials, cap;
};
struct UnpackLaunch {
  UnpackArgs args;
  at::Tensor out, weights, cap;
};

// Validate inputs (TORCH_CHECK with the op name and what was received), allocate outputs on
// the inputs' device and fill the raw-pointer arguments. error_out == nullopt means in place.
// weights (optional): float32 per-coordinate weights of x's numel (worker: x / w is
// compressed) or out's numel (unpack_into: the decoded value times w is written).
// cap (optional): float32 per-coordinate caps of the capped decode (kernels.h), numel
// elements (the server's: of the chunk's real prefix); needs a block size and no weights.
// CapsFrom (CPU only): when it holds a table and starts, `cap` is the variance the caps are
// computed from (kernels.h, CapTable), the call's element i at flat index lo + i.
struct CapsFrom {
  std::optional<at::Tensor> table, starts;
  int64_t lo = 0;
};
WorkerLaunch prepare_worker(const at::Tensor& x, const at::Tensor& error, std::optional<int64_t> block_size,
                            const std::optional<at::Tensor>& error_out,
                            const std::optional<at::Tensor>& weights = std::nullopt,
                            const std::optional<at::Tensor>& cap = std::nullopt, const CapsFrom& caps = {});
ServerLaunch prepare_server(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& error,
                            std::optional<int64_t> block_size, std::optional<int64_t> numel,
                            const std::optional<at::Tensor>& error_out,
                            const std::optional<at::Tensor>& cap = std::nullopt, const CapsFrom& caps = {});
UnpackLaunch prepare_unpack(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                            std::optional<int64_t> block_size);
// The same into a caller's contiguous float32 tensor of numel elements (no allocation).
UnpackLaunch prepare_unpack_into(const at::Tensor& packed, const at::Tensor& scales,
                                 std::optional<int64_t> block_size, const at::Tensor& out,
                                 const std::optional<at::Tensor>& weights = std::nullopt,
                                 const std::optional<at::Tensor>& cap = std::nullopt, const CapsFrom& caps = {});
// The CapTable of the caps of elements [lo, lo + n) from the variance v (Float, contiguous,
// CPU), starts (Long [P + 1], non-decreasing) and table (Float [P, 3]), checked.
CapTable check_cap_table(const at::Tensor& v, const at::Tensor& starts, const at::Tensor& table, int64_t lo,
                         int64_t n, const char* op);

}  // namespace lbcomm
