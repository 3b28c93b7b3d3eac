// VeloxAttention: fused attention as one MLX primitive, FlashAttention-style on
// the CPU. Query blocks x key blocks with an online softmax in float32, so no
// [S, N] scores ever reach memory; grouped-query attention without repeating
// keys or values; a lower-right aligned causal mask that skips the key blocks
// a query block cannot see; an optional additive or boolean mask; the tasks
// (batch, KV head, query block) shared by the cores on the threads the native
// ops keep (pool.h), up to 8 unless VELOX_ATTENTION_THREADS says otherwise (no
// BLAS), each task summing into its own place, added up in task order: the
// same bits on every run and for any number of threads. The tile loops are attention_loops.cpp, one set per instruction set.
//
// Outputs, in this order and only those asked for: the attention output
// [B, H*R, S, D]; each key's attention mass from the last `score_rows` queries,
// summed over them and the group, [B, H, N]; and the sum over the last
// `entropy_rows` queries and the group of each row's entropy / log(N), a scalar.
// Mass and entropy come from exact probabilities: each scored row's final
// maximum and sum, in a second pass over only those rows.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "attention.h"
#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace velox {
namespace {

constexpr double MIN_PARALLEL_FLOPS = 1e6;  // below, waking a second thread costs more than it saves

unsigned thread_limit() {
  static const unsigned limit = threads_wanted("VELOX_ATTENTION_THREADS");  // read once
  return limit;
}

const AttentionLoops& attention_loops() {
  static const AttentionLoops& chosen = best_attention_loops();
  return chosen;
}

void copy_strides(const mx::array& a, int64_t* strides) {
  for (int axis = 0; axis < 4; ++axis) strides[axis] = a.strides()[axis];
}

// [B, H, N, D] rows with the feature axis made contiguous, for the rare input whose last axis is strided.
const float* packed_rows(const mx::array& a, int64_t* strides, std::vector<float>& out) {
  const int64_t batch = a.shape(0), heads = a.shape(1), n = a.shape(2), dim = a.shape(3);
  out.resize(a.size());
  const float* source = a.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const float* row = source + b * strides[0] + h * strides[1] + i * strides[2];
        float* to = out.data() + ((b * heads + h) * n + i) * dim;
        for (int64_t d = 0; d < dim; ++d) to[d] = row[d * strides[3]];
      }
  strides[0] = heads * n * dim;
  strides[1] = n * dim;
  strides[2] = dim;
  strides[3] = 1;
  return out.data();
}

// Every task of the call, the costliest (latest causal query blocks) first.
std::vector<AttentionTask> tasks_of(const AttentionProblem& p, int64_t first_query) {
  const int64_t rows = attention_loops().rows_per_task;
  const int64_t block = std::max<int64_t>(1, rows / p.group);
  std::vector<AttentionTask> tasks;
  for (int64_t stop = p.n_queries; stop > first_query; stop -= block)
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.task_heads; ++h) tasks.push_back({b, h, std::max(first_query, stop - block), stop});
  return tasks;
}

double flops_of(const AttentionProblem& p, const std::vector<AttentionTask>& tasks) {
  double flops = 0;
  for (const auto& t : tasks) {
    const double keys = p.causal ? p.n_keys - p.n_queries + t.last_query : p.n_keys;
    flops += 4.0 * (t.last_query - t.first_query) * p.group * keys * p.dim;
  }
  return flops;
}

// Denormal floats flushed to zero (FTZ) and read as zero (DAZ) while a thread runs attention tasks,
// its own setting restored after. A peaked softmax makes many weights far below 1e-38 (its exp is
// exactly 0 only below -87.3), and x86 takes a microcode assist of ~100 cycles for each denormal
// product: on real prompts the tiles ran at half their speed on random inputs. Weights that small
// change nothing within ATTENTION_TOLERANCE.
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Where each task adds its key mass ([N], zeroed): its (batch, head) row of the output when it is the only task
// scoring that head's keys, else a partial row of its own, added to the output once every task has run (`add_partials`).
// Pooled slots share one output row per batch, each head's tasks touching only their head's keys of it.
struct MassPlaces {
  std::vector<float*> rows;   // per task; null for a task that scores no row (or no key mass asked for)
  std::vector<char> partial;  // per task: its row is a partial
  std::vector<float> partials;  // [tasks with a partial, N]
};

