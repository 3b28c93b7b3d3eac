// Velox's native CPU ops: MLX primitives for the elementwise work that MLX's
// CPU backend runs as scalar code on x86 (one out-of-line call per `fma` of
// its `exp`). Each op is a lazy MLX array like any other: it joins the graph,
// runs on the stream it was built on, and its loops are compiled once per
// instruction set (AVX-512, AVX2, baseline) and picked at load time.
//
// - `row_max(x)`: maximum over the last axis, keepdims (NaN if a row has one).
// - `shifted_exp(x, m)`: the kernel's `exp((x - m) * 2**5)` with exactly the
//   arithmetic of `velox_cache.kernels.kernel._exp_of_shifted` (multiply and add, no
//   contraction into FMA), so both paths give the same bits.
// - `swiglu(gate, x)`: `silu(gate) * x` with a vectorisable float32 `exp`
//   (Cephes' range reduction and polynomial, ~1 ulp).
// - `rope(x, cos, sin, dims, traditional)`: RoPE by a precomputed table, the
//   multiplies and adds of `mx.fast.rope`.
// - `rms_norm(x, weight, eps)`: `mx.fast.rms_norm` as one op with the bits of the
//   ops MLX's CPU backend composes it of (square, sum in order, mean, rsqrt, two multiplies).
//
// Inputs are read in place whatever their strides (slices, broadcasts,
// transposes); a strided last axis is packed first. Outputs are row-major.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "loops.h"

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// ---------------------------------------------------------------- loops

// The loops (loops.cpp), compiled once per instruction set; the best this CPU runs.
const velox::Loops& loops() {
  static const velox::Loops& chosen = velox::best_loops();
  return chosen;
}

// ---------------------------------------------------------------- layout

// Offset of row `row` (a flat index over all axes but the last) in `a`.
int64_t row_offset(const mx::array& a, int64_t row) {
  int64_t offset = 0;
  for (int axis = a.ndim() - 2; axis >= 0; --axis) {
    const int64_t extent = a.shape(axis);
    offset += (row % extent) * a.strides()[axis];
    row /= extent;
  }
  return offset;
}

mx::array float32_rows(const mx::array& a, const mx::Stream& s) {
  auto f = a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
  return f.ndim() == 0 ? mx::reshape(f, {1}, s) : f;
}

// The rows of a float32 input at run time: leading axes with any strides; a strided last
// axis (only known once the input is evaluated) is packed into a row-major copy first.
class RowReader {
 public:
  explicit RowReader(const mx::array& a) : a_(a), n_(a.ndim() > 0 ? a.shape(-1) : 1) {
    if (a.ndim() == 0 || n_ == 1 || a.strides().back() == 1) return;
    const int64_t rows = a.size() / n_, step = a.strides().back();
    packed_.resize(a.size());
    for (int64_t row = 0; row < rows; ++row) {
      const float* source = a.data<float>() + row_offset(a, row);
      for (int64_t i = 0; i < n_; ++i) packed_[row * n_ + i] = source[i * step];
    }
  }
  const float* operator()(int64_t row) const {
    return packed_.empty() ? a_.data<float>() + row_offset(a_, row) : packed_.data() + row * n_;
  }

 private:
  const mx::array& a_;
  int64_t n_;
  std::vector<float> packed_;
};

// ---------------------------------------------------------------- primitives

// The parts every Velox primitive shares: CPU only, one output, and `run`,
// which allocates the output and schedules `body(inputs, out)` on the stream.
class VeloxPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + ": Velox's native ops run on the CPU only");
  }
  bool is_equivalent(const mx::Primitive& other) const override { return std::strcmp(name(), other.name()) == 0; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  template <typename Body>
  void run(const std::vector<mx::array>& inputs, mx::array& out, Body body) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weak_inputs;
    for (const auto& input : inputs) {
      encoder.set_input_array(input);
      weak_inputs.push_back(mx::array::unsafe_weak_copy(input));
    }
    encoder.set_output_array(out);
    encoder.dispatch([inputs = std::move(weak_inputs), out = mx::array::unsafe_weak_copy(out), body]() mutable {
      body(inputs, out);
    });
  }
};

