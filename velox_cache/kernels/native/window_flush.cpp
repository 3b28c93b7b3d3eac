// VeloxWindowFlush: a batch of evicting layers at kv_bits (velox_cache.generation.quantized_slots_batch)
// moves the first whole group of some rows' float windows into their quantized regions, as one MLX primitive
// on the CPU: what velox_cache.cache.quantized_holes (quantized_group, write_into_holes, forget_dead_groups)
// and the window's shift do in ~100 small MLX ops, with the same bits (keys per channel and values per token,
// affine, round half to even; each head's group into its first holes, in slot order, then after the row's
// used slots; the key scales of groups no live token uses dropped, the others renumbered in order).
//
// Inputs, in order (B rows, H heads, Q region slots, W window slots, G key-scale slots):
//   0 key_codes [B,H,Q,Dk] u8   1 key_groups [B,H,Q] i32   2 value_codes [B,H,Q,Dk] u8
//   3 value_scales [B,H,Q,NV] f32   4 value_zeros [B,H,Q,NV] f32   5 key_scales [B,H,G,D] f32   6 key_zeros
//   7 keys [B,H,W,D] f32   8 values [B,H,W,D] f32   9 scores [B,H,Q+W] f32   10 positions [B,H,Q+W] i32
//   11 live [B,H,Q+W] bool   12 quantized [B] i32   13 groups [B] i32   14 scale_room [B] i32   15 rows [k] i32
// Outputs: inputs 0-14 after the flush of rows `rows` (the other rows as they were).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace velox {
namespace {

constexpr int kParts = 15;
constexpr int kScaleStep = 16;  // GROUP_STEP: a row's key-scale buffer grows by whole steps

struct FlushShape {
  int64_t batch, heads, region, window, scale_slots, dim, code_bytes, value_scales;
};

// Codes of n floats at stride `stride` quantized together: the scale and the zero (the minimum) they share.
void quantize_run(const float* x, int64_t n, int64_t stride, int levels, uint8_t* codes, int64_t code_stride,
                  float* scale_out, float* zero_out) {
  float low = x[0], high = x[0];
  for (int64_t i = 1; i < n; ++i) {
    low = std::min(low, x[i * stride]);
    high = std::max(high, x[i * stride]);
  }
  const float scale = (high - low) / static_cast<float>(levels);
  const float safe = scale > 0.0f ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    float code = std::nearbyint((x[i * stride] - low) / safe);
    code = std::min(std::max(code, 0.0f), static_cast<float>(levels));
    codes[i * code_stride] = static_cast<uint8_t>(code);
  }
  *scale_out = scale;
  *zero_out = low;
}

void pack_codes(const uint8_t* one_per_byte, int64_t dim, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, one_per_byte, dim);
    return;
  }
  for (int64_t i = 0; i < dim / 2; ++i) out[i] = one_per_byte[2 * i] | static_cast<uint8_t>(one_per_byte[2 * i + 1] << 4);
}

// `x`'s elements in row-major order at `dst` (a plain copy where x is row-contiguous, else by its strides).
void copy_contiguous(const mx::array& x, uint8_t* dst) {
  const uint8_t* src = x.data<uint8_t>();
  if (x.flags().row_contiguous) {
    std::memcpy(dst, src, x.nbytes());
    return;
  }
  const int64_t item = x.itemsize(), ndim = x.ndim();
  std::vector<int64_t> index(ndim, 0);
  for (int64_t n = 0; n < static_cast<int64_t>(x.size()); ++n) {
    int64_t offset = 0;
    for (int64_t axis = 0; axis < ndim; ++axis) offset += index[axis] * x.strides()[axis];
    std::memcpy(dst + n * item, src + offset * item, item);
    for (int64_t axis = ndim - 1; axis >= 0; --axis) {
      if (++index[axis] < x.shape(axis)) break;
      index[axis] = 0;
    }
  }
}

class WindowFlush : public mx::Primitive {
 public:
  WindowFlush(mx::Stream stream, int group, int bits, int value_group)
      : mx::Primitive(stream), group_(group), bits_(bits), value_group_(value_group) {}
  const char* name() const override { return "VeloxWindowFlush"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const WindowFlush*>(&other);
    return o && o->group_ == group_ && o->bits_ == bits_ && o->value_group_ == value_group_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (int i = 0; i < kParts; ++i) shapes.push_back(inputs[i].shape());
    return shapes;
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("VeloxWindowFlush: Velox's native ops run on the CPU only");
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    std::vector<char> copied(kParts, 1);
    for (int i = 0; i < kParts; ++i) {  // donation first: a weak copy of an input shares (and counts) its data
      auto& o = outputs[i];
      if (inputs[i].is_donatable() && inputs[i].flags().row_contiguous) {  // no one else holds it: in place
        o.copy_shared_buffer(inputs[i]);
        copied[i] = 0;
      } else {
        o.set_data(mx::allocator::malloc(o.nbytes()));
      }
      encoder.set_output_array(o);
      out.push_back(mx::array::unsafe_weak_copy(o));
    }
    for (auto& x : inputs) {
      encoder.set_input_array(x);
      in.push_back(mx::array::unsafe_weak_copy(x));
    }
    encoder.dispatch([in = std::move(in), out = std::move(out), copied = std::move(copied), group = group_,
                      bits = bits_, value_group = value_group_]() mutable { run(in, out, copied, group, bits, value_group); });
  }

