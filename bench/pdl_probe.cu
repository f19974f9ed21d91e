// Does programmatic dependent launch (PDL) shorten a batch-1 decode step? A chain of dependent GEMVs shaped like
// Qwen3-0.6B's layers (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072; bf16 weights, each product's
// input the previous one's output), captured into a CUDA graph, timed by replay:
//   plain  - ordinary launches: each kernel starts when the previous one has finished;
//   pdl    - launches with programmaticStreamSerialization: each kernel starts while the previous one drains, prefetches
//            its weight rows into L2 (they do not depend on the previous kernel), then waits (griddepcontrol.wait)
//            before it reads its input.
// Build and run (GPU machine): nvcc -O3 -arch=sm_90 -o /tmp/pdl_probe bench/pdl_probe.cu && /tmp/pdl_probe
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

template <bool PDL>
__global__ void __launch_bounds__(128) gemv(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                            __nv_bfloat16* __restrict__ y, int k, int n) {
  const int lane = threadIdx.x % 32;
  const int o0 = (blockIdx.x * 4 + threadIdx.x / 32) * 2;
  if (PDL) {
    // this block's 8 weight rows into L2 while the previous kernel finishes, then let the next kernel launch
    const char* base = reinterpret_cast<const char*>(w + (size_t)blockIdx.x * 8 * k);
    for (int off = threadIdx.x * 128; off < 8 * k * 2; off += 128 * 128)
      asm volatile("prefetch.global.L2 [%0];" :: "l"(base + off));
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (o0 >= n) return;
  float acc[2] = {0.f, 0.f};
  for (int kk = lane * 8; kk < k; kk += 256) {
    const uint4 xv = *reinterpret_cast<const uint4*>(x + kk);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
    for (int r = 0; r < 2; r++) {
      const uint4 wv = *reinterpret_cast<const uint4*>(w + (size_t)(o0 + r) * k + kk);
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
      for (int j = 0; j < 4; j++) {
        const float2 a = __bfloat1622float2(xp[j]), b = __bfloat1622float2(wp[j]);
        acc[r] += a.x * b.x + a.y * b.y;
      }
    }
  }
  for (int r = 0; r < 2; r++) {
    for (int m = 16; m > 0; m >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], m);
    if (lane == 0) y[o0 + r] = __float2bfloat16(acc[r] * 1e-2f);
  }
}

struct Proj { int n, k; };

float run(bool pdl, int layers, std::vector<__nv_bfloat16*>& ws, __nv_bfloat16* act, const Proj* projs) {
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < layers; l++) {
    for (int p = 0; p < 4; p++) {
      const Proj pr = projs[p];
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(pr.n / 8);
      cfg.blockDim = dim3(128);
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = pdl ? 1 : 0;
      const __nv_bfloat16* x = act + ((l * 4 + p) % 2) * 8192;
      __nv_bfloat16* y = act + ((l * 4 + p + 1) % 2) * 8192;
      if (pdl) CHECK(cudaLaunchKernelEx(&cfg, gemv<true>, (const __nv_bfloat16*)ws[l * 4 + p], x, y, pr.k, pr.n));
      else CHECK(cudaLaunchKernelEx(&cfg, gemv<false>, (const __nv_bfloat16*)ws[l * 4 + p], x, y, pr.k, pr.n));
    }
  }
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 5; i++) CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  const int reps = 50;
  CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; i++) CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaEventRecord(b, s));
  CHECK(cudaEventSynchronize(b));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  return ms / reps;
}

int main() {
  const Proj projs[4] = {{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}};
  const int layers = 28;
  std::vector<__nv_bfloat16*> ws;
  size_t bytes = 0;
  for (int l = 0; l < layers; l++)
    for (int p = 0; p < 4; p++) {
      __nv_bfloat16* w;
      const size_t nb = (size_t)projs[p].n * projs[p].k * 2;
      CHECK(cudaMalloc(&w, nb));
      CHECK(cudaMemset(w, 0x3c, nb));
      ws.push_back(w);
      bytes += nb;
    }
  __nv_bfloat16* act;
  CHECK(cudaMalloc(&act, 2 * 8192 * 2));
  CHECK(cudaMemset(act, 0x3c, 2 * 8192 * 2));
  for (int round = 0; round < 2; round++) {
    const float plain = run(false, layers, ws, act, projs), pdl = run(true, layers, ws, act, projs);
    printf("{\"kernels\": %d, \"weight_mb\": %.1f, \"plain_ms\": %.4f, \"pdl_ms\": %.4f, \"plain_GBps\": %.0f, \"pdl_GBps\": %.0f}\n",
           layers * 4, bytes / 1e6, plain, pdl, bytes / plain / 1e6, bytes / pdl / 1e6);
  }
  return 0;
}