float* output_row(const AttentionProblem& p, const AttentionTask& t, float* key_mass) {
  return key_mass + (t.batch * p.kv_heads + (p.key_heads != nullptr ? 0 : t.head)) * p.n_keys;
}

MassPlaces mass_places(const AttentionProblem& p, const std::vector<AttentionTask>& tasks, float* key_mass) {
  MassPlaces places{std::vector<float*>(tasks.size(), nullptr), std::vector<char>(tasks.size(), 0), {}};
  if (key_mass == nullptr) return places;
  const auto scores = [&](const AttentionTask& t) { return t.last_query > p.score_from; };
  const auto head_of = [&](const AttentionTask& t) { return t.batch * p.task_heads + t.head; };
  std::vector<int64_t> scoring(p.batch * p.task_heads, 0);
  for (const auto& t : tasks) scoring[head_of(t)] += scores(t);
  for (size_t i = 0; i < tasks.size(); ++i) places.partial[i] = scores(tasks[i]) && scoring[head_of(tasks[i])] > 1;
  places.partials.assign(std::count(places.partial.begin(), places.partial.end(), 1) * p.n_keys, 0.0f);
  float* next_partial = places.partials.data();
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (places.partial[i]) {
      places.rows[i] = next_partial;
      next_partial += p.n_keys;
    } else if (scores(tasks[i])) {
      places.rows[i] = output_row(p, tasks[i], key_mass);
    }
  }
  return places;
}

// The partials added to their output rows in task order: each key's mass summed in one order, whatever thread ran what.
void add_partials(const AttentionProblem& p, const std::vector<AttentionTask>& tasks, const MassPlaces& places,
               float* key_mass) {
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (!places.partial[i]) continue;
    float* row = output_row(p, tasks[i], key_mass);
    const float* partial = places.rows[i];
    for (int64_t j = 0; j < p.n_keys; ++j) row[j] += partial[j];
  }
}

// Run every task on up to thread_limit() threads, claimed as they come; the key mass goes to `key_mass` (zeroed),
// the entropy sum out. Each task sums into its own place and the places are added in task order: the results
// are the same bits on every run and for any number of threads.
// Wall seconds of every call's scoring passes so far: each call's wall time times its tasks' share of time
// spent scoring (the key mass and entropy pass) rather than computing the output (``scoring_seconds()``).
std::atomic<int64_t> scoring_nanoseconds{0};

double solve(const AttentionProblem& p, float* key_mass) {
  const auto started = std::chrono::steady_clock::now();
  const int64_t first_scored = std::min(p.score_from, p.entropy_from);
  const auto tasks = tasks_of(p, p.values == nullptr ? first_scored : 0);
  const auto& loops = attention_loops();
  unsigned threads = std::min<unsigned>(thread_limit(), static_cast<unsigned>(std::max<size_t>(1, tasks.size())));
  if (flops_of(p, tasks) < MIN_PARALLEL_FLOPS) threads = 1;
  const MassPlaces places = mass_places(p, tasks, key_mass);
  std::vector<double> entropy(tasks.size(), 0.0), task_seconds(tasks.size(), 0.0), scoring(tasks.size(), 0.0);
  std::atomic<size_t> next{0};
  auto work = [&] {
    FlushDenormals flush;
    for (size_t i = next++; i < tasks.size(); i = next++) {
      ScoreSums sums{places.rows[i], 0.0};
      {
        AddSeconds timed(task_seconds[i]);
        loops.run_task(p, tasks[i], sums);
      }
      entropy[i] = sums.entropy;
      scoring[i] = sums.scoring_seconds;
    }
  };
  run_shared(threads, work);
  add_partials(p, tasks, places, key_mass);
  double all = 0.0, scored = 0.0;
  for (size_t i = 0; i < tasks.size(); ++i) all += task_seconds[i], scored += scoring[i];
  if (scored > 0.0 && all > 0.0) {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    scoring_nanoseconds += static_cast<int64_t>(1e9 * wall * std::min(1.0, scored / all));
  }
  double total = 0.0;
  for (const double e : entropy) total += e;
  return total;
}

