// VeloxGreedy: the greedy choice of each row of logits [..., V] as one MLX primitive on the CPU, the token
// (uint32) and its log-probability (float32): what mx.argmax(log_softmax(x)) and the log-softmax at that
// index give, with the same bits on x86 (sampling_loops.cpp), in one pass over the vocabulary per step
// instead of MLX's scalar exp and four ops. VeloxGreedy with targets (forced_choice) also gives each row's
// log-probability of a given token, for teacher forcing.

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "sampling.h"

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace velox {
namespace {

const SamplingLoops& sampling_loops() {
  static const SamplingLoops& chosen = best_sampling_loops();
  return chosen;
}

// Inputs: logits [..., V] (row-contiguous float32), and for a forced choice each row's target [...] (int32).
// Outputs: each row's token and log-probability, and with targets the target's log-probability.
class Greedy : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  const char* name() const override { return "VeloxGreedy"; }
  bool is_equivalent(const mx::Primitive& other) const override { return dynamic_cast<const Greedy*>(&other); }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return std::vector<mx::Shape>(inputs.size() + 1, shape);
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("VeloxGreedy: Velox's native ops run on the CPU only");
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
    }
    const bool forced = inputs.size() == 2;
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), tokens = mx::array::unsafe_weak_copy(outputs[0]),
                      logprobs = mx::array::unsafe_weak_copy(outputs[1]),
                      targets = mx::array::unsafe_weak_copy(forced ? inputs[1] : inputs[0]),
                      target_logprobs = mx::array::unsafe_weak_copy(forced ? outputs[2] : outputs[1]),
                      forced]() mutable {
      const int64_t n = x.shape(-1), rows = x.size() / n;
      std::vector<float> scratch(n);
      const auto loop = sampling_loops().greedy;
      for (int64_t row = 0; row < rows; ++row) {  // x and targets are row-contiguous (the callers made them so)
        loop(x.data<float>() + row * n, n, scratch.data(), tokens.data<uint32_t>() + row,
             logprobs.data<float>() + row, forced ? targets.data<int32_t>()[row] : -1,
             forced ? target_logprobs.data<float>() + row : nullptr);
      }
    });
  }
};

mx::array row_contiguous_float32(const mx::array& logits, const char* caller, mx::Stream s) {
  if (logits.ndim() < 1 || logits.shape(-1) < 1) {
    throw std::invalid_argument(std::string(caller) + ": logits must be [..., V] with V >= 1");
  }
  return mx::contiguous(mx::astype(logits, mx::float32, s), false, s);
}

std::tuple<mx::array, mx::array> greedy_choice(const mx::array& logits) {
  const auto s = mx::default_stream(mx::Device::cpu);
  auto x = row_contiguous_float32(logits, "greedy_choice", s);
  auto shape = x.shape();
  shape.pop_back();
  auto outputs = mx::array::make_arrays({shape, shape}, {mx::uint32, mx::float32}, std::make_shared<Greedy>(s), {x});
  return {outputs[0], outputs[1]};
}

std::tuple<mx::array, mx::array, mx::array> forced_choice(const mx::array& logits, const mx::array& targets) {
  const auto s = mx::default_stream(mx::Device::cpu);
  auto x = row_contiguous_float32(logits, "forced_choice", s);
  auto shape = x.shape();
  shape.pop_back();
  if (targets.shape() != shape) {
    throw std::invalid_argument("forced_choice: targets must have the logits' shape without their last axis");
  }
  auto t = mx::contiguous(mx::astype(targets, mx::int32, s), false, s);
  auto outputs = mx::array::make_arrays({shape, shape, shape}, {mx::uint32, mx::float32, mx::float32},
                                        std::make_shared<Greedy>(s), {x, t});
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

void register_sampling(nb::module_& m) {
  m.def("sampling_instruction_set", [] { return std::string(sampling_loops().instruction_set); },
        "The instruction set of the greedy choice's loops this CPU runs.");
  m.def("greedy_choice", &greedy_choice, nb::arg("logits"),
        "(tokens, logprobs) of logits [..., V]: the argmax of each row's log-softmax (uint32, the first\n"
        "index of the largest) and its log-probability (float32), as MLX's logsumexp, subtract and argmax\n"
        "compute them on x86 (the same bits).");
  m.def("forced_choice", &forced_choice, nb::arg("logits"), nb::arg("targets"),
        "(tokens, logprobs, target_logprobs): greedy_choice's two, and each row's log-probability of its\n"
        "target token (targets: the logits' shape without V; NaN outside [0, V)), as MLX's log-softmax and\n"
        "take_along_axis give it (the same bits on x86).");
}

}  // namespace velox
