// Op schemas of the lbcomm namespace, argument validation shared by all devices, and the
// CPU implementations (threaded with at::parallel_for over cache-sized units).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"

// An empty module: importing lbcomm._C runs the static TORCH_LIBRARY registrations below.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace lbcomm {
namespace {

InType in_type(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kFloat: return InType::F32;
    case at::kHalf: return InType::F16;
    case at::kBFloat16: return InType::BF16;
    default: TORCH_CHECK_TYPE(false, op, ": expected x float32/float16/bfloat16, got ", x.scalar_type());
  }
}

int64_t check_block(std::optional<int64_t> block_size, const char* op) {
  if (!block_size.has_value()) return 0;
  const int64_t b = *block_size;
  TORCH_CHECK_VALUE(b > 0 && b % kAlign == 0, op, ": block_size must be None or a positive multiple of ", kAlign,
                    ", got ", b);
  return b;
}

void check_f32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": expected ", name, " float32, got ", t.scalar_type());
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", name, " is on ", b.device(), " but the other inputs are on ",
                    a.device());
}

// A [rows, cols] matrix whose rows may be strided but whose elements are contiguous.
void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": expected ", name, " of shape [",
                    rows, ", ", cols, "], got ", t.sizes());
  TORCH_CHECK_VALUE(cols <= 1 || t.stride(1) == 1, op, ": ", name, " rows must be contiguous, got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(rows <= 1 || t.stride(0) >= cols, op, ": ", name, " rows overlap, got strides ", t.strides());
}

// Error buffers must be contiguous float32; error_out, when given, has the same shape and
// either is error itself (in place) or does not overlap it.
float* check_error_out(const at::Tensor& error, const std::optional<at::Tensor>& error_out, const char* op) {
  if (!error_out.has_value()) return error.data_ptr<float>();
  const at::Tensor& o = *error_out;
  check_f32(o, op, "error_out");
  check_same_device(error, o, op, "error_out");
  TORCH_CHECK_VALUE(o.sizes() == error.sizes() && o.is_contiguous(), op,
                    ": error_out must be contiguous with the shape of error ", error.sizes(), ", got ", o.sizes());
  const auto* e0 = static_cast<const char*>(error.data_ptr());
  const auto* o0 = static_cast<const char*>(o.data_ptr());
  const int64_t bytes = error.numel() * 4;
  TORCH_CHECK_VALUE(o0 == e0 || o0 + bytes <= e0 || e0 + bytes <= o0, op,
                    ": error_out partially overlaps error; pass the same tensor or a separate buffer");
  return o.data_ptr<float>();
}

// Optional per-coordinate weights: float32 or bfloat16 (half the bytes to read; the
// weights are exact in either), numel elements, on the device of the data; returns them
// contiguous (kept alive by the launch) or an undefined tensor.
at::Tensor check_weights(const std::optional<at::Tensor>& weights, const at::Tensor& like, int64_t numel,
                         const char* op) {
  if (!weights.has_value()) return at::Tensor();
  const at::Tensor& w = *weights;
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, op,
                   ": expected weights float32 or bfloat16, got ", w.scalar_type());
  check_same_device(like, w, op, "weights");
  TORCH_CHECK_VALUE(w.numel() == numel, op, ": weights must have one element per coordinate (", numel,
                    "), got ", w.numel());
  return w.contiguous();
}

// Optional per-coordinate caps of the capped decode: float32, numel elements, on the
// device of the data, with a block size and without weights; returns them contiguous or
// an undefined tensor. With `from.table`, `cap` is the variance the caps are computed from
// (CPU only): `ctab` is filled and the variance returned (it is read, not copied).
at::Tensor check_cap(const std::optional<at::Tensor>& cap, const at::Tensor& like, int64_t numel, int64_t block,
                     bool weighted, const char* op, const CapsFrom& from, CapTable& ctab) {
  TORCH_CHECK_VALUE(from.table.has_value() == from.starts.has_value(), op,
                    ": cap_table and cap_starts go together (the caps computed from the variance in cap)");
  TORCH_CHECK_VALUE(cap.has_value() || !from.table.has_value(), op, ": cap_table needs the variance as cap");
  if (!cap.has_value()) return at::Tensor();
  const at::Tensor& c = *cap;
  TORCH_CHECK_TYPE(c.scalar_type() == at::kFloat, op, ": expected cap float32, got ", c.scalar_type());
  check_same_device(like, c, op, "cap");
  TORCH_CHECK_VALUE(block > 0, op, ": the capped decode needs a block size (block_size=None gives one scale)");
  TORCH_CHECK_VALUE(!weighted, op, ": cap and weights cannot be combined");
  if (from.table.has_value()) {
    TORCH_CHECK_VALUE(c.device().is_cpu(), op, ": caps computed from the variance (cap_table) run on the CPU only; "
                      "pass the caps themselves as cap on ", c.device());
    ctab = check_cap_table(c, *from.starts, *from.table, from.lo, numel, op);
    return c;
  }
  TORCH_CHECK_VALUE(c.numel() == numel, op, ": cap must have one element per coordinate (", numel, "), got ",
                    c.numel());
  return c.contiguous();
}

