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
// Outputs: inputs 0-14 after the flush of rows `rows` (the other rows as they were). Built as a small plan
// (FlushPlan: targets, the group's codes, renumbering) and one single-output op per big array (FlushApply), so
// that each array no one else holds is updated in place (a primitive with many outputs cannot donate its inputs:
// every output counts as one of their holders).

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

// A small input as a row-contiguous host copy (the plan's inputs and outputs are small).
template <typename T>
std::vector<T> host(const mx::array& x) {
  std::vector<T> out(x.nbytes() / sizeof(T));  // as T: a float array read as bytes is 4 of them an element
  copy_contiguous(x, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("VeloxWindowFlush: Velox's native ops run on the CPU only");
  }
};

// The plan of a flush, for rows `rows` (k of them): where each window slot goes, the group's codes and scales,
// the dead groups' renumbering and the scales' new order, and every row's counts after it. Small outputs only,
// so that the big arrays are each rewritten by one single-output op (FlushApply) that can update it in place.
//   inputs: 0 live [B,H,Q+W] bool, 1 key_groups [B,H,Q] i32, 2 keys [B,H,W,D] f32, 3 values, 4 quantized [B] i32,
//           5 groups [B] i32, 6 scale_room [B] i32, 7 rows [k] i32
//   outputs: 0 target [k,H,g] i32, 1 key_codes [k,H,g,DK] u8, 2 value_codes [k,H,g,DK] u8,
//            3 value_scales [k,H,g,NV] f32, 4 value_zeros, 5 group_scales [k,H,D] f32, 6 group_zeros,
//            7 renumber [k,G] i32, 8 order [k,G] i32, 9 quantized [B] i32, 10 groups [B] i32, 11 scale_room [B] i32
class FlushPlan : public CpuPrimitive {
 public:
  FlushPlan(mx::Stream stream, int group, int bits, int value_group, int scale_slots)
      : CpuPrimitive(stream), g_(group), bits_(bits), value_group_(value_group), scale_slots_(scale_slots) {}
  const char* name() const override { return "VeloxFlushPlan"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const FlushPlan*>(&other);
    return o && o->g_ == g_ && o->bits_ == bits_ && o->value_group_ == value_group_ && o->scale_slots_ == scale_slots_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    throw std::runtime_error("VeloxFlushPlan: shapes are given when it is built");
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      encoder.set_output_array(o);
      out.push_back(mx::array::unsafe_weak_copy(o));
    }
    for (auto& x : inputs) {
      encoder.set_input_array(x);
      in.push_back(mx::array::unsafe_weak_copy(x));
    }
    encoder.dispatch([in = std::move(in), out = std::move(out), g = g_, bits = bits_, vg = value_group_,
                      G = scale_slots_]() mutable { run(in, out, g, bits, vg, G); });
  }

 private:
  int g_, bits_, value_group_, scale_slots_;

  static void run(std::vector<mx::array>& in, std::vector<mx::array>& out, int g, int bits, int vg, int64_t G) {
    const int64_t H = in[0].shape(1), M = in[0].shape(2), Q = in[1].shape(2), W = in[2].shape(2), D = in[2].shape(3);
    const int64_t DK = out[1].shape(3), NV = D / vg;
    const int levels = (1 << bits) - 1;
    const auto rows = host<int32_t>(in[7]);
    auto quantized = host<int32_t>(in[4]), groups = host<int32_t>(in[5]), room = host<int32_t>(in[6]);
    const auto* live = in[0].data<bool>();  // the big inputs are read in place (row-contiguous: checked when built)
    const auto* key_groups = in[1].data<int32_t>();
    const auto* keys = in[2].data<float>();
    const auto* values = in[3].data<float>();
    std::vector<uint8_t> codes(g * D), value_one(D);
    for (size_t k = 0; k < rows.size(); ++k) {
      const int64_t r = rows[k];
      const int32_t used = quantized[r], number = groups[r];
      const bool* row_live = live + r * H * M;
      const int32_t* row_groups = key_groups + r * H * Q;
      int32_t* target = out[0].data<int32_t>() + k * H * g;
      // Each head's holes among its used slots; the row grows by what the head with the fewest lacks.
      std::vector<std::vector<int64_t>> holes(H);
      int64_t fewest = Q;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t slot = 0; slot < used; ++slot)
          if (!row_live[h * M + slot]) holes[h].push_back(slot);
        fewest = std::min<int64_t>(fewest, holes[h].size());
      }
      const int64_t grown = used + std::max<int64_t>(0, g - fewest);
      if (grown > Q) throw std::runtime_error("VeloxFlushPlan: the region has no room for the group");
      if (number >= G) throw std::runtime_error("VeloxFlushPlan: no key-scale slot left for the new group");
      std::vector<int64_t> slot_of(H * Q, -1);  // window slot j written to region slot s of head h
      for (int64_t h = 0; h < H; ++h) {
        const float* window_keys = keys + (r * H + h) * W * D;
        const float* window_values = values + (r * H + h) * W * D;
        float* scales = out[5].data<float>() + (k * H + h) * D;
        float* zeros = out[6].data<float>() + (k * H + h) * D;
        for (int64_t d = 0; d < D; ++d)  // keys: each channel over the group's tokens
          quantize_run(window_keys + d, g, D, levels, codes.data() + d, D, scales + d, zeros + d);
        const int64_t n_holes = holes[h].size();
        for (int64_t j = 0; j < g; ++j) {
          const int64_t slot = j < n_holes ? holes[h][j] : used + j - n_holes;
          target[h * g + j] = static_cast<int32_t>(slot);
          slot_of[h * Q + slot] = j;
          const int64_t at = (k * H + h) * g + j;
          pack_codes(codes.data() + j * D, D, bits, out[1].data<uint8_t>() + at * DK);
          for (int64_t v = 0; v < NV; ++v)  // values: each token over runs of vg features
            quantize_run(window_values + j * D + v * vg, vg, 1, levels, value_one.data() + v * vg, 1,
                         out[3].data<float>() + at * NV + v, out[4].data<float>() + at * NV + v);
          pack_codes(value_one.data(), D, bits, out[2].data<uint8_t>() + at * DK);
        }
      }
      // Groups a live token uses once the group is in; the others' scales go, the rest renumbered in order.
      const int32_t after = number + 1;
      std::vector<char> in_use(G, 0);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t slot = 0; slot < grown; ++slot) {
          const int64_t j = slot_of[h * Q + slot];
          const bool alive = j >= 0 ? row_live[h * M + Q + j] : row_live[h * M + slot];
          if (alive) in_use[j >= 0 ? number : row_groups[h * Q + slot]] = 1;
        }
      int32_t kept = 0;
      int32_t* renumber = out[7].data<int32_t>() + k * G;
      int32_t* order = out[8].data<int32_t>() + k * G;
      for (int64_t n = 0; n < G; ++n) {
        if (n >= after) in_use[n] = 0;
        kept += in_use[n];
        renumber[n] = std::max(kept - 1, 0);
      }
      int64_t next = 0;
      for (int64_t n = 0; n < G; ++n)
        if (in_use[n]) order[next++] = static_cast<int32_t>(n);
      for (int64_t n = 0; n < G; ++n)
        if (!in_use[n]) order[next++] = static_cast<int32_t>(n);
      const int32_t next_room = after > room[r] ? after + ((kScaleStep - after % kScaleStep) % kScaleStep) : room[r];
      quantized[r] = static_cast<int32_t>(grown);
      groups[r] = kept;
      room[r] = kept < after ? kept : next_room;
    }
    std::memcpy(out[9].data<int32_t>(), quantized.data(), quantized.size() * sizeof(int32_t));
    std::memcpy(out[10].data<int32_t>(), groups.data(), groups.size() * sizeof(int32_t));
    std::memcpy(out[11].data<int32_t>(), room.data(), room.size() * sizeof(int32_t));
  }
};