class RowMax : public VeloxPrimitive {
 public:
  using VeloxPrimitive::VeloxPrimitive;
  const char* name() const override { return "VeloxRowMax"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = 1;
    return {shape};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run(inputs, outputs[0], [](const std::vector<mx::array>& in, mx::array& out) {
      const RowReader x(in[0]);
      const int64_t n = in[0].shape(-1), rows = in[0].size() / n;
      const auto loop = loops().row_max;
      for (int64_t row = 0; row < rows; ++row) loop(x(row), out.data<float>() + row, n);
    });
  }
};

class ShiftedExp : public VeloxPrimitive {
 public:
  using VeloxPrimitive::VeloxPrimitive;
  const char* name() const override { return "VeloxShiftedExp"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run(inputs, outputs[0], [](const std::vector<mx::array>& in, mx::array& out) {
      const RowReader x(in[0]), shift(in[1]);  // shift: broadcast to x's shape with a last axis of 1
      const int64_t n = in[0].shape(-1), rows = in[0].size() / n;
      const auto loop = loops().shifted_exp;
      for (int64_t row = 0; row < rows; ++row) loop(x(row), *shift(row), out.data<float>() + row * n, n);
    });
  }
};

class Swiglu : public VeloxPrimitive {
 public:
  using VeloxPrimitive::VeloxPrimitive;
  const char* name() const override { return "VeloxSwiglu"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run(inputs, outputs[0], [](const std::vector<mx::array>& in, mx::array& out) {
      const RowReader gate(in[0]), x(in[1]);
      const int64_t n = in[0].shape(-1), rows = in[0].size() / n;
      const auto loop = loops().swiglu;
      for (int64_t row = 0; row < rows; ++row) loop(gate(row), x(row), out.data<float>() + row * n, n);
    });
  }
};

class Rope : public VeloxPrimitive {
 public:
  Rope(mx::Stream s, int dims, bool traditional) : VeloxPrimitive(s), dims_(dims), traditional_(traditional) {}
  const char* name() const override { return "VeloxRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* rope = dynamic_cast<const Rope*>(&other);
    return rope != nullptr && rope->dims_ == dims_ && rope->traditional_ == traditional_;
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t half = dims_ / 2;
    const bool traditional = traditional_;
    run(inputs, outputs[0], [half, traditional](const std::vector<mx::array>& in, mx::array& out) {
      const RowReader x(in[0]), cosines(in[1]), sines(in[2]);  // tables: [L, dims / 2]
      const int64_t n = in[0].shape(-1), length = in[0].shape(-2), rows = in[0].size() / n;
      const auto loop = loops().rope;
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t position = row % length;
        loop(x(row), cosines(position), sines(position), out.data<float>() + row * n, half, n, traditional);
      }
    });
  }

 private:
  int dims_;
  bool traditional_;
};

class RmsNorm : public VeloxPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : VeloxPrimitive(s), eps_(eps) {}
  const char* name() const override { return "VeloxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* norm = dynamic_cast<const RmsNorm*>(&other);
    return norm != nullptr && norm->eps_ == eps_;
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const float eps = eps_;
    run(inputs, outputs[0], [eps](const std::vector<mx::array>& in, mx::array& out) {
      const RowReader x(in[0]), weight(in[1]);  // weight: [n]
      const int64_t n = in[0].shape(-1), rows = in[0].size() / n;
      const float inverse_n = static_cast<float>(1.0 / static_cast<double>(n));  // mx.mean's normalizer
      const auto loop = loops().rms_norm;
      for (int64_t row = 0; row < rows; ++row) loop(x(row), weight(0), out.data<float>() + row * n, n, inverse_n, eps);
    });
  }

 private:
  float eps_;
};

// ---------------------------------------------------------------- ops

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);  // the stream `with mx.stream(...)` chose, if any
}

