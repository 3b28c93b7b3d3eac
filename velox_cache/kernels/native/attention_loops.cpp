// The tile loops of Velox's fused attention, one task at a time. CMake compiles
// this file once per instruction set (VELOX_ISA names the namespace), with FMA
// contraction allowed and -mfma on x86 sets: unlike loops.cpp, nothing here has
// to round as the pure-MLX kernel does.
//
// A task is the queries [q0, q1) of one (batch, KV head) with all R heads of its
// group: M = (q1 - q0) * R score rows, ordered (query, group head). Everything
// is held transposed, rows along the vector lanes:
//
//   Qt [D][Mp]   the queries times `scale`      St [KB][Mp]  one key block's scores, then weights
//   Ot [D][Mp]   the unnormalised output        m, l [Mp]    each row's running maximum and sum
//
// (Mp: M rounded up to whole vectors). Per key block of KB keys: St = K_block Qt
// (each key's element broadcast against a vector of rows), masks, the online
// softmax (row maxima and sums are lane-wise vector ops, no horizontal
// reductions), then Ot = Ot * alpha + V_block^T St (each value element
// broadcast). Keys and values are read in place, never packed or repeated per
// group head. Rows whose attention is scored get a second pass over the same
// key blocks with their final maximum and sum: exact probabilities, summed
// into each key's mass, and each row's entropy. A row that sees no key (all
// masked) weighs nothing: it outputs 0 and adds no mass and no entropy. A NaN
// score makes its row NaN (output, and the mass and entropy it is summed into),
// as MLX's attention does.

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention.h"
#include "isa_vectors.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace velox::VELOX_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int TILE = 12;  // keys (or value features) per micro-kernel: 12 x 2 accumulators of 32 registers
#else
constexpr int TILE = 6;  // 6 x 2 accumulators of 16 registers
#endif
constexpr int KEY_BLOCK = 64;                // keys per block: St and a block of keys stay in L1/L2
constexpr int64_t ROWS_PER_TASK = 24 * LANES;  // score rows per task: Qt, St and Ot stay in L2
#if defined(__AVX512F__)
#define LANE_TAIL_8 , 8, 9, 10, 11, 12, 13, 14, 15
#define LANE_TAIL_4 , 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#elif defined(__AVX__)
#define LANE_TAIL_8
#define LANE_TAIL_4 , 4, 5, 6, 7
#else
#define LANE_TAIL_8
#define LANE_TAIL_4
#endif

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }
inline Ints load_ints(const int32_t* p) {
  Ints v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Every lane x, as one broadcast (`Floats{} + x` keeps an add: +0.0 is no identity for -0.0).
template <typename Vector, typename Scalar, size_t... LANE>
inline Vector broadcast(Scalar x, std::index_sequence<LANE...>) {
  return Vector{((void)LANE, x)...};
}
inline Floats splat(float x) { return broadcast<Floats>(x, std::make_index_sequence<LANES>{}); }
// LANES codes (bytes) as floats: zero-extended to 32-bit lanes, then converted (GCC's generic conversion
// of a byte vector builds it lane by lane, so x86 sets use the widening instruction themselves).
inline Floats codes_to_floats(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  Floats v;
  for (int i = 0; i < LANES; ++i) v[i] = static_cast<float>(p[i]);
#endif
  Floats out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}
inline Floats codes_at(const uint8_t* p) { return codes_to_floats(p); }
// LANES packed 4-bit pairs (bytes) as the low nibbles' floats and the high nibbles'.
inline void nibbles_to_floats(const uint8_t* p, Floats& low, Floats& high) {
  uint8_t low_codes[LANES], high_codes[LANES];
  for (int i = 0; i < LANES; ++i) {
    low_codes[i] = p[i] & 15;
    high_codes[i] = p[i] >> 4;
  }
  low = codes_to_floats(low_codes);
  high = codes_to_floats(high_codes);
}
inline Ints splat_int(int32_t x) { return broadcast<Ints>(x, std::make_index_sequence<LANES>{}); }
// Sum (maximum) of the lanes, by halving: the upper half folded onto the lower.
inline Floats fold_halves(Floats v, bool maximum) {
#if defined(__AVX512F__)
  Floats upper = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = maximum ? (upper > v ? upper : v) : v + upper;
#endif
#if defined(__AVX__) || defined(__AVX512F__)
  if constexpr (LANES >= 8) {
    Floats quarter = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3 LANE_TAIL_8);
    v = maximum ? (quarter > v ? quarter : v) : v + quarter;
  }
#endif
  Floats pair = __builtin_shufflevector(v, v, 2, 3, 0, 1 LANE_TAIL_4);
  v = maximum ? (pair > v ? pair : v) : v + pair;
  Floats one = __builtin_shufflevector(v, v, 1, 0, 2, 3 LANE_TAIL_4);
  return maximum ? (one > v ? one : v) : v + one;
}
inline float lane_sum(Floats v) { return fold_halves(v, false)[0]; }
inline float lane_max(Floats v) { return fold_halves(v, true)[0]; }
// v on the lanes whose bits `lanes` sets, +0 on the others (whatever v holds there, NaN too).
inline Floats only(Ints lanes, Floats v) {
  Ints bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits &= lanes;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// exp(v) in float32, ~1 ulp (Cephes' range reduction and polynomial, as loops.cpp's
// exp_float32); exactly 0 below -87.3 (so -inf, a masked key, gives 0, never NaN); NaN stays NaN
// (a NaN score makes its row NaN, as MLX's softmax does, instead of a weight of exp(88)).
inline Floats exp_vector(Floats v) {
  const Floats x = v;
  const Ints nan = v != v;
  const Ints underflow = v < splat(-87.3365447504019f);
  v = v < splat(88.0f) ? v : splat(88.0f);
  v = v > splat(-87.3365447504019f) ? v : splat(-87.3365447504019f);
  const Floats round = splat(12582912.0f);  // 1.5 * 2**23: adding and subtracting it rounds to an integer
  const Floats n = (v * 1.44269504088896341f + round) - round;
  Floats r = v - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Floats p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  Floats scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const Floats result = p * scale;
  return nan ? x : (underflow ? splat(0.0f) : result);
}

// ---------------------------------------------------------------- micro-kernels

// St[i][rows] = sum_d K[i][d] * Qt[d][rows] for KEYS keys and NV vectors of rows.
template <int KEYS, int NV>
inline void scores_tile(const float* key, int64_t key_stride, const float* qt, int64_t mp, int64_t dim, float* st) {
  Floats acc[KEYS][NV];
#pragma GCC unroll 16
  for (int i = 0; i < KEYS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = Floats{};
  for (int64_t d = 0; d < dim; ++d) {
    Floats q[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) q[v] = load(qt + d * mp + v * LANES);
#pragma GCC unroll 16
    for (int i = 0; i < KEYS; ++i) {
      const Floats k = splat(key[i * key_stride + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] += k * q[v];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < KEYS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(st + i * mp + v * LANES, acc[i][v]);
}

// Ot[f][rows] = Ot[f][rows] * alpha[rows] + sum_j V[j][f] * St[j][rows] for FEATURES features.
template <int FEATURES, int NV>
inline void values_tile(const float* value, int64_t value_stride, int64_t n_block, const float* st, int64_t mp,
                        const float* alpha, float* ot) {
  Floats acc[FEATURES][NV];
  Floats scale[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) scale[v] = load(alpha + v * LANES);
#pragma GCC unroll 16
  for (int i = 0; i < FEATURES; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = load(ot + i * mp + v * LANES) * scale[v];
  for (int64_t j = 0; j < n_block; ++j) {
    Floats p[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) p[v] = load(st + j * mp + v * LANES);
#pragma GCC unroll 16
    for (int i = 0; i < FEATURES; ++i) {
      const Floats x = splat(value[j * value_stride + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] += x * p[v];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < FEATURES; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(ot + i * mp + v * LANES, acc[i][v]);
}

// The tile of `count` (1..TILE) keys or features: a compile-time size for each.
template <int NV, int SIZE = TILE>
inline void scores_tiles(int count, const float* key, int64_t key_stride, const float* qt, int64_t mp, int64_t dim,
                         float* st) {
  if constexpr (SIZE >= 1) {
    if (count == SIZE) return scores_tile<SIZE, NV>(key, key_stride, qt, mp, dim, st);
    scores_tiles<NV, SIZE - 1>(count, key, key_stride, qt, mp, dim, st);
  }
}

template <int NV, int SIZE = TILE>
inline void values_tiles(int count, const float* value, int64_t value_stride, int64_t n_block, const float* st,
                         int64_t mp, const float* alpha, float* ot) {
  if constexpr (SIZE >= 1) {
    if (count == SIZE) return values_tile<SIZE, NV>(value, value_stride, n_block, st, mp, alpha, ot);
    values_tiles<NV, SIZE - 1>(count, value, value_stride, n_block, st, mp, alpha, ot);
  }
}

// ---------------------------------------------------------------- one task

struct Workspace {
  std::vector<float> qt, st, ot, row_max, row_sum, alpha, entropy, mass_weight;
  std::vector<int32_t> position, mass_lanes;
  std::vector<int64_t> mask_row;
  std::vector<int64_t> key_index;           // pooled slots: the task's head's keys, in slot order
  std::vector<float> own_keys, own_values;  // ... gathered contiguous for the many-rows tiles
  std::vector<float> key_block, value_block;  // quantized: one key block's keys / values, dequantized
  // quantized decode tiles, per key group met in the tile: each row's queries times the group's scales, and the
  // rows' queries . its zeros; group_stamp[g] == tile_stamp when group g's are this tile's (a tile computes a
  // group's once however its keys interleave with other groups' in the slots).
  std::vector<float> query_scales, query_zeros;
  std::vector<int64_t> group_stamp;
  std::vector<float> zero_shares;  // quantized values: each row's sum of weight x zero per value group
  int64_t tile_stamp = 0;
};

// A vector of rows [m0, m0 + NV * LANES) at a time, as two or one vectors.
template <typename Body>
inline void for_panels(int64_t first, int64_t mp, Body body) {
  int64_t m0 = first;
  for (; m0 + 2 * LANES <= mp; m0 += 2 * LANES) body(m0, std::integral_constant<int, 2>{});
  if (m0 < mp) body(m0, std::integral_constant<int, 1>{});
}

class Task {
 public:
  Task(const AttentionProblem& p, const AttentionTask& t, Workspace& w)
      : p_(p), t_(t), w_(w), R(p.group), D(p.dim), N(p.n_keys), S(p.n_queries) {
    M = (t.last_query - t.first_query) * R;
    mp = (M + LANES - 1) / LANES * LANES;
    key_end = p.causal ? N - S + t.last_query : N;
    first_position = N - S + t.first_query;
    const int64_t key_head = p.key_heads != nullptr ? 0 : t.head;  // pooled slots share one head axis
    keys = p.keys + t.batch * p.key_strides[0] + key_head * p.key_strides[1];
    key_stride = p.key_strides[2];
    if (p.values != nullptr) {
      values = p.values + t.batch * p.value_strides[0] + key_head * p.value_strides[1];
      value_stride = p.value_strides[2];
    }
    if (p.quantized.bits != 0) {
      const QuantizedKeysValues& q = p.quantized;
      quantized = q.count;
      code_bytes = D * q.bits / 8;
      key_codes = q.key_codes + t.batch * q.key_code_strides[0] + t.head * q.key_code_strides[1];
      key_code_stride = q.key_code_strides[2];
      const int64_t scales_at = t.batch * q.key_scale_strides[0] + t.head * q.key_scale_strides[1];
      key_scales = q.key_scales + scales_at;
      key_zeros = q.key_zeros + scales_at;
      key_scale_stride = q.key_scale_strides[2];
      key_groups = q.key_groups + t.batch * q.key_group_strides[0] + t.head * q.key_group_strides[1];
      if (q.value_codes != nullptr) {
        value_codes = q.value_codes + t.batch * q.value_code_strides[0] + t.head * q.value_code_strides[1];
        value_code_stride = q.value_code_strides[2];
        const int64_t at = t.batch * q.value_scale_strides[0] + t.head * q.value_scale_strides[1];
        value_scales = q.value_scales + at;
        value_zeros = q.value_zeros + at;
        value_scale_stride = q.value_scale_strides[2];
      }
      w.key_block.resize(KEY_BLOCK * D);
      w.value_block.resize(KEY_BLOCK * D);
    }
    if (p.key_heads != nullptr) {  // this head's slots only (never causal: decode steps and masked calls)
      w.key_index.clear();
      for (int64_t j = 0; j < N; ++j)
        if (p.key_heads[j] == t.head) w.key_index.push_back(j);
      index = w.key_index.data();
      row_index = index;
      key_end = static_cast<int64_t>(w.key_index.size());
    }
  }

  void run(ScoreSums& sums) {
    if (2 * M <= LANES) return few_rows<LANES / 2>(sums);
    if (index != nullptr) gather_own_slots();
    const int64_t first_scored = std::min(p_.score_from, p_.entropy_from);
    const int64_t scored_row = std::max<int64_t>(0, (first_scored - t_.first_query) * R);
    // without values only the scored rows matter; their panels start at a whole vector
    const int64_t first_row = p_.values == nullptr ? scored_row / LANES * LANES : 0;
    prepare();
    if (p_.values != nullptr) std::fill(w_.ot.begin(), w_.ot.end(), 0.0f);
    for (int64_t k0 = 0; k0 < key_end; k0 += KEY_BLOCK) {
      const int64_t n_block = std::min<int64_t>(KEY_BLOCK, key_end - k0);
      load_keys(k0, n_block);
      block_scores(k0, n_block, first_row);
      online_softmax(k0, n_block, first_row);
      if (p_.values != nullptr) {
        load_values(k0, n_block);
        block_values(k0, n_block);
      }
    }
    if (p_.output != nullptr) write_output();
    if (scored_row < M) score(scored_row / LANES * LANES, sums);
  }

 private:
  const AttentionProblem& p_;
  const AttentionTask& t_;
  Workspace& w_;
  const int64_t R, D, N, S;
  int64_t M = 0, mp = 0, key_end = 0, first_position = 0;
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t key_stride = 0, value_stride = 0;
  const int64_t* index = nullptr;      // pooled slots: the task's j-th key is slot index[j] (mask, key mass)
  const int64_t* row_index = nullptr;  // ... and row row_index[j] of keys/values (null once gathered)
  // Quantized keys and values (p_.quantized): the first `quantized` keys come from codes, a key block at a time
  // dequantized into the workspace (or, past them, read in place from the float window, key j at row j - quantized).
  int64_t quantized = -1;  // -1: every key is a float row
  int64_t code_bytes = 0;
  const uint8_t* key_codes = nullptr;
  const uint8_t* value_codes = nullptr;
  const float *key_scales = nullptr, *key_zeros = nullptr, *value_scales = nullptr, *value_zeros = nullptr;
  const int32_t* key_groups = nullptr;
  int64_t key_code_stride = 0, key_scale_stride = 0, value_code_stride = 0, value_scale_stride = 0;
  // The key (value) block in force: key j at key_block + (j - key_block_first) * key_block_stride (null: none)
  const float* key_block = nullptr;
  const float* value_block = nullptr;
  int64_t key_block_first = 0, key_block_stride = 0, value_block_first = 0, value_block_stride = 0;

  int64_t query_of(int64_t row) const { return t_.first_query + row / R; }
  // 1 / a row's sum of weights, 0 for a row that sees no key (sum 0: it outputs 0, adds no mass), NaN for a NaN row.
  static float weight_of(float row_sum) { return row_sum == 0.0f ? 0.0f : 1.0f / row_sum; }
  int64_t key_at(int64_t j) const { return index != nullptr ? index[j] : j; }
  const float* key_row(int64_t j) const {
    if (key_block != nullptr) return key_block + (j - key_block_first) * key_block_stride;
    return keys + (row_index != nullptr ? row_index[j] : j) * key_stride;
  }
  const float* value_row(int64_t j) const {
    if (value_block != nullptr) return value_block + (j - value_block_first) * value_block_stride;
    return values + (row_index != nullptr ? row_index[j] : j) * value_stride;
  }
  int64_t key_row_stride() const { return key_block != nullptr ? key_block_stride : key_stride; }
  int64_t value_row_stride() const { return value_block != nullptr ? value_block_stride : value_stride; }

  // The keys [k0, k0 + n) made readable by key_row: quantized ones dequantized into the workspace, float ones
  // read in place (a block past the quantized keys) or copied after them. Nothing to do without quantized keys.
  void load_keys(int64_t k0, int64_t n) {
    if (quantized < 0) return;
    load_block(k0, n, keys, key_stride, w_.key_block.data(), key_block, key_block_first, key_block_stride,
               [&](int64_t j, float* out) { dequantize_key(j, out); });
  }
  void load_values(int64_t k0, int64_t n) {
    if (quantized < 0) return;
    load_block(k0, n, values, value_stride, w_.value_block.data(), value_block, value_block_first,
               value_block_stride, [&](int64_t j, float* out) { dequantize_value(j, out); });
  }
  template <typename Dequantize>
  void load_block(int64_t k0, int64_t n, const float* floats, int64_t float_stride, float* scratch,
                  const float*& block, int64_t& first, int64_t& stride, Dequantize dequantize) {
    first = k0;
    if (k0 >= quantized) {
      block = floats + (k0 - quantized) * float_stride;
      stride = float_stride;
      return;
    }
    for (int64_t j = k0; j < k0 + n; ++j) {
      if (j < quantized) {
        dequantize(j, scratch + (j - k0) * D);
      } else {
        std::memcpy(scratch + (j - k0) * D, floats + (j - quantized) * float_stride, D * sizeof(float));
      }
    }
    block = scratch;
    stride = D;
  }
  // Key j (< quantized): code * scale + zero per feature, the scales of the key's token group.
  void dequantize_key(int64_t j, float* out) const {
    const uint8_t* code = key_codes + j * key_code_stride;
    const int64_t group = key_groups[j];
    const float* scale = key_scales + group * key_scale_stride;
    const float* zero = key_zeros + group * key_scale_stride;
    if (code_bytes == D) {
      int64_t d = 0;
      for (; d + LANES <= D; d += LANES) store(out + d, codes_at(code + d) * load(scale + d) + load(zero + d));
      for (; d < D; ++d) out[d] = static_cast<float>(code[d]) * scale[d] + zero[d];
    } else {
      for (int64_t i = 0; i < D / 2; ++i) {
        out[2 * i] = static_cast<float>(code[i] & 15) * scale[2 * i] + zero[2 * i];
        out[2 * i + 1] = static_cast<float>(code[i] >> 4) * scale[2 * i + 1] + zero[2 * i + 1];
      }
    }
  }
  // Value j (< quantized): code * scale + zero, one scale per group of value_group features of the token.
  void dequantize_value(int64_t j, float* out) const {
    const uint8_t* code = value_codes + j * value_code_stride;
    const float* scale = value_scales + j * value_scale_stride;
    const float* zero = value_zeros + j * value_scale_stride;
    const int64_t group = p_.quantized.value_group;
    for (int64_t g = 0; g < D / group; ++g) {
      const float s = scale[g], z = zero[g];
      float* to = out + g * group;
      if (code_bytes == D) {
        const uint8_t* c = code + g * group;
        int64_t d = 0;
        for (; d + LANES <= group; d += LANES) store(to + d, codes_at(c + d) * s + z);
        for (; d < group; ++d) to[d] = static_cast<float>(c[d]) * s + z;
      } else {
        const uint8_t* c = code + g * group / 2;
        for (int64_t i = 0; i < group / 2; ++i) {
          to[2 * i] = static_cast<float>(c[i] & 15) * s + z;
          to[2 * i + 1] = static_cast<float>(c[i] >> 4) * s + z;
        }
      }
    }
  }

  // The task's head's slots copied together, so the many-rows tiles read keys and values in place.
  void gather_own_slots() {
    w_.own_keys.resize(key_end * D);
    for (int64_t j = 0; j < key_end; ++j) std::memcpy(w_.own_keys.data() + j * D, key_row(j), D * sizeof(float));
    if (values != nullptr) {
      w_.own_values.resize(key_end * D);
      for (int64_t j = 0; j < key_end; ++j)
        std::memcpy(w_.own_values.data() + j * D, value_row(j), D * sizeof(float));
      values = w_.own_values.data();
      value_stride = D;
    }
    keys = w_.own_keys.data();
    key_stride = D;
    row_index = nullptr;
  }

  void prepare() {
    w_.qt.assign(D * mp, 0.0f);
    w_.st.resize(KEY_BLOCK * mp);
    if (p_.values != nullptr) w_.ot.resize(D * mp);
    w_.row_max.assign(mp, NEG_INF);
    w_.row_sum.assign(mp, 0.0f);
    w_.alpha.assign(mp, 0.0f);
    w_.position.assign(mp, std::numeric_limits<int32_t>::max());  // padding rows see every key
    if (p_.mask != nullptr) w_.mask_row.resize(M);
    const int64_t* qs = p_.query_strides;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t query = query_of(m), head = t_.head * R + m % R;
      const float* q = p_.queries + t_.batch * qs[0] + head * qs[1] + query * qs[2];
      for (int64_t d = 0; d < D; ++d) w_.qt[d * mp + m] = q[d * qs[3]] * p_.scale;
      w_.position[m] = static_cast<int32_t>(N - S + query);
      if (p_.mask != nullptr) {
        const int64_t* ms = p_.mask_strides;
        w_.mask_row[m] = t_.batch * ms[0] + head * ms[1] + query * ms[2];
      }
    }
  }

  // St[0:n_block][first_row:] = the block's scores, masked.
  void block_scores(int64_t k0, int64_t n_block, int64_t first_row) {
    float* st = w_.st.data();
    for_panels(first_row, mp, [&](int64_t m0, auto nv) {
      constexpr int NV = decltype(nv)::value;
      for (int64_t j0 = 0; j0 < n_block; j0 += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, n_block - j0));
        scores_tiles<NV>(count, key_row(k0 + j0), key_row_stride(), w_.qt.data() + m0, mp, D,
                         st + j0 * mp + m0);
      }
    });
    if (p_.causal && k0 + n_block - 1 > first_position) {  // the block reaches past some row's position
      for (int64_t m0 = first_row; m0 < mp; m0 += LANES) {
        const Ints position = load_ints(w_.position.data() + m0);
        for (int64_t j = 0; j < n_block; ++j) {
          float* s = st + j * mp + m0;
          store(s, splat_int(static_cast<int32_t>(k0 + j)) > position ? splat(NEG_INF) : load(s));
        }
      }
    }
    if (p_.mask != nullptr) apply_mask(k0, n_block, first_row);
  }

  void apply_mask(int64_t k0, int64_t n_block, int64_t first_row) {
    float* st = w_.st.data();
    const int64_t key_step = p_.mask_strides[3];
    for (int64_t m = first_row; m < M; ++m) {
      const int64_t base = w_.mask_row[m];
      if (p_.mask_is_bool) {
        const bool* allowed = static_cast<const bool*>(p_.mask) + base;
        for (int64_t j = 0; j < n_block; ++j)
          if (!allowed[key_at(k0 + j) * key_step]) st[j * mp + m] = NEG_INF;
      } else {
        const float* add = static_cast<const float*>(p_.mask) + base;
        for (int64_t j = 0; j < n_block; ++j) st[j * mp + m] += add[key_at(k0 + j) * key_step];
      }
    }
  }

  // Row maxima and sums move on; St becomes exp(scores - new maximum), alpha the old sums' factor.
  void online_softmax(int64_t, int64_t n_block, int64_t first_row) {
    float* st = w_.st.data();
    for (int64_t m0 = first_row; m0 < mp; m0 += LANES) {
      Floats block_max = splat(NEG_INF);
      for (int64_t j = 0; j < n_block; ++j) {
        const Floats s = load(st + j * mp + m0);
        block_max = s > block_max ? s : block_max;
      }
      const Floats old_max = load(w_.row_max.data() + m0);
      const Floats new_max = block_max > old_max ? block_max : old_max;
      const Floats shift = new_max == splat(NEG_INF) ? splat(0.0f) : new_max;  // a row masked so far stays at 0
      const Floats alpha = exp_vector(old_max - shift);
      Floats sum = Floats{};
      for (int64_t j = 0; j < n_block; ++j) {
        const Floats w = exp_vector(load(st + j * mp + m0) - shift);
        store(st + j * mp + m0, w);
        sum += w;
      }
      store(w_.row_sum.data() + m0, load(w_.row_sum.data() + m0) * alpha + sum);
      store(w_.row_max.data() + m0, new_max);
      store(w_.alpha.data() + m0, alpha);
    }
  }

  void block_values(int64_t k0, int64_t n_block) {
    const float* block = value_row(k0);
    const int64_t stride = value_row_stride();
    for_panels(0, mp, [&](int64_t m0, auto nv) {
      constexpr int NV = decltype(nv)::value;
      for (int64_t f0 = 0; f0 < D; f0 += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, D - f0));
        values_tiles<NV>(count, block + f0, stride, n_block, w_.st.data() + m0, mp,
                         w_.alpha.data() + m0, w_.ot.data() + f0 * mp + m0);
      }
    });
  }

  void write_output() {
    const int64_t heads = p_.task_heads * R;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t head = t_.head * R + m % R;
      float* out = p_.output + ((t_.batch * heads + head) * S + query_of(m)) * D;
      const float inverse = weight_of(w_.row_sum[m]);
      for (int64_t d = 0; d < D; ++d) out[d] = w_.ot[d * mp + m] * inverse;
    }
  }

  // The second pass over the scored rows [first_row, M): exact probabilities with each row's final
  // maximum and sum, summed into the key mass (rows from score_from) and the entropy (from entropy_from).
  void score(int64_t first_row, ScoreSums& sums) {
    AddSeconds timed(sums.scoring_seconds);
    const bool mass = p_.score_from < S && sums.key_mass != nullptr;
    const bool entropy = p_.entropy_from < S;
    w_.mass_weight.assign(mp, 0.0f);
    w_.mass_lanes.assign(mp, 0);  // all bits set on a scored row's lane: other rows add exactly 0, even NaN rows
    w_.entropy.assign(mp, 0.0f);
    for (int64_t m = first_row; m < M; ++m)
      if (query_of(m) >= p_.score_from) {
        w_.mass_weight[m] = weight_of(w_.row_sum[m]);
        w_.mass_lanes[m] = -1;
      }
    float* key_mass = mass ? sums.key_mass : nullptr;
    float* st = w_.st.data();
    for (int64_t k0 = 0; k0 < key_end; k0 += KEY_BLOCK) {
      const int64_t n_block = std::min<int64_t>(KEY_BLOCK, key_end - k0);
      load_keys(k0, n_block);
      block_scores(k0, n_block, first_row);
      for (int64_t m0 = first_row; m0 < mp; m0 += LANES) {
        const Floats row_max = load(w_.row_max.data() + m0);
        const Floats shift = row_max == splat(NEG_INF) ? splat(0.0f) : row_max;
        Floats entropy_sum = load(w_.entropy.data() + m0);
        for (int64_t j = 0; j < n_block; ++j) {
          const Floats x = load(st + j * mp + m0) - shift;
          const Floats w = exp_vector(x);
          store(st + j * mp + m0, w);
          if (entropy) entropy_sum += w * (x > splat(-88.0f) ? x : splat(-88.0f));  // masked: 0 * -88
        }
        store(w_.entropy.data() + m0, entropy_sum);
      }
      if (!mass) continue;
      for (int64_t j = 0; j < n_block; ++j) {
        Floats total = Floats{};
        for (int64_t m0 = first_row; m0 < mp; m0 += LANES)
          total += only(load_ints(w_.mass_lanes.data() + m0), load(st + j * mp + m0) * load(w_.mass_weight.data() + m0));
        key_mass[key_at(k0 + j)] += lane_sum(total);
      }
    }
    if (!entropy) return;
    for (int64_t m = first_row; m < M; ++m) {
      if (query_of(m) < p_.entropy_from || w_.row_sum[m] == 0.0f) continue;  // a row that sees no key: no entropy
      const double row_sum = w_.row_sum[m];
      sums.entropy += std::log(row_sum) - w_.entropy[m] / row_sum;
    }
  }

  // ------------------------------------------------ few rows (decode steps): keys along the lanes

  // Under half a vector of rows, rows on the lanes would leave most of them empty; here each row is
  // held in full (Q [ROWS][dp], S [ROWS][KEY_BLOCK], O [ROWS][dp]) and a key's or value's features
  // go along the lanes: scores are dot products, the output rows accumulate value rows.
  template <int ROWS>
  void few_rows(ScoreSums& sums) {
    if constexpr (ROWS > 1) {
      if (M < ROWS) return few_rows<ROWS - 1>(sums);
    }
    const int64_t dp = (D + LANES - 1) / LANES * LANES;
    ++w_.tile_stamp;  // the key groups' query products of an earlier tile are not this one's
    w_.qt.assign(ROWS * dp, 0.0f);
    w_.st.assign(ROWS * KEY_BLOCK, NEG_INF);
    w_.ot.assign(ROWS * dp, 0.0f);
    float row_max[ROWS], row_sum[ROWS], alpha[ROWS];
    int64_t position[ROWS], mask_row[ROWS] = {};
    const int64_t* qs = p_.query_strides;
    for (int m = 0; m < ROWS; ++m) {
      const int64_t query = query_of(m), head = t_.head * R + m % R;
      const float* q = p_.queries + t_.batch * qs[0] + head * qs[1] + query * qs[2];
      for (int64_t d = 0; d < D; ++d) w_.qt[m * dp + d] = q[d * qs[3]] * p_.scale;
      position[m] = N - S + query;
      if (p_.mask != nullptr) {
        const int64_t* ms = p_.mask_strides;
        mask_row[m] = t_.batch * ms[0] + head * ms[1] + query * ms[2];
      }
      row_max[m] = NEG_INF;
      row_sum[m] = 0.0f;
    }
    for (int64_t k0 = 0; k0 < key_end; k0 += KEY_BLOCK) {
      const int64_t n_block = std::min<int64_t>(KEY_BLOCK, key_end - k0);
      few_block_scores<ROWS>(k0, n_block, dp, position, mask_row);
      const int64_t padded = (n_block + LANES - 1) / LANES * LANES;  // scores past n_block stay -inf
      for (int m = 0; m < ROWS; ++m) {
        float* s = w_.st.data() + m * KEY_BLOCK;
        Floats block_max = splat(NEG_INF);
        for (int64_t j = 0; j < padded; j += LANES) {
          const Floats v = load(s + j);
          block_max = v > block_max ? v : block_max;
        }
        const float new_max = std::max(row_max[m], lane_max(block_max));
        const float shift = new_max == NEG_INF ? 0.0f : new_max;
        alpha[m] = exp_vector(splat(row_max[m] - shift))[0];
        Floats sum = Floats{};
        for (int64_t j = 0; j < padded; j += LANES) {
          const Floats w = exp_vector(load(s + j) - shift);
          store(s + j, w);
          sum += w;
        }
        row_sum[m] = row_sum[m] * alpha[m] + lane_sum(sum);
        row_max[m] = new_max;
      }
      if (p_.values != nullptr) few_block_values<ROWS>(k0, n_block, dp, alpha);
    }
    if (p_.output != nullptr) {
      const int64_t heads = p_.task_heads * R;
      for (int m = 0; m < ROWS; ++m) {
        float* out = p_.output + ((t_.batch * heads + t_.head * R + m % R) * S + query_of(m)) * D;
        const float inverse = weight_of(row_sum[m]);
        for (int64_t d = 0; d < D; ++d) out[d] = w_.ot[m * dp + d] * inverse;
      }
    }
    few_score<ROWS>(sums, dp, position, mask_row, row_max, row_sum);
  }

  // The few rows' scores of the key block [k0, k0 + n_block): a block all of quantized keys straight from their
  // codes (few_scores_codes), any other after load_keys (float rows in place, a mixed block dequantized).
  template <int ROWS>
  void few_block_scores(int64_t k0, int64_t n_block, int64_t dp, const int64_t* position, const int64_t* mask_row) {
    if (quantized >= 0 && k0 + n_block <= quantized) {
      few_scores_codes<ROWS>(k0, n_block, dp);
      few_mask<ROWS>(k0, n_block, position, mask_row);
      return;
    }
    load_keys(k0, n_block);
    few_scores<ROWS>(k0, n_block, dp, position, mask_row);
  }

  template <int ROWS>
  void few_block_values(int64_t k0, int64_t n_block, int64_t dp, const float* alpha) {
    const int64_t group = p_.quantized.value_group;
    if (quantized >= 0 && k0 + n_block <= quantized && code_bytes == D && D % LANES == 0 && group % LANES == 0) {
      few_values_codes<ROWS>(k0, n_block, dp, alpha);
      return;
    }
    if (quantized >= 0 && k0 + n_block <= quantized && code_bytes * 2 == D && D % (2 * LANES) == 0 &&
        group % (2 * LANES) == 0) {
      few_values_nibbles<ROWS>(k0, n_block, dp, alpha);
      return;
    }
    load_values(k0, n_block);
    few_values<ROWS>(k0, n_block, dp, alpha);
  }

  // Key group `group`'s QS (ROWS x dp) and qz (ROWS), computed the first time the tile meets the group.
  template <int ROWS>
  const float* group_query_products(int32_t group, int64_t dp) {
    const size_t needed = static_cast<size_t>(group) + 1;
    if (w_.group_stamp.size() < needed) w_.group_stamp.resize(needed, -1);
    if (w_.query_scales.size() < needed * ROWS * dp) w_.query_scales.resize(needed * ROWS * dp);
    if (w_.query_zeros.size() < needed * ROWS) w_.query_zeros.resize(needed * ROWS);
    float* products = w_.query_scales.data() + group * ROWS * dp;
    if (w_.group_stamp[group] == w_.tile_stamp) return products;
    w_.group_stamp[group] = w_.tile_stamp;
    const float* q = w_.qt.data();
    const float* scale = key_scales + group * key_scale_stride;
    const float* zero = key_zeros + group * key_scale_stride;
    const int64_t half = D / 2;
    for (int m = 0; m < ROWS; ++m) {
      const float* row = q + m * dp;
      float* out = products + m * dp;
      float bias = 0.0f;
      for (int64_t d = 0; d < D; ++d) bias += row[d] * zero[d];
      w_.query_zeros[group * ROWS + m] = bias;
      if (code_bytes == D) {
        for (int64_t d = 0; d < D; ++d) out[d] = row[d] * scale[d];
      } else {
        for (int64_t i = 0; i < half; ++i) {
          out[i] = row[2 * i] * scale[2 * i];
          out[half + i] = row[2 * i + 1] * scale[2 * i + 1];
        }
      }
    }
    return products;
  }

  // S[m][j] for quantized keys j of [k0, k0 + n): with QS = q * the group's scales and qz = q . its zeros,
  // q . (code * scale + zero) = QS . code + qz, so the codes are read once and never dequantized. At 4 bits QS
  // holds the even features' products, then the odd ones', as the low and high nibbles come.
  template <int ROWS>
  void few_scores_codes(int64_t k0, int64_t n, int64_t dp) {
    float* s = w_.st.data();
    const float* qs = nullptr;
    const float* qz = nullptr;
    const int64_t half = D / 2;
    int32_t current = -1;
    for (int64_t j = k0; j < k0 + n; ++j) {
      const int32_t group = key_groups[j];
      if (group != current) {
        current = group;
        qs = group_query_products<ROWS>(group, dp);
        qz = w_.query_zeros.data() + group * ROWS;
      }
      const uint8_t* code = key_codes + j * key_code_stride;
      Floats acc[ROWS];
      float tail[ROWS];
      for (int m = 0; m < ROWS; ++m) acc[m] = Floats{}, tail[m] = 0.0f;
      if (code_bytes == D) {
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) {
          const Floats c = codes_at(code + d);
          for (int m = 0; m < ROWS; ++m) acc[m] += load(qs + m * dp + d) * c;
        }
        for (; d < D; ++d)
          for (int m = 0; m < ROWS; ++m) tail[m] += qs[m * dp + d] * static_cast<float>(code[d]);
      } else {
        int64_t i = 0;
        for (; i + LANES <= half; i += LANES) {
          Floats low, high;
          nibbles_to_floats(code + i, low, high);
          for (int m = 0; m < ROWS; ++m) acc[m] += load(qs + m * dp + i) * low + load(qs + m * dp + half + i) * high;
        }
        for (; i < half; ++i)
          for (int m = 0; m < ROWS; ++m)
            tail[m] += qs[m * dp + i] * static_cast<float>(code[i] & 15) +
                       qs[m * dp + half + i] * static_cast<float>(code[i] >> 4);
      }
      for (int m = 0; m < ROWS; ++m) s[m * KEY_BLOCK + (j - k0)] = lane_sum(acc[m]) + tail[m] + qz[m];
    }
  }

  // O[m] = O[m] * alpha[m] + sum_j S[m][j] V[j] for quantized 8-bit values j of [k0, k0 + n), from their codes:
  // S * (code * scale + zero) = (S * scale) * code + S * zero, the zeros' share added once per value group.
  template <int ROWS>
  void few_values_codes(int64_t k0, int64_t n, int64_t dp, const float* alpha) {
    float* o = w_.ot.data();
    const float* p = w_.st.data();
    const int64_t group = p_.quantized.value_group;
    scale_rows<ROWS>(dp, alpha);
    for (int64_t d0 = 0; d0 < D; d0 += LANES) {
      const int64_t g = d0 / group;
      Floats acc[ROWS];
      for (int m = 0; m < ROWS; ++m) acc[m] = load(o + m * dp + d0);
      for (int64_t j = k0; j < k0 + n; ++j) {
        const float scale = value_scales[j * value_scale_stride + g];
        const Floats c = codes_at(value_codes + j * value_code_stride + d0);
        for (int m = 0; m < ROWS; ++m) acc[m] += splat(p[m * KEY_BLOCK + (j - k0)] * scale) * c;
      }
      for (int m = 0; m < ROWS; ++m) store(o + m * dp + d0, acc[m]);
    }
    add_zero_shares<ROWS>(k0, n, dp);
  }

  // O[m] *= alpha[m]: the running output rescaled to the block's new row maxima.
  template <int ROWS>
  void scale_rows(int64_t dp, const float* alpha) {
    float* o = w_.ot.data();
    for (int m = 0; m < ROWS; ++m)
      for (int64_t d = 0; d < dp; d += LANES) store(o + m * dp + d, load(o + m * dp + d) * alpha[m]);
  }

  // O[m] += sum_j S[m][j] * zero_j per value group, over the quantized values [k0, k0 + n): the zeros' share of
  // S * (code * scale + zero), added once per group of features.
  template <int ROWS>
  void add_zero_shares(int64_t k0, int64_t n, int64_t dp) {
    float* o = w_.ot.data();
    const float* p = w_.st.data();
    const int64_t group = p_.quantized.value_group, groups = D / group;
    w_.zero_shares.assign(ROWS * groups, 0.0f);  // each row's sum of S * zero per value group
    float* share = w_.zero_shares.data();
    for (int64_t j = k0; j < k0 + n; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const float zero = value_zeros[j * value_scale_stride + g];
        for (int m = 0; m < ROWS; ++m) share[m * groups + g] += p[m * KEY_BLOCK + (j - k0)] * zero;
      }
    for (int m = 0; m < ROWS; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const Floats add = splat(share[m * groups + g]);
        for (int64_t d = g * group; d < (g + 1) * group; d += LANES) store(o + m * dp + d, load(o + m * dp + d) + add);
      }
  }

  // few_values_codes for 4-bit values: a byte holds features 2i (low nibble) and 2i + 1 (high), so each vector of
  // bytes feeds an accumulator of even features and one of odd ones, interleaved into the output at the end.
  template <int ROWS>
  void few_values_nibbles(int64_t k0, int64_t n, int64_t dp, const float* alpha) {
    float* o = w_.ot.data();
    const float* p = w_.st.data();
    const int64_t group = p_.quantized.value_group;
    scale_rows<ROWS>(dp, alpha);
    for (int64_t i0 = 0; i0 < D / 2; i0 += LANES) {  // bytes i0 .. i0 + LANES: features 2 * i0 .. 2 * i0 + 2 * LANES
      const int64_t g = 2 * i0 / group;
      Floats even[ROWS], odd[ROWS];
      for (int m = 0; m < ROWS; ++m) even[m] = odd[m] = Floats{};
      for (int64_t j = k0; j < k0 + n; ++j) {
        const float scale = value_scales[j * value_scale_stride + g];
        Floats low, high;
        nibbles_to_floats(value_codes + j * value_code_stride + i0, low, high);
        for (int m = 0; m < ROWS; ++m) {
          const Floats weight = splat(p[m * KEY_BLOCK + (j - k0)] * scale);
          even[m] += weight * low;
          odd[m] += weight * high;
        }
      }
      for (int m = 0; m < ROWS; ++m)
        for (int k = 0; k < LANES; ++k) {
          o[m * dp + 2 * (i0 + k)] += even[m][k];
          o[m * dp + 2 * (i0 + k) + 1] += odd[m][k];
        }
    }
    add_zero_shares<ROWS>(k0, n, dp);
  }

  // S[m][0:n_block] = the block's scores (dot products, two keys at a time), masked.
  template <int ROWS>
  void few_scores(int64_t k0, int64_t n_block, int64_t dp, const int64_t* position, const int64_t* mask_row) {
    const int64_t full = D / LANES * LANES;
    const float* q = w_.qt.data();
    float* s = w_.st.data();
    int64_t j = 0;
    for (; j + 2 <= n_block; j += 2) {
      const float* k = key_row(k0 + j);
      const float* k_next = key_row(k0 + j + 1);
      Floats first[ROWS], second[ROWS];
      for (int m = 0; m < ROWS; ++m) first[m] = second[m] = Floats{};
      for (int64_t d = 0; d < full; d += LANES) {
        const Floats k_first = load(k + d), k_second = load(k_next + d);
        for (int m = 0; m < ROWS; ++m) {
          const Floats qv = load(q + m * dp + d);
          first[m] += qv * k_first;
          second[m] += qv * k_second;
        }
      }
      for (int m = 0; m < ROWS; ++m) {
        float a = lane_sum(first[m]), b = lane_sum(second[m]);
        for (int64_t d = full; d < D; ++d) {
          a += q[m * dp + d] * k[d];
          b += q[m * dp + d] * k_next[d];
        }
        s[m * KEY_BLOCK + j] = a;
        s[m * KEY_BLOCK + j + 1] = b;
      }
    }
    for (; j < n_block; ++j) {
      const float* k = key_row(k0 + j);
      for (int m = 0; m < ROWS; ++m) {
        Floats acc = Floats{};
        for (int64_t d = 0; d < full; d += LANES) acc += load(q + m * dp + d) * load(k + d);
        float a = lane_sum(acc);
        for (int64_t d = full; d < D; ++d) a += q[m * dp + d] * k[d];
        s[m * KEY_BLOCK + j] = a;
      }
    }
    few_mask<ROWS>(k0, n_block, position, mask_row);
  }

  // The block's scores past n_block (to a whole vector) at -inf, and the causal mask and the mask array applied.
  template <int ROWS>
  void few_mask(int64_t k0, int64_t n_block, const int64_t* position, const int64_t* mask_row) {
    float* s = w_.st.data();
    const int64_t padded = (n_block + LANES - 1) / LANES * LANES;
    for (int m = 0; m < ROWS; ++m) {
      float* row = s + m * KEY_BLOCK;
      for (int64_t i = n_block; i < padded; ++i) row[i] = NEG_INF;
      if (p_.causal)
        for (int64_t i = std::max<int64_t>(0, position[m] + 1 - k0); i < n_block; ++i) row[i] = NEG_INF;
      if (p_.mask != nullptr) {
        const int64_t step = p_.mask_strides[3], base = mask_row[m];
        if (p_.mask_is_bool) {
          const bool* allowed = static_cast<const bool*>(p_.mask) + base;
          for (int64_t i = 0; i < n_block; ++i)
            if (!allowed[key_at(k0 + i) * step]) row[i] = NEG_INF;
        } else {
          const float* add = static_cast<const float*>(p_.mask) + base;
          for (int64_t i = 0; i < n_block; ++i) row[i] += add[key_at(k0 + i) * step];
        }
      }
    }
  }

  // O[m] = O[m] * alpha[m] + sum_j S[m][j] V[j], CHUNK vectors of features at a time.
  template <int ROWS>
  void few_values(int64_t k0, int64_t n_block, int64_t dp, const float* alpha) {
    constexpr int CHUNK = ROWS <= 3 ? 4 : (ROWS <= 6 ? 2 : 1);  // ROWS x CHUNK accumulators
    float* o = w_.ot.data();
    for (int m = 0; m < ROWS; ++m)
      for (int64_t d = 0; d < dp; d += LANES) store(o + m * dp + d, load(o + m * dp + d) * alpha[m]);
    const int64_t full = D / LANES * LANES;
    int64_t d0 = 0;
    for (; d0 + CHUNK * LANES <= full; d0 += CHUNK * LANES) few_values_chunk<ROWS, CHUNK>(k0, n_block, dp, d0);
    for (; d0 + LANES <= full; d0 += LANES) few_values_chunk<ROWS, 1>(k0, n_block, dp, d0);
    for (int m = 0; m < ROWS; ++m)
      for (int64_t d = full; d < D; ++d) {
        float acc = o[m * dp + d];
        for (int64_t j = 0; j < n_block; ++j) acc += w_.st[m * KEY_BLOCK + j] * value_row(k0 + j)[d];
        o[m * dp + d] = acc;
      }
  }

  template <int ROWS, int CHUNK>
  void few_values_chunk(int64_t k0, int64_t n_block, int64_t dp, int64_t d0) {
    float* o = w_.ot.data();
    const float* p = w_.st.data();
    Floats acc[ROWS][CHUNK];
    for (int m = 0; m < ROWS; ++m)
      for (int c = 0; c < CHUNK; ++c) acc[m][c] = load(o + m * dp + d0 + c * LANES);
    for (int64_t j = 0; j < n_block; ++j) {
      Floats v[CHUNK];
      const float* value = value_row(k0 + j);
      for (int c = 0; c < CHUNK; ++c) v[c] = load(value + d0 + c * LANES);
      for (int m = 0; m < ROWS; ++m) {
        const Floats weight = splat(p[m * KEY_BLOCK + j]);
        for (int c = 0; c < CHUNK; ++c) acc[m][c] += weight * v[c];
      }
    }
    for (int m = 0; m < ROWS; ++m)
      for (int c = 0; c < CHUNK; ++c) store(o + m * dp + d0 + c * LANES, acc[m][c]);
  }

  // The scoring pass of the few rows, as `score` does for many.
  template <int ROWS>
  void few_score(ScoreSums& sums, int64_t dp, const int64_t* position, const int64_t* mask_row,
                 const float* row_max, const float* row_sum) {
    AddSeconds timed(sums.scoring_seconds);
    bool scored = false, any = false;
    bool row_scored[ROWS];
    float weight[ROWS];
    for (int m = 0; m < ROWS; ++m) {
      row_scored[m] = query_of(m) >= p_.score_from;
      weight[m] = row_scored[m] ? weight_of(row_sum[m]) : 0.0f;
      scored |= row_scored[m];
      any |= query_of(m) >= std::min(p_.score_from, p_.entropy_from);
    }
    if (!any) return;
    const bool mass = scored && sums.key_mass != nullptr;
    const bool entropy = p_.entropy_from < S;
    float* key_mass = mass ? sums.key_mass : nullptr;
    Floats entropy_sum[ROWS];
    for (int m = 0; m < ROWS; ++m) entropy_sum[m] = Floats{};
    float* s = w_.st.data();
    for (int64_t k0 = 0; k0 < key_end; k0 += KEY_BLOCK) {
      const int64_t n_block = std::min<int64_t>(KEY_BLOCK, key_end - k0);
      const int64_t padded = (n_block + LANES - 1) / LANES * LANES;
      few_block_scores<ROWS>(k0, n_block, dp, position, mask_row);
      for (int m = 0; m < ROWS; ++m) {
        const float shift = row_max[m] == NEG_INF ? 0.0f : row_max[m];
        for (int64_t j = 0; j < padded; j += LANES) {
          const Floats x = load(s + m * KEY_BLOCK + j) - shift;
          const Floats w = exp_vector(x);
          store(s + m * KEY_BLOCK + j, w);
          entropy_sum[m] += w * (x > splat(-88.0f) ? x : splat(-88.0f));
        }
      }
      if (!mass) continue;
      for (int64_t j = 0; j < n_block; ++j) {
        float total = 0.0f;
        for (int m = 0; m < ROWS; ++m) total += row_scored[m] ? s[m * KEY_BLOCK + j] * weight[m] : 0.0f;
        key_mass[key_at(k0 + j)] += total;
      }
    }
    if (!entropy) return;
    for (int m = 0; m < ROWS; ++m) {
      if (query_of(m) < p_.entropy_from || row_sum[m] == 0.0f) continue;
      const double sum = row_sum[m];
      sums.entropy += std::log(sum) - lane_sum(entropy_sum[m]) / sum;
    }
  }
};

void run_task(const AttentionProblem& problem, const AttentionTask& task, ScoreSums& sums) {
  thread_local Workspace workspace;
  Task(problem, task, workspace).run(sums);
}

}  // namespace

const AttentionLoops attention_loops = {VELOX_NAME(VELOX_ISA), ROWS_PER_TASK, run_task};

}  // namespace velox::VELOX_ISA