// One big array of the batch after the flush of rows `rows` (the plan's), in place where no one else holds it.
enum class Apply { Slots, KeyGroups, Scales, Window, Meta };

class FlushApply : public CpuPrimitive {
 public:
  FlushApply(mx::Stream stream, Apply kind, int group) : CpuPrimitive(stream), kind_(kind), g_(group) {}
  const char* name() const override { return "VeloxFlushApply"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const FlushApply*>(&other);
    return o && o->kind_ == kind_ && o->g_ == g_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto& o = outputs[0];
    const bool in_place = inputs[0].is_donatable() && inputs[0].flags().row_contiguous;
    if (in_place) {
      o.copy_shared_buffer(inputs[0]);
    } else {
      o.set_data(mx::allocator::malloc(o.nbytes()));
    }
    encoder.set_output_array(o);
    std::vector<mx::array> in;
    for (auto& x : inputs) {
      encoder.set_input_array(x);
      in.push_back(mx::array::unsafe_weak_copy(x));
    }
    encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(o), in_place, kind = kind_,
                      g = g_]() mutable {
      if (!in_place) copy_contiguous(in[0], out.data<uint8_t>());
      run(in, out, kind, g);
    });
  }

 private:
  Apply kind_;
  int g_;

  static void run(std::vector<mx::array>& in, mx::array& out, Apply kind, int64_t g) {
    const auto rows = host<int32_t>(in[1]);
    const int64_t H = out.shape(1), N = out.shape(2);
    int64_t slot_bytes = out.itemsize();
    for (int axis = 3; axis < out.ndim(); ++axis) slot_bytes *= out.shape(axis);
    uint8_t* data = out.data<uint8_t>();
    for (size_t k = 0; k < rows.size(); ++k) {
      const int64_t r = rows[k];
      uint8_t* row = data + r * H * N * slot_bytes;
      if (kind == Apply::Window) {  // the group leaves the window: the rest moves to its front, zeros after
        for (int64_t h = 0; h < H; ++h) {
          uint8_t* head = row + h * N * slot_bytes;
          std::memmove(head, head + g * slot_bytes, (N - g) * slot_bytes);
          std::memset(head + (N - g) * slot_bytes, 0, g * slot_bytes);
        }
        continue;
      }
      const auto target = host<int32_t>(in[2]);  // [k, H, g]
      const int32_t* row_target = target.data() + k * H * g;
      if (kind == Apply::Slots) {  // in[3]: the new slots [k, H, g, ...]
        const auto fresh = host<uint8_t>(in[3]);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < g; ++j)
            std::memcpy(row + (h * N + row_target[h * g + j]) * slot_bytes,
                        fresh.data() + ((k * H + h) * g + j) * slot_bytes, slot_bytes);
      } else if (kind == Apply::KeyGroups) {  // in[3]: groups before [B], in[4]: renumber [k, G]
        const int32_t number = host<int32_t>(in[3])[r];
        const auto renumber = host<int32_t>(in[4]);
        const int64_t G = in[4].shape(1);
        int32_t* numbers = reinterpret_cast<int32_t*>(row);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < g; ++j) numbers[h * N + row_target[h * g + j]] = number;
        for (int64_t i = 0; i < H * N; ++i) numbers[i] = renumber[k * G + numbers[i]];
      } else if (kind == Apply::Scales) {  // in[3]: groups before [B], in[4]: the group's [k, H, D], in[5]: order [k, G]
        const int32_t number = host<int32_t>(in[3])[r];
        const auto fresh = host<uint8_t>(in[4]);
        const auto order = host<int32_t>(in[5]);
        std::vector<uint8_t> moved(N * slot_bytes);
        for (int64_t h = 0; h < H; ++h) {
          uint8_t* head = row + h * N * slot_bytes;
          std::memcpy(head + number * slot_bytes, fresh.data() + (k * H + h) * slot_bytes, slot_bytes);
          for (int64_t n = 0; n < N; ++n) std::memcpy(moved.data() + n * slot_bytes, head + order[k * N + n] * slot_bytes, slot_bytes);
          std::memcpy(head, moved.data(), N * slot_bytes);
        }
      } else {  // Meta: in[3] the region's width Q as a [Q] shape; window slot j goes to its target, then the shift
        const int64_t Q = in[3].shape(0), W = N - Q;
        for (int64_t h = 0; h < H; ++h) {
          uint8_t* head = row + h * N * slot_bytes;
          for (int64_t j = 0; j < g; ++j)
            std::memcpy(head + row_target[h * g + j] * slot_bytes, head + (Q + j) * slot_bytes, slot_bytes);
          std::memmove(head + Q * slot_bytes, head + (Q + g) * slot_bytes, (W - g) * slot_bytes);
          std::memset(head + (Q + W - g) * slot_bytes, 0, g * slot_bytes);
        }
      }
    }
  }
};