// The caps' pointer, or nullptr when there are none or they are computed (ctab).
const float* cap_ptr(const at::Tensor& c, const CapTable& ctab) {
  return c.defined() && ctab.v == nullptr ? c.data_ptr<float>() : nullptr;
}

InType weights_type(const at::Tensor& w) {
  return w.defined() && w.scalar_type() == at::kBFloat16 ? InType::BF16 : InType::F32;
}

}  // namespace

WorkerLaunch prepare_worker(const at::Tensor& x, const at::Tensor& error, std::optional<int64_t> block_size,
                            const std::optional<at::Tensor>& error_out, const std::optional<at::Tensor>& weights,
                            const std::optional<at::Tensor>& cap, const CapsFrom& caps) {
  constexpr const char* op = "lbcomm::worker_compress";
  WorkerLaunch L;
  const InType t = in_type(x, op);
  check_f32(error, op, "error");
  check_same_device(x, error, op, "error");
  TORCH_CHECK_VALUE(error.is_contiguous() && (error.dim() == 1 || error.dim() == 2), op,
                    ": error must be a contiguous [p, m] or [m] tensor, got shape ", error.sizes());
  const int64_t block = check_block(block_size, op);
  const int64_t p = error.dim() == 2 ? error.size(0) : 1;
  const int64_t m = error.dim() == 2 ? error.size(1) : error.size(0);
  TORCH_CHECK_VALUE(m % kAlign == 0, op, ": the chunk size (error.size(-1)) must be a multiple of ", kAlign,
                    ", got ", m);
  TORCH_CHECK_VALUE(x.numel() <= p * m, op, ": x has ", x.numel(), " elements but error holds only ", p * m,
                    " (", p, " chunks of ", m, ")");
  L.input = x.contiguous();
  L.weights = check_weights(weights, error, x.numel(), op);
  CapTable ctab;
  L.cap = check_cap(cap, error, x.numel(), block, L.weights.defined(), op, caps, ctab);
  const auto u8 = error.options().dtype(at::kByte);
  const int64_t nb = num_blocks(m, block);
  L.packed = error.dim() == 2 ? at::empty({p, m / 8}, u8) : at::empty({m / 8}, u8);
  L.scales = error.dim() == 2 ? at::empty({p, nb}, error.options()) : at::empty({nb}, error.options());
  if (block == 0) L.partials = at::empty({ceil_div(p * m, kPartialBlock)}, error.options().dtype(at::kDouble));
  L.args = WorkerArgs{L.input.data_ptr(),
                      t,
                      x.numel(),
                      error.data_ptr<float>(),
                      check_error_out(error, error_out, op),
                      p,
                      m,
                      block,
                      L.packed.data_ptr<uint8_t>(),
                      L.scales.data_ptr<float>(),
                      block == 0 ? L.partials.data_ptr<double>() : nullptr,
                      L.weights.defined() ? L.weights.data_ptr() : nullptr,
                      weights_type(L.weights),
                      cap_ptr(L.cap, ctab),
                      ctab};
  return L;
}

ServerLaunch prepare_server(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& error,
                            std::optional<int64_t> block_size, std::optional<int64_t> numel,
                            const std::optional<at::Tensor>& error_out, const std::optional<at::Tensor>& cap,
                            const CapsFrom& caps) {
  constexpr const char* op = "lbcomm::server_compress";
  ServerLaunch L;
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, op, ": expected packed uint8, got ", packed.scalar_type());
  check_f32(scales, op, "scales");
  check_f32(error, op, "error");
  check_same_device(error, packed, op, "packed");
  check_same_device(error, scales, op, "scales");
  TORCH_CHECK_VALUE(error.dim() == 1 && error.is_contiguous(), op,
                    ": error must be a contiguous 1-D [m] tensor, got shape ", error.sizes());
  const int64_t block = check_block(block_size, op);
  const int64_t m = error.size(0);
  TORCH_CHECK_VALUE(m % kAlign == 0, op, ": the chunk size must be a multiple of ", kAlign, ", got ", m);
  TORCH_CHECK_VALUE(packed.dim() == 2, op, ": expected packed of shape [p, m/8], got ", packed.sizes());
  const int64_t p = packed.size(0), nb = num_blocks(m, block);
  TORCH_CHECK_VALUE(p >= 1, op, ": packed must hold at least one rank's chunk");
  check_rows(packed, p, m / 8, op, "packed");
  check_rows(scales, p, nb, op, "scales");
  const int64_t real = numel.value_or(m);
  TORCH_CHECK_VALUE(real >= 0 && real <= m, op, ": numel must be in [0, ", m, "], got ", real);
  CapTable ctab;
  L.cap = check_cap(cap, error, real, block, false, op, caps, ctab);
  const auto u8 = error.options().dtype(at::kByte);
  L.packed = at::empty({m / 8}, u8);
  L.scales = at::empty({nb}, error.options());
  if (block == 0) L.partials = at::empty({ceil_div(m, kPartialBlock)}, error.options().dtype(at::kDouble));
  L.args = ServerArgs{packed.data_ptr<uint8_t>(),
                      p > 1 ? packed.stride(0) : m / 8,
                      scales.data_ptr<float>(),
                      p > 1 ? scales.stride(0) : nb,
                      p,
                      m,
                      block,
                      real,
                      error.data_ptr<float>(),
                      check_error_out(error, error_out, op),
                      L.packed.data_ptr<uint8_t>(),
                      L.scales.data_ptr<float>(),
                      block == 0 ? L.partials.data_ptr<double>() : nullptr,
                      cap_ptr(L.cap, ctab),
                      ctab};
  return L;
}