// What one call asks for, beside its arrays.
struct Settings {
  float scale;
  bool causal, has_values, has_mask;
  int score_rows, entropy_rows;
  int pooled_heads;  // > 0: the last input is key_heads [N] (int32), the KV head of each pooled slot
  int kv_bits = 0;   // 8 or 4: quantized keys and values (QuantizedKeysValues) follow the other inputs
  int value_group = 0;
  bool operator==(const Settings&) const = default;

  // Where the quantized inputs start: key codes, key scales, key zeros, key groups, then (with values) value
  // codes, value scales, value zeros.
  size_t quantized_input() const { return 2 + has_values + has_mask + (pooled_heads > 0); }
};

// Strides of `a`'s first `axes` axes, in elements; its last axis must be contiguous (the cache's buffers are).
template <typename T>
const T* rows_of(const mx::array& a, int64_t* strides, int axes) {
  if (a.strides()[a.ndim() - 1] != 1 && a.shape(a.ndim() - 1) > 1) {
    throw std::invalid_argument("attention: quantized codes, scales and groups need a contiguous last axis");
  }
  for (int axis = 0; axis < axes; ++axis) strides[axis] = a.strides()[axis];
  return a.data<T>();
}

void compute(const Settings& settings, const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const mx::array& queries = in[0];
  const mx::array& keys = in[1];
  AttentionProblem p{};
  p.batch = queries.shape(0);
  p.kv_heads = keys.shape(1);
  p.task_heads = settings.pooled_heads > 0 ? settings.pooled_heads : p.kv_heads;
  p.group = queries.shape(1) / p.task_heads;
  p.n_queries = queries.shape(2);
  p.n_keys = keys.shape(2);
  p.dim = queries.shape(3);
  p.scale = settings.scale;
  p.causal = settings.causal;
  p.score_from = settings.score_rows > 0 ? p.n_queries - settings.score_rows : p.n_queries;
  p.entropy_from = settings.entropy_rows > 0 ? p.n_queries - settings.entropy_rows : p.n_queries;
  p.queries = queries.data<float>();
  copy_strides(queries, p.query_strides);
  std::vector<float> packed_keys, packed_values;
  copy_strides(keys, p.key_strides);
  p.keys = p.key_strides[3] == 1 ? keys.data<float>() : packed_rows(keys, p.key_strides, packed_keys);
  size_t next_input = 2, next_output = 0;
  if (settings.has_values) {
    const mx::array& values = in[next_input++];
    copy_strides(values, p.value_strides);
    p.values = p.value_strides[3] == 1 ? values.data<float>() : packed_rows(values, p.value_strides, packed_values);
    p.output = out[next_output++].data<float>();
  }
  if (settings.has_mask) {
    const mx::array& mask = in[next_input++];
    copy_strides(mask, p.mask_strides);
    p.mask_is_bool = mask.dtype() == mx::bool_;
    p.mask = p.mask_is_bool ? static_cast<const void*>(mask.data<bool>()) : mask.data<float>();
  }
  std::vector<int32_t> key_heads;
  if (settings.pooled_heads > 0) {
    const mx::array& heads = in[next_input++];
    const int32_t* source = heads.data<int32_t>();
    const int64_t step = heads.strides()[0];
    key_heads.resize(p.n_keys);
    for (int64_t j = 0; j < p.n_keys; ++j) key_heads[j] = source[j * step];
    p.key_heads = key_heads.data();
  }
  if (settings.kv_bits != 0) {
    QuantizedKeysValues& q = p.quantized;
    size_t at = settings.quantized_input();
    const mx::array& key_codes = in[at];
    q.bits = settings.kv_bits;
    q.count = key_codes.shape(2);
    q.key_codes = rows_of<uint8_t>(key_codes, q.key_code_strides, 3);
    q.key_scales = rows_of<float>(in[at + 1], q.key_scale_strides, 3);
    int64_t zero_strides[3];
    q.key_zeros = rows_of<float>(in[at + 2], zero_strides, 3);
    if (!std::equal(zero_strides, zero_strides + 3, q.key_scale_strides)) {
      throw std::invalid_argument("attention: key scales and zeros must be laid out alike");
    }
    q.key_groups = rows_of<int32_t>(in[at + 3], q.key_group_strides, 2);
    if (settings.has_values) {
      q.value_codes = rows_of<uint8_t>(in[at + 4], q.value_code_strides, 3);
      q.value_scales = rows_of<float>(in[at + 5], q.value_scale_strides, 3);
      q.value_zeros = rows_of<float>(in[at + 6], zero_strides, 3);
      if (!std::equal(zero_strides, zero_strides + 3, q.value_scale_strides)) {
        throw std::invalid_argument("attention: value scales and zeros must be laid out alike");
      }
      q.value_group = settings.value_group;
    }
    p.n_keys += q.count;
  }
  float* key_mass = nullptr;
  if (settings.score_rows > 0) {
    key_mass = out[next_output++].data<float>();
    std::fill(key_mass, key_mass + p.batch * p.kv_heads * p.n_keys, 0.0f);
  }
  const double entropy = solve(p, key_mass);
  if (settings.entropy_rows > 0) {
    *out[next_output].data<float>() = p.n_keys >= 2 ? static_cast<float>(entropy / std::log(double(p.n_keys))) : 0.0f;
  }
}

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream s, Settings settings) : mx::Primitive(s), settings_(settings) {}

  const char* name() const override { return "VeloxAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const Attention*>(&other);
    return o != nullptr && o->settings_ == settings_;
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("VeloxAttention: Velox's native ops run on the CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int quantized = settings_.kv_bits != 0 ? inputs[settings_.quantized_input()].shape(2) : 0;
    return shapes(inputs[0], inputs[1], quantized);
  }

  // The outputs' shapes; `quantized` keys come before the float `keys` (0 without quantized inputs).
  std::vector<mx::Shape> shapes(const mx::array& queries, const mx::array& keys, int quantized = 0) const {
    std::vector<mx::Shape> result;
    if (settings_.has_values) result.push_back(queries.shape());
    if (settings_.score_rows > 0) result.push_back({keys.shape(0), keys.shape(1), keys.shape(2) + quantized});
    if (settings_.entropy_rows > 0) result.push_back({});
    return result;
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weak_inputs, weak_outputs;
    for (const auto& input : inputs) {
      encoder.set_input_array(input);
      weak_inputs.push_back(mx::array::unsafe_weak_copy(input));
    }
    for (auto& output : outputs) {
      output.set_data(mx::allocator::malloc(output.nbytes()));
      encoder.set_output_array(output);
      weak_outputs.push_back(mx::array::unsafe_weak_copy(output));
    }
    encoder.dispatch([settings = settings_, in = std::move(weak_inputs), out = std::move(weak_outputs)]() mutable {
      compute(settings, in, out);
    });
  }

 private:
  Settings settings_;
};

