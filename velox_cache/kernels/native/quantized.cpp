// VeloxQuantizedMatmul: x @ dequantize(w).T over MLX's affine quantization (4 or
// 8 bits, groups of 32, 64 or 128) as one MLX primitive on the CPU, reading the
// packed weights in place: what mx.quantized_matmul(x, w, scales, biases,
// transpose=True) computes, with the loops of quantized_loops.cpp (one set per
// instruction set, picked at load time). The outputs are shared by the cores in
// ranges of output features, on the pool of threads kept for the process (pool.h;
// VELOX_QUANTIZED_THREADS=n asks for n, read once); each output is computed by
// one thread in one order, so the results are the same bits for any number of
// threads and for a row alone or in a batch.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "pool.h"
#include "quantized.h"

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace velox {
namespace {

constexpr int64_t MIN_PARALLEL_WEIGHTS = 1 << 19;  // out x in features (x rows) below which one thread is faster
constexpr int64_t FEATURES_PER_TASK = 16;           // output features a task takes at least

const QuantizedLoops& quantized_loops() {
  static const QuantizedLoops& chosen = best_quantized_loops();
  return chosen;
}

unsigned thread_limit() {
  static const unsigned limit = threads_wanted("VELOX_QUANTIZED_THREADS");  // read once
  return limit;
}

int scale_type_of(mx::Dtype dtype) {
  if (dtype == mx::float32) return SCALE_FLOAT32;
  if (dtype == mx::float16) return SCALE_FLOAT16;
  if (dtype == mx::bfloat16) return SCALE_BFLOAT16;
  throw std::invalid_argument("quantized_matmul: scales and biases must be float32, float16 or bfloat16");
}

// The data of a 2-D array, row-major (packed into `copy` when its strides are not).
template <typename T>
const T* row_major(const mx::array& a, std::vector<T>& copy) {
  const int64_t rows = a.shape(0), columns = a.shape(1);
  if (a.strides()[1] == 1 && (rows == 1 || a.strides()[0] == columns)) return a.data<T>();
  copy.resize(rows * columns);
  const T* source = a.data<T>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < columns; ++j) copy[i * columns + j] = source[i * a.strides()[0] + j * a.strides()[1]];
  return copy.data();
}

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

// The packed weights, scales and biases of a call (copies only where an input is not row-major).
struct Weights {
  std::vector<uint32_t> weights;
  std::vector<uint16_t> scales16, biases16;
  std::vector<float> scales32, biases32;
};

void set_weights(QuantizedProblem& p, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 int group_size, int bits, Weights& copies) {
  p.out_features = w.shape(0);
  p.in_features = w.shape(1) * 32 / bits;
  p.bits = bits;
  p.group_size = group_size;
  p.scale_type = scale_type_of(scales.dtype());
  p.weights = reinterpret_cast<const uint8_t*>(row_major<uint32_t>(w, copies.weights));
  if (p.scale_type == SCALE_FLOAT32) {
    p.scales = row_major<float>(scales, copies.scales32);
    p.biases = row_major<float>(biases, copies.biases32);
  } else {
    p.scales = row_major<uint16_t>(scales, copies.scales16);
    p.biases = row_major<uint16_t>(biases, copies.biases16);
  }
}

// body(first, last) over the output features [0, features) in tasks of whole FEATURES_PER_TASK, on the
// pool's threads when `work` (weights read, times rows / 4) is worth sharing.
void share(int64_t features, int64_t work, const std::function<void(int64_t, int64_t)>& body) {
  unsigned threads = work < MIN_PARALLEL_WEIGHTS ? 1 : thread_limit();
  const int64_t per_task = std::max<int64_t>(
      FEATURES_PER_TASK, (features / (4 * threads) + FEATURES_PER_TASK - 1) / FEATURES_PER_TASK * FEATURES_PER_TASK);
  const int64_t tasks = (features + per_task - 1) / per_task;
  if (tasks < 2) threads = 1;
  std::atomic<int64_t> next{0};
  const std::function<void()> work_through = [&] {
    for (int64_t task = next++; task < tasks; task = next++) {
      body(task * per_task, std::min(features, (task + 1) * per_task));
    }
  };
  if (threads == 1) {
    work_through();
  } else {
    run_shared(threads, work_through);
  }
}

void compute_matmul(int group_size, int bits, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3];
  const auto& loops = quantized_loops();
  QuantizedProblem p{};
  Weights copies;
  set_weights(p, w, scales, biases, group_size, bits, copies);
  p.rows = p.in_features > 0 ? x.size() / p.in_features : 0;
  p.output = out.data<float>();
  if (p.rows == 0 || p.out_features == 0) return;
  // x's rows, packed and reordered as the loops read them
  std::vector<float> rows(p.rows * p.in_features), strided;
  const int64_t step = x.strides().back();
  for (int64_t row = 0; row < p.rows; ++row) {
    const float* source = x.data<float>() + row_offset(x, row);
    if (step != 1) {
      strided.resize(p.in_features);
      for (int64_t k = 0; k < p.in_features; ++k) strided[k] = source[k * step];
      source = strided.data();
    }
    loops.prepare_row(source, rows.data() + row * p.in_features, p.in_features, bits);
  }
  p.x = rows.data();
  share(p.out_features, p.out_features * p.in_features * std::max<int64_t>(1, p.rows / 4),
        [&](int64_t first, int64_t last) { loops.run(p, first, last); });
}