namespace {
UnpackLaunch prepare_unpack_impl(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                                 std::optional<int64_t> block_size, const at::Tensor* out, const char* op,
                                 const std::optional<at::Tensor>& weights = std::nullopt,
                                 const std::optional<at::Tensor>& cap = std::nullopt, const CapsFrom& caps = {}) {
  UnpackLaunch L;
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, op, ": expected packed uint8, got ", packed.scalar_type());
  check_f32(scales, op, "scales");
  check_same_device(packed, scales, op, "scales");
  TORCH_CHECK_VALUE(packed.dim() == 1 || packed.dim() == 2, op, ": expected packed [p, m/8] or [m/8], got ",
                    packed.sizes());
  const int64_t block = check_block(block_size, op);
  const at::Tensor P = packed.dim() == 1 ? packed.reshape({1, -1}) : packed;
  const at::Tensor S = scales.dim() == 1 ? scales.reshape({1, -1}) : scales;
  const int64_t p = P.size(0), m = P.size(1) * 8;
  TORCH_CHECK_VALUE(m % kAlign == 0, op, ": the chunk size (8 * packed.size(-1)) must be a multiple of ", kAlign,
                    ", got ", m);
  check_rows(P, p, m / 8, op, "packed");
  check_rows(S, p, num_blocks(m, block), op, "scales");
  TORCH_CHECK_VALUE(numel >= 0 && numel <= p * m, op, ": numel must be in [0, ", p * m, "], got ", numel);
  if (out) {
    check_f32(*out, op, "out");
    check_same_device(packed, *out, op, "out");
    TORCH_CHECK_VALUE(out->is_contiguous(), op, ": out must be contiguous");
    L.out = *out;
  } else {
    L.out = at::empty({numel}, scales.options());
  }
  L.weights = check_weights(weights, packed, numel, op);
  CapTable ctab;
  L.cap = check_cap(cap, packed, numel, block, L.weights.defined(), op, caps, ctab);
  L.args = UnpackArgs{P.data_ptr<uint8_t>(),
                      p > 1 ? P.stride(0) : m / 8,
                      S.data_ptr<float>(),
                      p > 1 ? S.stride(0) : S.size(1),
                      p,
                      m,
                      block,
                      numel,
                      L.out.data_ptr<float>(),
                      L.weights.defined() ? L.weights.data_ptr() : nullptr,
                      weights_type(L.weights),
                      cap_ptr(L.cap, ctab),
                      ctab};
  return L;
}
}  // namespace

UnpackLaunch prepare_unpack(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                            std::optional<int64_t> block_size) {
  return prepare_unpack_impl(packed, scales, numel, block_size, nullptr, "lbcomm::unpack");
}

UnpackLaunch prepare_unpack_into(const at::Tensor& packed, const at::Tensor& scales,
                                 std::optional<int64_t> block_size, const at::Tensor& out,
                                 const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& cap,
                                 const CapsFrom& caps) {
  return prepare_unpack_impl(packed, scales, out.numel(), block_size, &out, "lbcomm::unpack_into", weights, cap,
                             caps);
}

namespace {

// Units are cache-sized; give each task at least ~64K elements so small calls stay serial.
template <typename F>
void parallel_units(int64_t units, int64_t unit_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, unit_elems));
  at::parallel_for(0, units, grain, f);
}