mx::array float32(const mx::array& a, const mx::Stream& s) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
}

using Results = std::tuple<std::optional<mx::array>, std::optional<mx::array>, std::optional<mx::array>>;

// What every call checks and passes first: the causal and nothing-to-compute checks (the rows clamped to the
// queries), then the inputs queries, keys, values (if any) and the mask (if any) broadcast to [B, H*R, S, N].
std::vector<mx::array> leading_inputs(const char* who, const mx::array& queries, const mx::array& keys,
                                      const std::optional<mx::array>& values, const std::optional<mx::array>& mask,
                                      bool causal, int n_keys, int& score_rows, int& entropy_rows,
                                      const mx::Stream& s) {
  const int batch = queries.shape(0), q_heads = queries.shape(1), n_queries = queries.shape(2);
  const std::string name(who);
  if (causal && (mask || n_keys < n_queries)) {
    throw std::invalid_argument(name + ": causal takes no mask array and at least as many keys as queries");
  }
  score_rows = std::clamp(score_rows, 0, n_queries);
  entropy_rows = std::clamp(entropy_rows, 0, n_queries);
  if (!values && score_rows == 0 && entropy_rows == 0) {
    throw std::invalid_argument(name + ": nothing to compute (no values, no score_rows, no entropy_rows)");
  }
  std::vector<mx::array> inputs = {float32(queries, s), float32(keys, s)};
  if (values) inputs.push_back(float32(*values, s));
  if (mask) {
    if (mask->ndim() > 4) throw std::invalid_argument(name + ": a mask has at most 4 axes");
    mx::Shape shape(4 - mask->ndim(), 1);
    shape.insert(shape.end(), mask->shape().begin(), mask->shape().end());
    auto m = mx::reshape(*mask, shape, s);
    m = mask->dtype() == mx::bool_ ? m : float32(m, s);
    inputs.push_back(mx::broadcast_to(m, {batch, q_heads, n_queries, n_keys}, s));
  }
  return inputs;
}

