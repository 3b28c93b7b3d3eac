// The loop of Velox's greedy choice: one row of logits to (token, log-probability) with exactly the
// arithmetic of MLX's CPU ops on x86, where MLX's SIMD width is 1: mx.logsumexp (a NaN-propagating
// maximum; exp(x - max) by its Cephes polynomial, each step one fma; the exponentials summed one by one
// in index order; logf(sum) + max), then mx.argmax of x - lse (the first NaN if any, else the first index of
// the largest) and that value. The exponentials are computed LANES at a time (the same operations lane by
// lane, so the same bits); only their sum stays in order. CMake compiles this file once per instruction
// set (VELOX_ISA names the namespace), without FMA contraction (every multiply and add rounds on its
// own, as MLX's do) but with -mfma on the x86 sets for the polynomial's explicit fma.

#include <cmath>
#include <cstring>

#include "isa_vectors.h"
#include "sampling.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace velox::VELOX_ISA {
namespace {

inline Floats fused_multiply_add(Floats a, Floats b, Floats c) {
#if defined(__AVX512F__)
  return (Floats)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  Floats r;
  for (int j = 0; j < LANES; ++j) r[j] = std::fma(a[j], b[j], c[j]);
  return r;
#endif
}

inline Floats round_down(Floats a) {
#if defined(__AVX512F__)
  return (Floats)_mm512_roundscale_ps((__m512)a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
  return (Floats)_mm256_floor_ps((__m256)a);
#else
  Floats r;
  for (int j = 0; j < LANES; ++j) r[j] = std::floor(a[j]);
  return r;
#endif
}

inline Floats splat(float v) {
  Floats r;
  for (int j = 0; j < LANES; ++j) r[j] = v;
  return r;
}

// mlx::core::simd::exp, lane by lane.
inline Floats mlx_exp(Floats x_init) {
  Floats x = x_init * splat(1.442695f);
  const Floats ipart = round_down(x + splat(0.5f));
  const Floats fpart = x - ipart;
  x = splat(1.535336188319500e-4f);
  x = fused_multiply_add(x, fpart, splat(1.339887440266574e-3f));
  x = fused_multiply_add(x, fpart, splat(9.618437357674640e-3f));
  x = fused_multiply_add(x, fpart, splat(5.550332471162809e-2f));
  x = fused_multiply_add(x, fpart, splat(2.402264791363012e-1f));
  x = fused_multiply_add(x, fpart, splat(6.931472028550421e-1f));
  x = fused_multiply_add(x, fpart, splat(1.000000000000000f));
  // lanes past +-88 are replaced below, whatever their conversion gave
  const Ints epart = (__builtin_convertvector(ipart, Ints) + 127) << 23;
  Floats power;
  std::memcpy(&power, &epart, sizeof power);
  Floats result = power * x;
  result = x_init != x_init ? x_init : result;
  result = x_init > splat(88.0f) ? splat(INFINITY) : result;
  result = x_init < splat(-88.0f) ? splat(0.0f) : result;
  return result;
}

void greedy(const float* x, int64_t n, float* scratch, uint32_t* token, float* logprob, int64_t target,
            float* target_logprob) {
  const float maximum = row_maximum(x, n);  // NaN if any logit is, as MLX's simd::maximum gives

  // exp(x - maximum), then their sum in index order
  const Floats shift = splat(maximum);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    Floats v;
    std::memcpy(&v, x + i, sizeof v);
    const Floats e = mlx_exp(v - shift);
    std::memcpy(scratch + i, &e, sizeof e);
  }
  for (; i < n; ++i) {  // a last partial vector, lane by lane
    Floats v = splat(0.0f);
    v[0] = x[i] - maximum;
    scratch[i] = mlx_exp(v)[0];
  }
  float normalizer = 0.0f;
  for (i = 0; i < n; ++i) normalizer += scratch[i];
  const float lse = std::isinf(maximum) ? maximum : std::log(normalizer) + maximum;

  // argmax of x - lse as MLX's: the first NaN if there is one, else the first index of the largest
  const Floats lses = splat(lse);
  Floats largest = splat(-INFINITY);
  Ints nans = {};
  for (i = 0; i + LANES <= n; i += LANES) {
    Floats v;
    std::memcpy(&v, x + i, sizeof v);
    v = v - lses;
    largest = v > largest ? v : largest;
    nans |= v != v;
  }
  bool any_nan = false;
  float top = -INFINITY;
  for (int j = 0; j < LANES; ++j) {
    any_nan |= nans[j] != 0;
    top = largest[j] > top ? largest[j] : top;
  }
  for (; i < n; ++i) {
    const float v = x[i] - lse;
    any_nan |= v != v;
    top = v > top ? v : top;
  }
  uint32_t index = 0;
  for (i = 0; i < n; ++i) {
    const float v = x[i] - lse;
    if (any_nan ? v != v : v == top) {
      index = static_cast<uint32_t>(i);
      top = v;
      break;
    }
  }
  *token = index;
  *logprob = top;
  if (target_logprob != nullptr) *target_logprob = target >= 0 && target < n ? x[target] - lse : NAN;
}

}  // namespace

const SamplingLoops sampling_loops = {VELOX_NAME(VELOX_ISA), greedy};

}  // namespace velox::VELOX_ISA