 private:
  int group_, bits_, value_group_;

  static void run(std::vector<mx::array>& in, std::vector<mx::array>& out, const std::vector<char>& copied, int g,
                  int bits, int value_group) {
    for (int i = 0; i < kParts; ++i)  // a buffer still shared with a checkpoint (or a caller) is copied first
      if (copied[i]) copy_contiguous(in[i], out[i].data<uint8_t>());
    const FlushShape s{in[0].shape(0), in[0].shape(1), in[0].shape(2), in[7].shape(2), in[5].shape(2),
                       in[7].shape(3), in[0].shape(3), in[3].shape(3)};
    const int levels = (1 << bits) - 1;
    const int32_t* rows = in[15].data<int32_t>();
    for (int64_t k = 0; k < in[15].size(); ++k)
      flush_row(in, out, s, rows[k * in[15].strides()[0]], g, bits, levels, value_group);
  }

  static void flush_row(std::vector<mx::array>& in, std::vector<mx::array>& out, const FlushShape& s, int64_t r,
                        int g, int bits, int levels, int value_group) {
    const int64_t H = s.heads, Q = s.region, W = s.window, D = s.dim, DK = s.code_bytes, NV = s.value_scales;
    const int64_t M = Q + W, G = s.scale_slots;
    uint8_t* key_codes = out[0].data<uint8_t>() + r * H * Q * DK;
    int32_t* key_groups = out[1].data<int32_t>() + r * H * Q;
    uint8_t* value_codes = out[2].data<uint8_t>() + r * H * Q * DK;
    float* value_scales = out[3].data<float>() + r * H * Q * NV;
    float* value_zeros = out[4].data<float>() + r * H * Q * NV;
    float* key_scales = out[5].data<float>() + r * H * G * D;
    float* key_zeros = out[6].data<float>() + r * H * G * D;
    float* keys = out[7].data<float>() + r * H * W * D;
    float* values = out[8].data<float>() + r * H * W * D;
    float* scores = out[9].data<float>() + r * H * M;
    int32_t* positions = out[10].data<int32_t>() + r * H * M;
    bool* live = out[11].data<bool>() + r * H * M;
    int32_t& quantized = out[12].data<int32_t>()[r];
    int32_t& groups = out[13].data<int32_t>()[r];
    int32_t& room = out[14].data<int32_t>()[r];
    const int32_t used = quantized, number = groups;
    if (number >= G) throw std::runtime_error("VeloxWindowFlush: no key-scale slot left for the new group");

    // Each head's holes among its used slots; the row grows by what the head with the fewest lacks.
    std::vector<std::vector<int64_t>> holes(H);
    int64_t fewest = Q;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t slot = 0; slot < used; ++slot)
        if (!live[h * M + slot]) holes[h].push_back(slot);
      fewest = std::min<int64_t>(fewest, holes[h].size());
    }
    const int64_t grown = used + std::max<int64_t>(0, g - fewest);
    if (grown > Q) throw std::runtime_error("VeloxWindowFlush: the region has no room for the group");

    std::vector<uint8_t> codes(g * D);
    std::vector<float> group_scales(D), group_zeros(D);
    for (int64_t h = 0; h < H; ++h) {
      const float* window_keys = keys + h * W * D;
      const float* window_values = values + h * W * D;
      for (int64_t d = 0; d < D; ++d)  // keys: each channel over the group's tokens
        quantize_run(window_keys + d, g, D, levels, codes.data() + d, D, &group_scales[d], &group_zeros[d]);
      std::memcpy(key_scales + (h * G + number) * D, group_scales.data(), D * sizeof(float));
      std::memcpy(key_zeros + (h * G + number) * D, group_zeros.data(), D * sizeof(float));
      std::vector<uint8_t> value_one(D);
      const int64_t n_holes = holes[h].size();
      for (int64_t j = 0; j < g; ++j) {
        const int64_t target = j < n_holes ? holes[h][j] : used + j - n_holes;
        pack_codes(codes.data() + j * D, D, bits, key_codes + (h * Q + target) * DK);
        key_groups[h * Q + target] = number;
        for (int64_t v = 0; v < NV; ++v)  // values: each token over runs of value_group features
          quantize_run(window_values + j * D + v * value_group, value_group, 1, levels, value_one.data() + v * value_group,
                       1, value_scales + (h * Q + target) * NV + v, value_zeros + (h * Q + target) * NV + v);
        pack_codes(value_one.data(), D, bits, value_codes + (h * Q + target) * DK);
        scores[h * M + target] = scores[h * M + Q + j];
        positions[h * M + target] = positions[h * M + Q + j];
        live[h * M + target] = live[h * M + Q + j];
      }
    }
    quantized = static_cast<int32_t>(grown);
    const int32_t after = number + 1;
    const int32_t next_room = after > room ? after + ((kScaleStep - after % kScaleStep) % kScaleStep) : room;

    // Groups a live token uses; the others' scales go, the rest renumbered in order (scales compacted in place).
    std::vector<int32_t> renumber(G, 0);
    std::vector<char> in_use(G, 0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t slot = 0; slot < grown; ++slot)
        if (live[h * M + slot]) in_use[key_groups[h * Q + slot]] = 1;
    int32_t kept = 0;
    for (int64_t n = 0; n < G; ++n) {
      if (n >= after) in_use[n] = 0;
      kept += in_use[n];
      renumber[n] = std::max(kept - 1, 0);
    }
    std::vector<int64_t> order;
    for (int64_t n = 0; n < G; ++n)
      if (in_use[n]) order.push_back(n);
    for (int64_t n = 0; n < G; ++n)
      if (!in_use[n]) order.push_back(n);
    std::vector<float> moved(G * D);
    for (float* scales : {key_scales, key_zeros}) {
      for (int64_t h = 0; h < H; ++h) {
        float* head = scales + h * G * D;
        for (int64_t n = 0; n < G; ++n) std::memcpy(moved.data() + n * D, head + order[n] * D, D * sizeof(float));
        std::memcpy(head, moved.data(), G * D * sizeof(float));
      }
    }
    for (int64_t i = 0; i < H * Q; ++i) key_groups[i] = renumber[key_groups[i]];
    groups = kept;
    room = kept < after ? kept : next_room;

    // The window's group leaves it: the rest moves to its front, the freed slots zero (dead).
    for (int64_t h = 0; h < H; ++h) {
      for (float* window : {keys + h * W * D, values + h * W * D}) {
        std::memmove(window, window + g * D, (W - g) * D * sizeof(float));
        std::memset(window + (W - g) * D, 0, g * D * sizeof(float));
      }
      std::memmove(scores + h * M + Q, scores + h * M + Q + g, (W - g) * sizeof(float));
      std::memset(scores + h * M + Q + W - g, 0, g * sizeof(float));
      std::memmove(positions + h * M + Q, positions + h * M + Q + g, (W - g) * sizeof(int32_t));
      std::memset(positions + h * M + Q + W - g, 0, g * sizeof(int32_t));
      std::memmove(live + h * M + Q, live + h * M + Q + g, (W - g) * sizeof(bool));
      std::memset(live + h * M + Q + W - g, 0, g * sizeof(bool));
    }
  }
};