// Everything the plan and the applies read is checked here, on the calling thread, before any work is enqueued:
// an exception on MLX's stream thread ends the process (std::terminate), one here is a Python ValueError.
std::string shape_text(const mx::Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Each array's shape, from the keys' [B, H, W, D], the region's Q (array 1), the codes' DK (array 0) and the
// key scales' G (array 5).
void check_layout(const std::vector<mx::array>& parts, int bits, int value_group) {
  const auto& keys = parts[7];
  const int B = keys.shape(0), H = keys.shape(1), W = keys.shape(2), D = keys.shape(3);
  if (parts[1].ndim() != 3 || parts[5].ndim() != 4)
    throw std::invalid_argument("window_flush: key_groups (array 1) must be [B, H, Q], key_scales (array 5) [B, H, G, D]");
  const int Q = parts[1].shape(2), G = parts[5].shape(2), DK = D * bits / 8, NV = D / value_group;
  const mx::Shape expected[kParts] = {{B, H, Q, DK}, {B, H, Q},     {B, H, Q, DK},    {B, H, Q, NV},    {B, H, Q, NV},
                                      {B, H, G, D},  {B, H, G, D},  {B, H, W, D},     {B, H, W, D},     {B, H, Q + W},
                                      {B, H, Q + W}, {B, H, Q + W}, {B},              {B},              {B}};
  for (int i = 0; i < kParts; ++i)
    if (parts[i].shape() != expected[i])
      throw std::invalid_argument("window_flush: array " + std::to_string(i) + " is " + shape_text(parts[i].shape()) +
                                  ", expected " + shape_text(expected[i]) + " (keys [B, H, W, D] = " +
                                  shape_text(keys.shape()) + ", Q = " + std::to_string(Q) + ", G = " +
                                  std::to_string(G) + ", " + std::to_string(bits) + " bits)");
  if (G < 1) throw std::invalid_argument("window_flush: key_scales (array 5) has no group slot");
}

// The rows: distinct indices of the batch, each with room in its region for the group (its used slots, less the
// fewest holes a head has there, plus the group) and a key-scale slot for it: what the batch's sizing guarantees.
// Reads the rows, the rows' counts (arrays 12 and 13, [B] each) and which slots are live (array 11).
void check_rows(const std::vector<mx::array>& parts, mx::array rows, int group) {
  if (rows.ndim() != 1) throw std::invalid_argument("window_flush: rows must be a 1-d array of row indices");
  auto quantized = parts[12], groups = parts[13], live = mx::contiguous(parts[11], false);
  mx::eval({rows, quantized, groups, live});
  const int64_t B = parts[7].shape(0), H = parts[7].shape(1), Q = parts[1].shape(2), G = parts[5].shape(2);
  const int64_t M = live.shape(2);
  const auto* at = rows.data<int32_t>();
  std::vector<char> seen(B, 0);
  for (int64_t i = 0; i < rows.shape(0); ++i) {
    const int64_t r = at[i];
    if (r < 0 || r >= B)
      throw std::invalid_argument("window_flush: row " + std::to_string(r) + " is not a row of the batch of " +
                                  std::to_string(B));
    if (seen[r]++) throw std::invalid_argument("window_flush: row " + std::to_string(r) + " is given twice");
    const int64_t used = quantized.data<int32_t>()[r], number = groups.data<int32_t>()[r];
    if (used < 0 || used > Q)
      throw std::invalid_argument("window_flush: row " + std::to_string(r) + " uses " + std::to_string(used) +
                                  " slots of a region of " + std::to_string(Q));
    int64_t fewest = Q;  // as FlushPlan counts them: each head's holes among the used slots
    for (int64_t h = 0; h < H; ++h) {
      const bool* head_live = live.data<bool>() + (r * H + h) * M;
      fewest = std::min<int64_t>(fewest, std::count(head_live, head_live + used, false));
    }
    if (used + std::max<int64_t>(0, group - fewest) > Q)
      throw std::invalid_argument("window_flush: row " + std::to_string(r) + " uses " + std::to_string(used) +
                                  " of its region's " + std::to_string(Q) + " slots (" + std::to_string(fewest) +
                                  " holes in its fullest head): no room for a group of " + std::to_string(group));
    if (number < 0 || number >= G)
      throw std::invalid_argument("window_flush: row " + std::to_string(r) + " has " + std::to_string(number) +
                                  " groups and " + std::to_string(G) + " key-scale slots: none left for the new one");
  }
}

std::vector<mx::array> window_flush(const std::vector<mx::array>& parts, const mx::array& rows_in, int group, int bits,
                                    int value_group) {
  const auto s = mx::default_stream(mx::Device::cpu);
  if (parts.size() != kParts) throw std::invalid_argument("window_flush: 15 arrays, as the batch holds them");
  const mx::Dtype dtypes[kParts] = {mx::uint8,   mx::int32,   mx::uint8,   mx::float32, mx::float32,
                                    mx::float32, mx::float32, mx::float32, mx::float32, mx::float32,
                                    mx::int32,   mx::bool_,   mx::int32,   mx::int32,   mx::int32};
  for (int i = 0; i < kParts; ++i)
    if (parts[i].dtype() != dtypes[i]) throw std::invalid_argument("window_flush: array " + std::to_string(i) + " has another dtype");
  const auto& keys = parts[7];
  if (keys.ndim() != 4) throw std::invalid_argument("window_flush: keys (array 7) must be [B, H, W, D]");
  if (group < 1 || group > keys.shape(2) || (bits != 8 && bits != 4) || value_group < 1 || keys.shape(3) % value_group)
    throw std::invalid_argument("window_flush: group, bits or value_group out of range");
  check_layout(parts, bits, value_group);
  const auto rows = mx::astype(rows_in, mx::int32, s);
  check_rows(parts, rows, group);
  const int64_t k = rows.shape(0), H = keys.shape(1), D = keys.shape(3), DK = parts[0].shape(3);
  const int64_t NV = D / value_group, G = parts[5].shape(2), B = keys.shape(0);
  // The plan reads these in place: made row-contiguous here (a no-op for the batch's own buffers).
  const std::vector<mx::array> plan_inputs = {mx::contiguous(parts[11], false, s), mx::contiguous(parts[1], false, s),
                                              mx::contiguous(keys, false, s), mx::contiguous(parts[8], false, s),
                                              parts[12], parts[13], parts[14], rows};
  const std::vector<mx::Shape> plan_shapes = {{(int)k, (int)H, group},     {(int)k, (int)H, group, (int)DK},
                                              {(int)k, (int)H, group, (int)DK}, {(int)k, (int)H, group, (int)NV},
                                              {(int)k, (int)H, group, (int)NV}, {(int)k, (int)H, (int)D},
                                              {(int)k, (int)H, (int)D},   {(int)k, (int)G},
                                              {(int)k, (int)G},           {(int)B},
                                              {(int)B},                   {(int)B}};
  const std::vector<mx::Dtype> plan_types = {mx::int32,   mx::uint8,   mx::uint8, mx::float32, mx::float32, mx::float32,
                                             mx::float32, mx::int32,   mx::int32, mx::int32,   mx::int32,   mx::int32};
  auto plan = mx::array::make_arrays(plan_shapes, plan_types,
                                     std::make_shared<FlushPlan>(s, group, bits, value_group, (int)G), plan_inputs);
  auto apply = [&](const mx::array& part, Apply kind, std::vector<mx::array> extra) {
    std::vector<mx::array> inputs = {part, rows, plan[0]};
    inputs.insert(inputs.end(), extra.begin(), extra.end());
    return mx::array(part.shape(), part.dtype(), std::make_shared<FlushApply>(s, kind, group), inputs);
  };
  const auto region = mx::zeros({(int)parts[1].shape(2)}, mx::bool_, s);  // its shape carries Q to Meta
  return {apply(parts[0], Apply::Slots, {plan[1]}),
          apply(parts[1], Apply::KeyGroups, {parts[13], plan[7]}),
          apply(parts[2], Apply::Slots, {plan[2]}),
          apply(parts[3], Apply::Slots, {plan[3]}),
          apply(parts[4], Apply::Slots, {plan[4]}),
          apply(parts[5], Apply::Scales, {parts[13], plan[5], plan[8]}),
          apply(parts[6], Apply::Scales, {parts[13], plan[6], plan[8]}),
          apply(parts[7], Apply::Window, {}),
          apply(parts[8], Apply::Window, {}),
          apply(parts[9], Apply::Meta, {region}),
          apply(parts[10], Apply::Meta, {region}),
          apply(parts[11], Apply::Meta, {region}),
          plan[9],
          plan[10],
          plan[11]};
}

}  // namespace

void register_window_flush(nb::module_& m) {
  m.def("window_flush", &window_flush, nb::arg("parts"), nb::arg("rows"), nb::arg("group"), nb::arg("bits"),
        nb::arg("value_group"),
        "The 15 arrays of a QuantizedSlotsBatch after rows `rows` moved their window's first `group` tokens into\n"
        "their quantized regions (velox_cache.cache.quantized_holes, the same bits).");
}

}  // namespace velox