// The primitive's outputs as (output, key mass, entropy), each None where not asked for.
Results results_of(const std::shared_ptr<Attention>& primitive, const std::vector<mx::array>& inputs,
                   const mx::array& queries, const mx::array& keys, int quantized, bool has_values, int score_rows,
                   int entropy_rows) {
  auto shapes = primitive->shapes(queries, keys, quantized);
  auto arrays = mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32), primitive, inputs);
  Results result;
  size_t next = 0;
  if (has_values) std::get<0>(result) = arrays[next++];
  if (score_rows > 0) std::get<1>(result) = arrays[next++];
  if (entropy_rows > 0) std::get<2>(result) = arrays[next++];
  return result;
}

Results attention(
    const mx::array& queries, const mx::array& keys, const std::optional<mx::array>& values,
    const std::optional<mx::array>& mask, float scale, bool causal, int score_rows, int entropy_rows,
    const std::optional<mx::array>& key_heads, int pooled_heads) {
  const auto s = mx::default_stream(mx::Device::cpu);
  if (queries.ndim() != 4 || keys.ndim() != 4) {
    throw std::invalid_argument("attention: queries [B, H*R, S, D] and keys [B, H, N, D]");
  }
  const int batch = queries.shape(0), q_heads = queries.shape(1), n_queries = queries.shape(2),
            dim = queries.shape(3);
  const int kv_heads = keys.shape(1), n_keys = keys.shape(2);
  if (keys.shape(0) != batch || keys.shape(3) != dim || kv_heads == 0 || q_heads % kv_heads) {
    throw std::invalid_argument("attention: keys must be [B, H, N, D] with H dividing the query heads");
  }
  if (key_heads) {
    if (kv_heads != 1 || pooled_heads < 1 || q_heads % pooled_heads || causal || key_heads->ndim() != 1 ||
        key_heads->shape(0) != n_keys) {
      throw std::invalid_argument(
          "attention: key_heads [N] takes pooled keys [B, 1, N, D], n_heads >= 1 dividing the query heads, no causal");
    }
  } else {
    pooled_heads = 0;
  }
  if (values && values->shape() != keys.shape()) throw std::invalid_argument("attention: values must be keys' shape");
  auto inputs = leading_inputs("attention", queries, keys, values, mask, causal, n_keys, score_rows, entropy_rows, s);
  if (pooled_heads > 0) inputs.push_back(mx::astype(*key_heads, mx::int32, s));
  auto primitive = std::make_shared<Attention>(
      s, Settings{scale, causal, values.has_value(), mask.has_value(), score_rows, entropy_rows, pooled_heads});
  return results_of(primitive, inputs, queries, keys, 0, values.has_value(), score_rows, entropy_rows);
}