std::tuple<at::Tensor, at::Tensor> worker_compress_cpu(const at::Tensor& x, const at::Tensor& error,
                                                       std::optional<int64_t> block_size,
                                                       const std::optional<at::Tensor>& error_out,
                                                       const std::optional<at::Tensor>& weights,
                                                       const std::optional<at::Tensor>& cap,
                                                       const std::optional<at::Tensor>& cap_table,
                                                       const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  WorkerLaunch L = prepare_worker(x, error, block_size, error_out, weights, cap, {cap_table, cap_starts, cap_lo});
  const WorkerArgs& a = L.args;
  const int64_t units = cpu::worker_units(a), unit = a.block > 0 ? a.block : kPartialBlock;
  for (int pass = 0; pass < cpu::worker_num_passes(a); ++pass) {
    parallel_units(units, unit, [&](int64_t b, int64_t e) { cpu::worker_pass(a, pass, b, e); });
    if (pass == 0 && a.block == 0) cpu::finish_single_scale(a.partials, units, a.numel, a.scales, a.p);
  }
  return {L.packed, L.scales};
}

std::tuple<at::Tensor, at::Tensor> server_compress_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                                       const at::Tensor& error, std::optional<int64_t> block_size,
                                                       std::optional<int64_t> numel,
                                                       const std::optional<at::Tensor>& error_out,
                                                       const std::optional<at::Tensor>& cap,
                                                       const std::optional<at::Tensor>& cap_table,
                                                       const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  ServerLaunch L = prepare_server(packed, scales, error, block_size, numel, error_out, cap,
                                  {cap_table, cap_starts, cap_lo});
  const ServerArgs& a = L.args;
  const int64_t units = cpu::server_units(a), unit = a.block > 0 ? a.block : kPartialBlock;
  for (int pass = 0; pass < cpu::server_num_passes(a); ++pass) {
    parallel_units(units, unit * a.p, [&](int64_t b, int64_t e) { cpu::server_pass(a, pass, b, e); });
    if (pass == 0 && a.block == 0) cpu::finish_single_scale(a.partials, units, a.numel, a.scales_out, 1);
  }
  return {L.packed, L.scales};
}

void run_unpack_cpu(const UnpackLaunch& L) {
  parallel_units(cpu::unpack_units(L.args), kPartialBlock,
                 [&](int64_t b, int64_t e) { cpu::unpack_range(L.args, b, e); });
}

at::Tensor unpack_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                      std::optional<int64_t> block_size) {
  UnpackLaunch L = prepare_unpack(packed, scales, numel, block_size);
  run_unpack_cpu(L);
  return L.out;
}

void unpack_into_cpu(const at::Tensor& packed, const at::Tensor& scales, std::optional<int64_t> block_size,
                     const at::Tensor& out, const std::optional<at::Tensor>& weights,
                     const std::optional<at::Tensor>& cap, const std::optional<at::Tensor>& cap_table,
                     const std::optional<at::Tensor>& cap_starts, int64_t cap_lo) {
  run_unpack_cpu(prepare_unpack_into(packed, scales, block_size, out, weights, cap, {cap_table, cap_starts, cap_lo}));
}

bool has_avx2_op() { return cpu::has_avx2(); }
// Bumped whenever an op's schema or semantics change, so Python can detect a stale build.
int64_t abi_version_op() { return 9; }
bool built_with_cuda_op() {
#ifdef LBCOMM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(lbcomm, m) {
  m.def(
      "worker_compress(Tensor x, Tensor(a!) error, int? block_size, Tensor(b!)? error_out=None, "
      "Tensor? weights=None, Tensor? cap=None, Tensor? cap_table=None, Tensor? cap_starts=None, int cap_lo=0) "
      "-> (Tensor, Tensor)");
  m.def(
      "server_compress(Tensor packed, Tensor scales, Tensor(a!) error, int? block_size, int? numel=None, "
      "Tensor(b!)? error_out=None, Tensor? cap=None, Tensor? cap_table=None, Tensor? cap_starts=None, "
      "int cap_lo=0) -> (Tensor, Tensor)");
  m.def("unpack(Tensor packed, Tensor scales, int numel, int? block_size) -> Tensor");
  m.def("unpack_into(Tensor packed, Tensor scales, int? block_size, Tensor(a!) out, Tensor? weights=None, "
        "Tensor? cap=None, Tensor? cap_table=None, Tensor? cap_starts=None, int cap_lo=0) -> ()");
  m.def("cpu_has_avx2() -> bool", &has_avx2_op);
  m.def("abi_version() -> int", &abi_version_op);
  m.def("built_with_cuda() -> bool", &built_with_cuda_op);
}

TORCH_LIBRARY_IMPL(lbcomm, CPU, m) {
  m.impl("worker_compress", kernel<WorkerCompressFn>(&worker_compress_cpu));
  m.impl("server_compress", kernel<ServerCompressFn>(&server_compress_cpu));
  m.impl("unpack", kernel<UnpackFn>(&unpack_cpu));
  m.impl("unpack_into", kernel<UnpackIntoFn>(&unpack_into_cpu));
}

}  // namespace lbcomm
