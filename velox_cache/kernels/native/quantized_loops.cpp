// The loops of Velox's quantized matmul, out = x @ dequantize(w).T over MLX's
// affine layout (4 or 8 bits, groups of 32, 64 or 128 values). CMake compiles
// this file once per instruction set (VELOX_ISA names the namespace) with FMA
// contraction allowed and -mfma on x86 sets.
//
// Each chunk of 2 * LANES values of a weight row is dequantized into two
// vectors of float32, q * scale + bias as one FMA (at 16-bit scales the
// product is exact, so the weight is the same float32 that mx.dequantize
// gives), then multiplied into up to MAX_ROWS rows of x at once, so that the
// unpacking is shared by the rows of a batch. At 4 bits a chunk's bytes hold
// its even values in their low nibbles and its odd values in their high ones:
// prepare_row reorders each row of x the same way once per call, and the
// nibbles never need to be interleaved. Each (row, output) has two vector
// accumulators over the row's chunks in order, then one lane sum: the same
// bits whichever rows share the block, the range or the thread.

#include <algorithm>
#include <cstring>
#include <vector>

#include "isa_vectors.h"
#include "quantized.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace velox::VELOX_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int MAX_ROWS = 8;  // 16 accumulators of 32 registers
#else
constexpr int MAX_ROWS = 4;  // 8 accumulators of 16 registers
#endif
constexpr int CHUNK = 2 * LANES;  // values per step: two vectors
constexpr int64_t GROUP_BLOCK = 64;  // groups whose scales and biases are converted to float32 at once
typedef uint8_t Bytes __attribute__((vector_size(LANES)));

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// LANES bytes, each widened to an int32 lane (by intrinsics where there are some: GCC lowers
// __builtin_convertvector of bytes to one scalar extraction per byte).
inline Ints load_bytes(const uint8_t* p) {
  Ints v;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__SSE2__)
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  const __m128i zero = _mm_setzero_si128();
  const __m128i wide = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
  std::memcpy(&v, &wide, sizeof v);
#else
  Bytes b;
  std::memcpy(&b, p, sizeof b);
  v = __builtin_convertvector(b, Ints);
#endif
  return v;
}
inline Floats to_floats(Ints v) { return __builtin_convertvector(v, Floats); }

// Pairwise, in a fixed order: lanes[i] += lanes[i + width] for width = LANES / 2, ..., 1 (by halves of the
// register where there are intrinsics: the same additions, so the same bits).
inline float lane_sum(Floats v) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512 all = (__m512)v;
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(all), _mm512_extractf32x8_ps(all, 1));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
#elif defined(__AVX__)
  const __m256 all = (__m256)v;
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
#else
  float lanes[LANES];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = LANES / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// lane_sum of eight vectors at once, the same additions in the same pairs (lanes i and i + 8, then i and i + 4 of