// Attention over quantized keys and values followed by float ones (the full-precision window): checks the
// layout of velox_cache/kernels/kv_codes.py and builds the same primitive with the codes as extra inputs.
Results attention_quantized(
    const mx::array& queries, const mx::array& keys, const std::optional<mx::array>& values,
    const mx::array& key_codes, const mx::array& key_scales, const mx::array& key_zeros,
    const mx::array& key_groups, const std::optional<mx::array>& value_codes,
    const std::optional<mx::array>& value_scales, const std::optional<mx::array>& value_zeros,
    const std::optional<mx::array>& mask, float scale, bool causal, int score_rows, int entropy_rows, int bits,
    int value_group) {
  const auto s = mx::default_stream(mx::Device::cpu);
  if (queries.ndim() != 4 || keys.ndim() != 4) {
    throw std::invalid_argument("attention_quantized: queries [B, H*R, S, D] and float keys [B, H, N, D]");
  }
  const int batch = queries.shape(0), q_heads = queries.shape(1), n_queries = queries.shape(2),
            dim = queries.shape(3);
  const int kv_heads = keys.shape(1);
  if (bits != 8 && bits != 4) throw std::invalid_argument("attention_quantized: bits must be 8 or 4");
  if (bits == 4 && dim % 2) throw std::invalid_argument("attention_quantized: 4 bits need an even head dim");
  if (keys.shape(0) != batch || keys.shape(3) != dim || kv_heads == 0 || q_heads % kv_heads) {
    throw std::invalid_argument("attention_quantized: keys must be [B, H, N, D] with H dividing the query heads");
  }
  const int count = key_codes.ndim() == 4 ? key_codes.shape(2) : -1;
  const mx::Shape codes_shape = {batch, kv_heads, count, dim * bits / 8};
  if (key_codes.shape() != codes_shape || key_codes.dtype() != mx::uint8) {
    throw std::invalid_argument("attention_quantized: key_codes must be uint8 [B, H, count, D * bits / 8]");
  }
  if (key_scales.ndim() != 4 || key_scales.shape(0) != batch || key_scales.shape(1) != kv_heads ||
      key_scales.shape(3) != dim || key_zeros.shape() != key_scales.shape()) {
    throw std::invalid_argument("attention_quantized: key scales and zeros must be [B, H, groups, D]");
  }
  if (key_groups.shape() != mx::Shape{batch, kv_heads, count}) {
    throw std::invalid_argument("attention_quantized: key_groups must be [B, H, count]");
  }
  if (values.has_value() != value_codes.has_value() || values.has_value() != value_scales.has_value() ||
      values.has_value() != value_zeros.has_value()) {
    throw std::invalid_argument("attention_quantized: values, value codes, scales and zeros come together");
  }
  if (values) {
    if (values->shape() != keys.shape()) throw std::invalid_argument("attention_quantized: values must be keys' shape");
    if (value_group < 1 || dim % value_group || (bits == 4 && value_group % 2)) {
      throw std::invalid_argument("attention_quantized: value_group must divide the head dim (and be even at 4 bits)");
    }
    if (value_codes->shape() != codes_shape || value_codes->dtype() != mx::uint8) {
      throw std::invalid_argument("attention_quantized: value_codes must be uint8 like key_codes");
    }
    const mx::Shape scales_shape = {batch, kv_heads, count, dim / value_group};
    if (value_scales->shape() != scales_shape || value_zeros->shape() != scales_shape) {
      throw std::invalid_argument("attention_quantized: value scales and zeros must be [B, H, count, D / value_group]");
    }
  }
  auto inputs = leading_inputs("attention_quantized", queries, keys, values, mask, causal, count + keys.shape(2),
                               score_rows, entropy_rows, s);
  inputs.push_back(key_codes);
  inputs.push_back(float32(key_scales, s));
  inputs.push_back(float32(key_zeros, s));
  inputs.push_back(mx::astype(key_groups, mx::int32, s));
  if (values) {
    inputs.push_back(*value_codes);
    inputs.push_back(float32(*value_scales, s));
    inputs.push_back(float32(*value_zeros, s));
  }
  Settings settings{scale, causal, values.has_value(), mask.has_value(), score_rows, entropy_rows, 0, bits,
                    values ? value_group : 0};
  auto primitive = std::make_shared<Attention>(s, settings);
  return results_of(primitive, inputs, queries, keys, count, values.has_value(), score_rows, entropy_rows);
}

}  // namespace