std::vector<mx::array> window_flush(const std::vector<mx::array>& parts, const mx::array& rows, int group, int bits,
                                    int value_group) {
  const auto s = mx::default_stream(mx::Device::cpu);
  if (parts.size() != kParts) throw std::invalid_argument("window_flush: 15 arrays, as the batch holds them");
  const mx::Dtype dtypes[kParts] = {mx::uint8,   mx::int32,   mx::uint8,   mx::float32, mx::float32,
                                    mx::float32, mx::float32, mx::float32, mx::float32, mx::float32,
                                    mx::int32,   mx::bool_,   mx::int32,   mx::int32,   mx::int32};
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> types;
  for (int i = 0; i < kParts; ++i) {
    if (parts[i].dtype() != dtypes[i]) throw std::invalid_argument("window_flush: array " + std::to_string(i) + " has another dtype");
    inputs.push_back(parts[i]);  // as they are: a buffer no one else holds is updated in place
    shapes.push_back(parts[i].shape());
    types.push_back(dtypes[i]);
  }
  if (group < 1 || group > parts[7].shape(2) || (bits != 8 && bits != 4) || value_group < 1 ||
      parts[7].shape(3) % value_group) {
    throw std::invalid_argument("window_flush: group, bits or value_group out of range");
  }
  inputs.push_back(mx::astype(rows, mx::int32, s));
  return mx::array::make_arrays(shapes, types, std::make_shared<WindowFlush>(s, group, bits, value_group), inputs);
}

}  // namespace

void register_window_flush(nb::module_& m) {
  m.def("window_flush", &window_flush, nb::arg("parts"), nb::arg("rows"), nb::arg("group"), nb::arg("bits"),
        nb::arg("value_group"),
        "The 15 arrays of a QuantizedSlotsBatch after rows `rows` moved their window's first `group` tokens into\n"
        "their quantized regions (velox_cache.cache.quantized_holes, the same bits).");
}

}  // namespace velox
