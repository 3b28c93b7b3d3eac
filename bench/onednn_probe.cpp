// How fast would the model's weight matmuls be on oneDNN, in bf16 and in int8, against float32? (issue 56)
//
// Not part of Velox: a probe of oneDNN's matmul at SmolLM2-135M's shapes (rows x in x out: prefill chunks of
// 512, the forcing's 64, decode batches of 8 and 1; the MLP 576 -> 1536 -> 576, the attention projections,
// the 49,152-token head), each the best of many calls, in GFLOP/s (GOP/s for int8): float32, bf16 source and
// weights into float32, u8 x s8 into float32. oneDNN picks its kernels by the CPU (DNNL_VERBOSE=1 names them:
// AMX on Sapphire Rapids, AVX-512 VNNI / BF16 on Zen 4, AVX2 elsewhere). Debian's oneDNN (libdnnl-dev, 2.x):
//
//     apt-get install libdnnl-dev
//     g++ -O2 -std=c++17 bench/onednn_probe.cpp -ldnnl -o /tmp/onednn_probe && /tmp/onednn_probe
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
#include "dnnl.hpp"

using namespace dnnl;
using dt = memory::data_type;

double run(engine& eng, stream& s, int M, int K, int N, dt src_t, dt wei_t, dt dst_t, int reps) {
  memory::desc a({M, K}, src_t, memory::format_tag::ab);
  memory::desc b_any({K, N}, wei_t, memory::format_tag::any);
  memory::desc b_plain({K, N}, wei_t, memory::format_tag::ab);
  memory::desc c({M, N}, dst_t, memory::format_tag::ab);
  primitive_attr attr;
  matmul::desc md(a, b_any, c);
  matmul::primitive_desc pd(md, attr, eng);
  memory A(a, eng), Bp(b_plain, eng), B(pd.weights_desc(), eng), C(c, eng);
  // fill with something
  // normal numbers of each type (no denormals: they would slow float32 down and say nothing of the model)
  auto fill = [](memory& m, dt type) {
    size_t n = m.get_desc().get_size();
    auto* bytes = static_cast<unsigned char*>(m.get_data_handle());
    if (type == dt::f32) {
      auto* f = reinterpret_cast<float*>(bytes);
      for (size_t i = 0; i < n / 4; ++i) f[i] = 0.25f * static_cast<float>((i * 37) % 7) - 0.75f;
    } else if (type == dt::bf16) {
      auto* h = reinterpret_cast<unsigned short*>(bytes);
      for (size_t i = 0; i < n / 2; ++i) h[i] = (i % 3 == 0) ? 0x3F80 : 0xBF00;  // 1.0, -0.5
    } else {
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>((i * 37) % 7 + 1);
    }
  };
  fill(A, src_t); fill(Bp, wei_t);
  reorder(Bp, B).execute(s, Bp, B);
  matmul mm(pd);
  mm.execute(s, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
  s.wait();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    mm.execute(s, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
    s.wait();
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t);
  }
  return 2.0 * M * K * N / best / 1e9;
}

int main() {
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  int shapes[][3] = {{512, 576, 1536}, {512, 1536, 576}, {512, 576, 576}, {64, 576, 1536}, {8, 576, 1536}, {1, 576, 1536}, {512, 576, 49152}};
  printf("M K N | f32 | bf16 | u8s8->f32  (GFLOP/s or GOP/s)\n");
  for (auto& sh : shapes) {
    int M = sh[0], K = sh[1], N = sh[2];
    int reps = M >= 64 ? 20 : 200;
    double f = run(eng, s, M, K, N, dt::f32, dt::f32, dt::f32, reps);
    double h = run(eng, s, M, K, N, dt::bf16, dt::bf16, dt::f32, reps);
    double q = run(eng, s, M, K, N, dt::u8, dt::s8, dt::f32, reps);
    printf("%d %d %d | %.0f | %.0f | %.0f\n", M, K, N, f, h, q);
  }
}