void register_attention(nb::module_& m) {
  m.def("attention_instruction_set", [] { return std::string(attention_loops().instruction_set); },
        "The instruction set of the attention tile loops this CPU runs.");
  m.def("attention_scoring_seconds", [] { return 1e-9 * static_cast<double>(scoring_nanoseconds.load()); },
        "Wall seconds every attention call so far spent in its scoring pass (key mass and entropy), apart from\n"
        "its output: each call's wall time times its tasks' share of time in that pass. Only grows.");
  m.def("attention", &attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values").none(),
        nb::arg("mask").none(), nb::kw_only(), nb::arg("scale"), nb::arg("causal") = false,
        nb::arg("score_rows") = 0, nb::arg("entropy_rows") = 0, nb::arg("key_heads").none() = nb::none(),
        nb::arg("n_heads") = 0,
        "Fused attention of queries [B, H*R, S, D] over keys/values [B, H, N, D] (values None: scores only):\n"
        "(output [B, H*R, S, D] or None, key mass of the last score_rows queries [B, H, N] or None,\n"
        "sum of the last entropy_rows rows' entropy / log(N) or None), all float32. causal is lower-right\n"
        "aligned; mask is None or an additive float / boolean array broadcastable to [B, H*R, S, N].\n"
        "key_heads [N] (int32) with n_heads: pooled per-head slots, keys/values [B, 1, N, D] whose key j\n"
        "belongs to KV head key_heads[j] < n_heads; query head q sees only KV head q // (H*R / n_heads)'s keys.");
  m.def("attention_quantized", &attention_quantized, nb::arg("queries"), nb::arg("keys"), nb::arg("values").none(),
        nb::arg("key_codes"), nb::arg("key_scales"), nb::arg("key_zeros"), nb::arg("key_groups"),
        nb::arg("value_codes").none(), nb::arg("value_scales").none(), nb::arg("value_zeros").none(),
        nb::arg("mask").none(), nb::kw_only(), nb::arg("scale"), nb::arg("causal") = false,
        nb::arg("score_rows") = 0, nb::arg("entropy_rows") = 0, nb::arg("bits"), nb::arg("value_group") = 0,
        "attention() over quantized keys and values followed by float ones (velox_cache/kernels/kv_codes.py):\n"
        "per (batch, head) the first `count` keys are key_codes [B, H, count, D * bits / 8] (uint8; 4 bits: two a\n"
        "byte, the even feature low) times key_scales plus key_zeros [B, H, groups, D] of each key's group\n"
        "key_groups [B, H, count] (int32), the values likewise with value_scales / value_zeros [B, H, count,\n"
        "D / value_group]; then the float keys / values [B, H, N, D]. Each key block is dequantized into the\n"
        "tiles' workspace as it is read: no float copy of the cache is made. Returns what attention() returns,\n"
        "the key mass over count + N keys.");
}

}  // namespace velox