// those sums, i and i + 2, then 0 and 1), transposed so that each step adds the halves of two vectors in one
// instruction: the same bits as eight lane_sum calls.
inline void lane_sums8(const Floats (&v)[8], float* out) {
  __m512 level8[4];  // [a0..7 | b0..7]: a[i] + a[i + 8] for two vectors a, b
  for (int j = 0; j < 4; ++j) {
    const __m512 a = (__m512)v[2 * j], b = (__m512)v[2 * j + 1];
    level8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 level4[2];  // 128-bit blocks: the four sums i + (i + 4) of vectors 4j .. 4j + 3
  for (int j = 0; j < 2; ++j) {
    const __m512 x = level8[2 * j], y = level8[2 * j + 1];
    level4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // block k: [vector k: i + (i + 2) for i = 0, 1 | vector 4 + k: the same]
  const __m512 level2 = _mm512_add_ps(_mm512_shuffle_ps(level4[0], level4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(level4[0], level4[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // block k: [vector k's sum, vector 4 + k's sum, (the same again)]
  const __m512 level1 = _mm512_add_ps(_mm512_shuffle_ps(level2, level2, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(level2, level2, _MM_SHUFFLE(3, 1, 3, 1)));
  float lanes[16];
  _mm512_storeu_ps(lanes, level1);
  for (int k = 0; k < 4; ++k) {
    out[k] = lanes[4 * k];
    out[4 + k] = lanes[4 * k + 1];
  }
}
#endif

// IEEE half to float, exactly (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float magnitude;
  std::memcpy(&magnitude, &bits, sizeof magnitude);
  magnitude *= 0x1.0p112f;  // exponent bias 15 -> 127; a half subnormal becomes a float normal, exactly
  std::memcpy(&bits, &magnitude, sizeof bits);
  if (magnitude >= 65536.0f) bits |= 0xffu << 23;  // exponent 31: infinity or NaN
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// LANES halves to floats, exactly (as half_to_float, lane by lane).
typedef uint16_t Halves __attribute__((vector_size(2 * LANES)));
inline Floats halves_to_floats(const uint16_t* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Ints v = __builtin_convertvector(h, Ints);
  Ints bits = (v & 0x7fff) << 13;
  Floats magnitude;
  std::memcpy(&magnitude, &bits, sizeof magnitude);
  magnitude = magnitude * 0x1.0p112f;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= (magnitude >= 65536.0f) & (0xff << 23);
  bits |= (v & 0x8000) << 16;
  Floats f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// `count` scales (or biases) from index `first` on, as float32.
void load_scales(const void* p, int type, int64_t first, int64_t count, float* to) {
  if (type == SCALE_FLOAT32) {
    std::memcpy(to, static_cast<const float*>(p) + first, count * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(p) + first;
  if (type == SCALE_FLOAT16) {
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES) {
      const Floats f = halves_to_floats(h + i);
      std::memcpy(to + i, &f, sizeof f);
    }
    for (; i < count; ++i) to[i] = half_to_float(h[i]);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {  // bfloat16: the upper half of a float32
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(to + i, &bits, sizeof bits);
  }
}

void prepare_row(const float* x, float* to, int64_t n, int bits) {
  if (bits != 4) {
    std::memcpy(to, x, n * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < n; c += CHUNK)
    for (int i = 0; i < LANES; ++i) {
      to[c + i] = x[c + 2 * i];
      to[c + LANES + i] = x[c + 2 * i + 1];
    }
}

// Outputs [first, last) of the ROWS rows from `row` on.
template <int BITS, int ROWS>
void rows_block(const QuantizedProblem& p, int64_t row, int64_t first, int64_t last) {
  const int64_t k_total = p.in_features, group = p.group_size, groups = k_total / group;
  const int64_t row_bytes = k_total * BITS / 8;
  const float* x[ROWS];
  for (int r = 0; r < ROWS; ++r) x[r] = p.x + (row + r) * k_total;
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* w = p.weights + n * row_bytes;
    Floats even[ROWS], odd[ROWS];  // even: the chunks' first vectors, odd: their second
    for (int r = 0; r < ROWS; ++r) even[r] = odd[r] = Floats{};
    for (int64_t g0 = 0; g0 < groups; g0 += GROUP_BLOCK) {
      const int64_t count = std::min<int64_t>(GROUP_BLOCK, groups - g0);
      float scales[GROUP_BLOCK], biases[GROUP_BLOCK];
      load_scales(p.scales, p.scale_type, n * groups + g0, count, scales);
      load_scales(p.biases, p.scale_type, n * groups + g0, count, biases);
      for (int64_t g = 0; g < count; ++g) {
        const float scale = scales[g], bias = biases[g];
        for (int64_t k = (g0 + g) * group; k < (g0 + g + 1) * group; k += CHUNK) {
          Floats w0, w1;
          if constexpr (BITS == 4) {
            const Ints q = load_bytes(w + k / 2);
            w0 = to_floats(q & 15) * scale + bias;
            w1 = to_floats(q >> 4) * scale + bias;
          } else {
            w0 = to_floats(load_bytes(w + k)) * scale + bias;
            w1 = to_floats(load_bytes(w + k + LANES)) * scale + bias;
          }
          for (int r = 0; r < ROWS; ++r) {
            even[r] += w0 * load(x[r] + k);
            odd[r] += w1 * load(x[r] + k + LANES);
          }
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) p.output[(row + r) * p.out_features + n] = lane_sum(even[r] + odd[r]);
  }
}

// Many rows: the weights of PANEL_N output features are dequantized once per call into a panel of float32 (in the
// order prepare_row gives x), then tiles of PANEL_N features x PANEL_M rows multiply it from registers. Each
// (row, output) is the same FMAs in the same order as rows_block's: the same bits.
#if defined(__AVX512F__)
constexpr int PANEL_N = 4, PANEL_M = 2;  // 16 accumulators, 8 weight vectors, 2 of x: 26 of 32 registers
#else
constexpr int PANEL_N = 2, PANEL_M = 2;  // 8 + 4 + 2 of 16 registers
#endif
constexpr int64_t PANEL_MIN_ROWS = 8;  // below, rows_block dequantizing in registers; from 8 rows the panels' tiles were faster (5 Dec 2026, AMD EPYC)

// The float32 weights of output feature n, in prepared order: each chunk's first vector then its second.
template <int BITS>
void panel_row(const QuantizedProblem& p, int64_t n, float* to) {
  const int64_t k_total = p.in_features, group = p.group_size, groups = k_total / group;
  const uint8_t* w = p.weights + n * (k_total * BITS / 8);
  for (int64_t g0 = 0; g0 < groups; g0 += GROUP_BLOCK) {
    const int64_t count = std::min<int64_t>(GROUP_BLOCK, groups - g0);
    float scales[GROUP_BLOCK], biases[GROUP_BLOCK];
    load_scales(p.scales, p.scale_type, n * groups + g0, count, scales);
    load_scales(p.biases, p.scale_type, n * groups + g0, count, biases);
    for (int64_t g = 0; g < count; ++g) {
      const float scale = scales[g], bias = biases[g];
      for (int64_t k = (g0 + g) * group; k < (g0 + g + 1) * group; k += CHUNK) {
        Floats w0, w1;
        if constexpr (BITS == 4) {
          const Ints q = load_bytes(w + k / 2);
          w0 = to_floats(q & 15) * scale + bias;
          w1 = to_floats(q >> 4) * scale + bias;
        } else {
          w0 = to_floats(load_bytes(w + k)) * scale + bias;
          w1 = to_floats(load_bytes(w + k + LANES)) * scale + bias;
        }
        std::memcpy(to + k, &w0, sizeof w0);
        std::memcpy(to + k + LANES, &w1, sizeof w1);
      }
    }
  }
}

// Keeps v in a register where it is used next: the compiler may not fold its load into each FMA that reads it
// (which loads it again for every row of a tile).
inline void in_register(Floats& v) {
#if defined(__x86_64__) && defined(__AVX__)
  __asm__("" : "+v"(v));  // "v": any vector register the instruction set encodes (zmm16-31 with AVX-512)
#else
  (void)v;
#endif
}

// Outputs [n0, n0 + NB) of rows [m0, m0 + MR) from the panel ([NB][in_features]).
template <int NB, int MR>
void panel_tile(const QuantizedProblem& p, const float* panel, int64_t n0, int64_t m0) {
  const int64_t k_total = p.in_features;
  Floats even[NB][MR], odd[NB][MR];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < MR; ++r) even[i][r] = odd[i][r] = Floats{};
  for (int64_t k = 0; k < k_total; k += CHUNK) {
    Floats w0[NB], w1[NB];
    for (int i = 0; i < NB; ++i) {
      w0[i] = load(panel + i * k_total + k);
      w1[i] = load(panel + i * k_total + k + LANES);
      in_register(w0[i]);  // loaded once for the tile's rows, not folded into each row's FMA
      in_register(w1[i]);
    }
    for (int r = 0; r < MR; ++r) {
      Floats x0 = load(p.x + (m0 + r) * k_total + k), x1 = load(p.x + (m0 + r) * k_total + k + LANES);
      in_register(x0);
      in_register(x1);
      for (int i = 0; i < NB; ++i) {
        even[i][r] += w0[i] * x0;
        odd[i][r] += w1[i] * x1;
      }
    }
  }
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (NB == 4 && MR == 2) {
    float sums[8];
    lane_sums8({even[0][0] + odd[0][0], even[1][0] + odd[1][0], even[2][0] + odd[2][0], even[3][0] + odd[3][0],
                even[0][1] + odd[0][1], even[1][1] + odd[1][1], even[2][1] + odd[2][1], even[3][1] + odd[3][1]},
               sums);
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < NB; ++i) p.output[(m0 + r) * p.out_features + n0 + i] = sums[r * NB + i];
    return;
  }
#endif
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < MR; ++r) p.output[(m0 + r) * p.out_features + n0 + i] = lane_sum(even[i][r] + odd[i][r]);
}

template <int NB>
void panel_rows(const QuantizedProblem& p, const float* panel, int64_t n0) {
  int64_t m = 0;
  for (; m + PANEL_M <= p.rows; m += PANEL_M) panel_tile<NB, PANEL_M>(p, panel, n0, m);
  for (; m < p.rows; ++m) panel_tile<NB, 1>(p, panel, n0, m);
}

template <int BITS>
void run_panels(const QuantizedProblem& p, int64_t first, int64_t last) {
  std::vector<float> panel(PANEL_N * p.in_features);
  int64_t n = first;
  for (; n + PANEL_N <= last; n += PANEL_N) {
    for (int i = 0; i < PANEL_N; ++i) panel_row<BITS>(p, n + i, panel.data() + i * p.in_features);
    panel_rows<PANEL_N>(p, panel.data(), n);
  }
  for (; n < last; ++n) {
    panel_row<BITS>(p, n, panel.data());
    panel_rows<1>(p, panel.data(), n);
  }
}

template <int BITS>
void run_bits(const QuantizedProblem& p, int64_t first, int64_t last) {
  if (p.rows >= PANEL_MIN_ROWS) {
    run_panels<BITS>(p, first, last);
    return;
  }
  int64_t row = 0;
  for (; row + MAX_ROWS <= p.rows; row += MAX_ROWS) rows_block<BITS, MAX_ROWS>(p, row, first, last);
  switch (p.rows - row) {
    case 1: rows_block<BITS, 1>(p, row, first, last); break;
    case 2: rows_block<BITS, 2>(p, row, first, last); break;
    case 3: rows_block<BITS, 3>(p, row, first, last); break;
#if defined(__AVX512F__)
    case 4: rows_block<BITS, 4>(p, row, first, last); break;
    case 5: rows_block<BITS, 5>(p, row, first, last); break;
    case 6: rows_block<BITS, 6>(p, row, first, last); break;
    case 7: rows_block<BITS, 7>(p, row, first, last); break;
#endif
    default: break;
  }
}

template <int BITS>
void dequantize_bits(const QuantizedProblem& p, int64_t first, int64_t last, float* to) {
  const int64_t k_total = p.in_features, group = p.group_size, groups = k_total / group;
  const int64_t row_bytes = k_total * BITS / 8;
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* w = p.weights + n * row_bytes;
    float* out = to + n * k_total;
    for (int64_t g0 = 0; g0 < groups; g0 += GROUP_BLOCK) {
      const int64_t count = std::min<int64_t>(GROUP_BLOCK, groups - g0);
      float scales[GROUP_BLOCK], biases[GROUP_BLOCK];
      load_scales(p.scales, p.scale_type, n * groups + g0, count, scales);
      load_scales(p.biases, p.scale_type, n * groups + g0, count, biases);
      for (int64_t g = 0; g < count; ++g) {
        const float scale = scales[g], bias = biases[g];
        for (int64_t k = (g0 + g) * group; k < (g0 + g + 1) * group; k += CHUNK) {
          if constexpr (BITS == 4) {
            const Ints q = load_bytes(w + k / 2);
            const Floats w0 = to_floats(q & 15) * scale + bias, w1 = to_floats(q >> 4) * scale + bias;
            for (int i = 0; i < LANES; ++i) {  // value k + 2i is a low nibble, k + 2i + 1 a high one
              out[k + 2 * i] = w0[i];
              out[k + 2 * i + 1] = w1[i];
            }
          } else {
            const Floats w0 = to_floats(load_bytes(w + k)) * scale + bias;
            const Floats w1 = to_floats(load_bytes(w + k + LANES)) * scale + bias;
            std::memcpy(out + k, &w0, sizeof w0);
            std::memcpy(out + k + LANES, &w1, sizeof w1);
          }
        }
      }
    }
  }
}

void dequantize(const QuantizedProblem& p, int64_t first, int64_t last, float* to) {
  if (p.bits == 4) {
    dequantize_bits<4>(p, first, last, to);
  } else {
    dequantize_bits<8>(p, first, last, to);
  }
}

void run(const QuantizedProblem& p, int64_t first, int64_t last) {
  if (p.bits == 4) {
    run_bits<4>(p, first, last);
  } else {
    run_bits<8>(p, first, last);
  }
}

}  // namespace

const QuantizedLoops quantized_loops = {VELOX_NAME(VELOX_ISA), prepare_row, run, dequantize};

}  // namespace velox::VELOX_ISA