void compute_dequantize(int group_size, int bits, const std::vector<mx::array>& in, mx::array& out) {
  const auto& loops = quantized_loops();
  QuantizedProblem p{};
  Weights copies;
  set_weights(p, in[0], in[1], in[2], group_size, bits, copies);
  float* to = out.data<float>();
  share(p.out_features, p.out_features * p.in_features,
        [&](int64_t first, int64_t last) { loops.dequantize(p, first, last, to); });
}

// VeloxQuantizedMatmul (inputs x, w, scales, biases: out [..., N]) or VeloxDequantize (w, scales, biases: [N, K]).
class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream s, int group_size, int bits, bool dequantize_only)
      : mx::Primitive(s), group_size_(group_size), bits_(bits), dequantize_only_(dequantize_only) {}

  const char* name() const override { return dequantize_only_ ? "VeloxDequantize" : "VeloxQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const QuantizedMatmul*>(&other);
    return o != nullptr && o->group_size_ == group_size_ && o->bits_ == bits_ &&
           o->dequantize_only_ == dequantize_only_;
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + ": Velox's native ops run on the CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (dequantize_only_) return {{inputs[0].shape(0), static_cast<int>(inputs[0].shape(1) * 32 / bits_)}};
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weak_inputs;
    for (const auto& input : inputs) {
      encoder.set_input_array(input);
      weak_inputs.push_back(mx::array::unsafe_weak_copy(input));
    }
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    encoder.dispatch([group_size = group_size_, bits = bits_, dequantize_only = dequantize_only_,
                      in = std::move(weak_inputs), out = mx::array::unsafe_weak_copy(out)]() mutable {
      if (dequantize_only) {
        compute_dequantize(group_size, bits, in, out);
      } else {
        compute_matmul(group_size, bits, in, out);
      }
    });
  }

 private:
  int group_size_, bits_;
  bool dequantize_only_;
};

// The checks both ops make of a quantized matrix; returns its in_features.
int check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matmul: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("quantized_matmul: group_size must be 32, 64 or 128");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("quantized_matmul: w must be 2-D uint32");
  const int out_features = w.shape(0), in_features = w.shape(1) * 32 / bits;
  const mx::Shape group_shape = {out_features, in_features / group_size};
  if (in_features % group_size || scales.shape() != group_shape || biases.shape() != group_shape ||
      scales.dtype() != biases.dtype()) {
    throw std::invalid_argument("quantized_matmul: scales and biases must be [out, in / group_size], of one dtype");
  }
  scale_type_of(scales.dtype());
  return in_features;
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  const auto s = mx::default_stream(mx::Device::cpu);
  const int in_features = check_weights(w, scales, biases, group_size, bits);
  if (x.ndim() < 1 || x.shape(-1) != in_features) {
    throw std::invalid_argument("quantized_matmul: x must be [..., " + std::to_string(in_features) + "]");
  }
  if (!mx::issubdtype(x.dtype(), mx::floating)) throw std::invalid_argument("quantized_matmul: x must be floating");
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  auto x32 = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto out = mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(s, group_size, bits, false),
                       {x32, w, scales, biases});
  return dtype == mx::float32 ? out : mx::astype(out, dtype, s);
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  const auto s = mx::default_stream(mx::Device::cpu);
  const int in_features = check_weights(w, scales, biases, group_size, bits);
  return mx::array({w.shape(0), in_features}, mx::float32,
                   std::make_shared<QuantizedMatmul>(s, group_size, bits, true), {w, scales, biases});
}

}  // namespace

void register_quantized(nb::module_& m) {
  m.def("quantized_instruction_set", [] { return std::string(quantized_loops().instruction_set); },
        "The instruction set of the quantized matmul loops this CPU runs.");
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::kw_only(), nb::arg("group_size"), nb::arg("bits"),
        "x [..., K] @ dequantize(w).T for MLX's affine quantization (w [N, K * bits / 32] uint32, scales and\n"
        "biases [N, K / group_size]); bits 4 or 8, group_size 32, 64 or 128. As mx.quantized_matmul(...,\n"
        "transpose=True); the result in the promoted dtype of x and scales.");
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::kw_only(),
        nb::arg("group_size"), nb::arg("bits"),
        "The float32 weights [N, K] of an affine-quantized w: each q * scale + bias rounded once, as\n"
        "quantized_matmul uses them (mx.dequantize rounds to 16 bits where the scales are 16-bit).");
}

}  // namespace velox