mx::array row_max(const mx::array& x) {
  const auto s = cpu_stream();
  auto rows = float32_rows(x, s);
  auto shape = rows.shape();
  shape.back() = 1;
  return mx::array(shape, mx::float32, std::make_shared<RowMax>(s), {rows});
}

mx::array shifted_exp(const mx::array& x, const mx::array& shift) {
  const auto s = cpu_stream();
  auto rows = float32_rows(x, s);
  auto shift_shape = rows.shape();
  shift_shape.back() = 1;
  auto shifts = mx::broadcast_to(float32_rows(shift, s), shift_shape, s);
  return mx::array(rows.shape(), mx::float32, std::make_shared<ShiftedExp>(s), {rows, shifts});
}

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  const auto s = cpu_stream();
  if (gate.shape() != x.shape()) throw std::invalid_argument("swiglu: gate and x must have the same shape");
  auto dtype = mx::promote_types(gate.dtype(), x.dtype());
  auto g = float32_rows(gate, s), v = float32_rows(x, s);
  auto out = mx::array(g.shape(), mx::float32, std::make_shared<Swiglu>(s), {g, v});
  out = gate.ndim() == 0 ? mx::reshape(out, {}, s) : out;
  return dtype == mx::float32 ? out : mx::astype(out, dtype, s);
}

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, int dims, bool traditional) {
  const auto s = cpu_stream();
  if (x.ndim() < 2 || dims % 2 || dims > x.shape(-1)) {
    throw std::invalid_argument("rope: x must be [..., L, D] with an even dims <= D");
  }
  const int length = x.shape(-2), half = dims / 2;
  if (cos.shape() != mx::Shape{length, half} || sin.shape() != mx::Shape{length, half}) {
    throw std::invalid_argument("rope: cos and sin must be [L, dims / 2]");
  }
  auto rows = float32_rows(x, s);
  auto table = [&](const mx::array& a) { return float32_rows(a, s); };
  auto out = mx::array(rows.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional),
                       {rows, table(cos), table(sin)});
  return x.dtype() == mx::float32 ? out : mx::astype(out, x.dtype(), s);
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  const auto s = cpu_stream();
  if (x.ndim() < 1 || x.dtype() != mx::float32 || weight.dtype() != mx::float32 ||
      weight.shape() != mx::Shape{x.shape(-1)}) {
    throw std::invalid_argument("rms_norm: x must be float32 [..., n] and weight float32 [n]");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), {x, weight});
}

}  // namespace

namespace velox {
void register_attention(nb::module_& m);  // attention.cpp: VeloxAttention
void register_quantized(nb::module_& m);  // quantized.cpp: VeloxQuantizedMatmul
void register_sampling(nb::module_& m);   // sampling.cpp: VeloxGreedy
void register_window_flush(nb::module_& m);  // window_flush.cpp: VeloxWindowFlush
}

NB_MODULE(_ops, m) {
  m.def("instruction_set", [] { return std::string(loops().instruction_set); },
        "The instruction set of the loops this CPU runs.");
  m.attr("mlx_version") = VELOX_MLX_VERSION;  // the mlx this module was built against
  m.doc() = "Velox's native CPU ops (see velox_cache.kernels.native).";
  m.def("row_max", &row_max, nb::arg("x"), "Maximum over the last axis, keepdims, float32.");
  m.def("shifted_exp", &shifted_exp, nb::arg("x"), nb::arg("shift"),
        "exp((x - shift) * 2**5) by the kernel's multiply/add polynomial; shift has a last axis of 1.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"), nb::arg("traditional"),
        "RoPE of x [..., L, D] by a table of cos and sin [L, dims / 2] (one row per position).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        "mx.fast.rms_norm(x, weight, eps) for float32, with the bits of MLX's CPU fallback (one op, not ~13).");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x with a vectorised float32 exp.");
  velox::register_attention(m);
  velox::register_quantized(m);
  velox::register_sampling(m);
  velox::register_window_flush(m);
}
