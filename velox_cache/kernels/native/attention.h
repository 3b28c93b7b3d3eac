// Velox's fused attention: the problem one call describes and the tile loops
// (attention_loops.cpp, compiled once per instruction set) that solve one task of it.
#pragma once

#include <chrono>
#include <cstdint>

namespace velox {

// Quantized keys and values (the layout of velox_cache/kernels/kv_codes.py): keys per feature over groups of
// tokens, values per token over groups of features, each x = code * scale + zero. The first `count` keys and
// values of a (batch, head) come from these codes; the ones after them from the problem's float `keys` and
// `values` (the full-precision window), key j >= count being float row j - count. Strides in elements, per axis;
// each array's last axis is contiguous.
struct QuantizedKeysValues {
  int bits = 0;                    // 8, or 4 (two codes a byte, the even feature in the low nibble); 0: none
  int64_t count = 0;               // quantized keys (and values) per (batch, head), before the float ones
  const uint8_t* key_codes = nullptr;  // [B, H, count, D * bits / 8]
  int64_t key_code_strides[3] = {};
  const float* key_scales = nullptr;  // [B, H, groups, D]: one scale per (token group, feature)
  const float* key_zeros = nullptr;   // likewise
  int64_t key_scale_strides[3] = {};  // (the zeros' strides are the scales')
  const int32_t* key_groups = nullptr;  // [B, H, count]: each key's group
  int64_t key_group_strides[2] = {};
  const uint8_t* value_codes = nullptr;  // [B, H, count, D * bits / 8], or null without values
  int64_t value_code_strides[3] = {};
  const float* value_scales = nullptr;  // [B, H, count, D / value_group]: one per (token, group of features)
  const float* value_zeros = nullptr;
  int64_t value_scale_strides[3] = {};
  int64_t value_group = 0;  // features per value scale
};

// One attention call. Strides are in elements, per axis; 0 on a broadcast axis.
struct AttentionProblem {
  const float* queries;  // [B, H*R, S, D]
  int64_t query_strides[4];
  const float* keys;  // [B, H, N, D], feature axis contiguous (key_strides[3] == 1); quantized: only the last N - count
  int64_t key_strides[4];
  const float* values;  // [B, H, N, D] likewise, or null: scores only
  int64_t value_strides[4];
  const void* mask;  // [B, H*R, S, N] float32 (additive) or bool (true = attend), or null
  // Pooled per-head slots: keys/values [B, 1, N, D] whose key j belongs to KV head key_heads[j] (0..task_heads-1);
  // query head q sees only its own KV head's keys. Null: key_heads is the keys' own head axis.
  const int32_t* key_heads;
  int64_t mask_strides[4];
  bool mask_is_bool;
  bool causal;  // lower-right aligned: query i sits at position N - S + i and sees keys j <= N - S + i
  int64_t batch, kv_heads, group, n_queries, n_keys, dim;  // kv_heads: the keys' head axis
  int64_t task_heads;  // the KV heads tasks run over: kv_heads, or the pooled heads of key_heads
  float scale;
  int64_t score_from;    // first query whose attention feeds the key mass (n_queries: none)
  int64_t entropy_from;  // first query whose row entropy is summed (n_queries: none)
  float* output;         // [B, H*R, S, D] row-major, or null without values
  QuantizedKeysValues quantized;  // bits 0: every key and value is a float row of keys / values
};

// The queries [first_query, last_query) of one (batch, KV head), with all their group's heads.
struct AttentionTask {
  int64_t batch, head, first_query, last_query;
};

// What one task adds up in the scoring pass. Each task has its own sums, added together in task order
// afterwards (attention.cpp, `solve`): the same bits whichever thread ran it, and however many there were.
struct ScoreSums {
  float* key_mass;  // [N], zeroed: where the task adds each key's mass (its (batch, head) row of the output when
                    // no other task adds to that row's keys, else a partial row of its own); null when none is asked
                    // for or none of its rows is scored
  double entropy;   // sum of its rows' entropies (natural log, not yet divided by log N)
  double scoring_seconds = 0.0;  // the task's time in its scoring pass (key mass, entropy), apart from the output
};

// Times a block into `seconds` (added when the block ends, whatever way it ends).
struct AddSeconds {
  explicit AddSeconds(double& seconds) : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
  ~AddSeconds() { seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  double& seconds_;
  std::chrono::steady_clock::time_point start_;
};

struct AttentionLoops {
  const char* instruction_set;
  int64_t rows_per_task;  // score rows (queries x group) a task should hold for its tiles to stay in cache
  void (*run_task)(const AttentionProblem& problem, const AttentionTask& task, ScoreSums& sums);
};

namespace avx512 { extern const AttentionLoops attention_loops; }
namespace avx2 { extern const AttentionLoops attention_loops; }
namespace baseline { extern const AttentionLoops attention_loops; }

// The fastest set this CPU can run (the avx2 set needs FMA too); VELOX_NATIVE_ISA=baseline|avx2|avx512
// picks one by name (for tests and benchmarks; an ISA this CPU lacks is refused).
const AttentionLoops& best_attention_loops();

}  // namespace velox
