// CUDA dialect prelude: maps the TV_* macros used by the dialect-neutral kernels (common.inc, paged_*.inc, kv_write.inc)
// onto CUDA C++. Compiled with NVRTC at run time (no #include: NVRTC finds no headers on some machines), or with
// `nvcc -arch=sm_90 -cubin -Xptxas -v` for the register report. The CPU emulator compiles it too, with
// tests/emulator/shims/cuda_shim.h standing in for the CUDA builtins (TV_EMULATOR is then defined).
#ifndef TV_LINKAGE
#define TV_LINKAGE extern "C"
#endif
#ifndef TV_EMULATOR
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
#endif
#define TV_KERNEL(name) TV_LINKAGE __global__ void __launch_bounds__(TV_NT) name(
#define TV_KERNEL_END )
#define TV_ARG(T, name, i) T* __restrict__ name
#define TV_ARG_RO(T, name, i) const T* __restrict__ name
#define TV_FN __device__ __forceinline__
#define TV_TPTR(T) T*
#define TV_GPTR(T) T*
#define TV_SHARED __shared__
#define TV_TID ((int)threadIdx.x)
#define TV_BID_X ((int)blockIdx.x)
#define TV_BID_Y ((int)blockIdx.y)
#define TV_BID_Z ((int)blockIdx.z)
#define TV_BARRIER() __syncthreads()
#define TV_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define TV_UNROLL _Pragma("unroll")
#define TV_NO_UNROLL _Pragma("unroll 1")
#define TV_I64 long long
#define TV_U32X4 uint4
#define TV_ZERO16 make_uint4(0u, 0u, 0u, 0u)
#define TV_LD16(p) (*reinterpret_cast<const uint4*>(p))
#define TV_ST16(p, v) (*reinterpret_cast<uint4*>(p) = (v))
#define TV_U32X2 uint2
#define TV_ZERO8 make_uint2(0u, 0u)
#define TV_LD8(p) (*reinterpret_cast<const uint2*>(p))
#define TV_ST8(p, v) (*reinterpret_cast<uint2*>(p) = (v))
#define TV_RINT(x) rintf(x)
// Programmatic dependent launch (Hopper): in a CUDA graph a kernel's blocks may start while the kernel before it is still
// finishing (the graph's programmatic edges, tinyvllm/platform/cuda_graph.py), so every kernel begins with
// TV_WAIT_PRIOR_GRIDS, before it reads or writes any memory: it waits there until the kernels it depends on have
// finished with their writes visible, then lets the kernel after it start launching (its blocks wait in turn).
#if !defined(TV_EMULATOR) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TV_WAIT_PRIOR_GRIDS() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define TV_WAIT_PRIOR_GRIDS()
#endif
// device-wide: a fence ordering this thread's writes before its later ones for every block, an atomic increment
// (returns the old value), a load past the L1 cache (of data another block of the launch wrote)
#define TV_DEVICE_FENCE() __threadfence()
#define TV_ATOMIC_INC(p) atomicAdd((p), 1u)
#define TV_LD_COHERENT(p) __ldcg(p)
#define TV_AS_FLOAT(u) __uint_as_float(u)
#define TV_AS_UINT(f) __float_as_uint(f)
#define TV_LOG2(x) log2f(x)
#ifdef TV_EMULATOR
#define TV_EXP2(x) exp2f(x)
#else
// the hardware's approximate 2^x (ex2.approx, ~2 ulp; what exp2f becomes with --use_fast_math): the softmax and SiLU
// inputs are bfloat16/float16-rounded values, far coarser than its error
__device__ __forceinline__ float tv_cuda_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
#define TV_EXP2(x) tv_cuda_exp2(x)
#endif
#ifdef TV_EMULATOR
#define TV_FAST_DIV(a, b) ((a) / (b))
#else
// a / b through the hardware's approximate reciprocal (~2 ulp; the IEEE division is ten instructions, which the SwiGLU
// prologue of the one-row products pays for every input column in every block)
#define TV_FAST_DIV(a, b) __fdividef((a), (b))
#endif
#ifdef TV_EMULATOR
#define TV_H2F(h) tv_emu_half_to_float(h)
#define TV_F2H(f) tv_emu_float_to_half(f)
#else
__device__ __forceinline__ float tv_cuda_h2f(ushort h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ ushort tv_cuda_f2h(float f) { ushort h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#define TV_H2F(h) tv_cuda_h2f(h)
#define TV_F2H(f) tv_cuda_f2h(f)
#endif
// byte j of w under float 2^23's exponent (common.inc's tv_code_float bits of an 8-bit code) in one byte permute
#define TV_BYTE_UNDER_2P23(w, j) __byte_perm((w), 0x4b000000u, 0x7540u + (j))
// byte j of w as the third byte of float 2.0 (a nibble c there: 2 + c / 64, common.inc's tv_int4_biased8) in one permute
#define TV_BYTE_IN_2(w, j) __byte_perm((w), 0x40000000u, 0x7054u + ((j) << 8))
// byte j of w as the second byte of float 2.0 (an 8-bit code c there: 2 + c / 16384, common.inc's tv_int8_biased4)
#define TV_BYTE_IN_1(w, j) __byte_perm((w), 0x40000000u, 0x7404u + ((j) << 4))
#if !defined(TV_EMULATOR) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// float32 to bfloat16 in hardware (sm_80+; common.inc has the portable rounding, the same bits but for a NaN's payload):
// one instruction for two values, where the bit arithmetic takes eight for one (a packed weight's dequantized tile
// spent most of its instructions there)
#define TV_HAS_BF16_CVT 1
__device__ __forceinline__ ushort tv_cuda_f2bf(float f) { ushort h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
// lo in the low half (the instruction puts its first operand in the high one)
__device__ __forceinline__ uint tv_cuda_f2bf2(float lo, float hi) {
  uint r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint tv_cuda_f2h2(float lo, float hi) {
  uint r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
#if !defined(TV_EMULATOR) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// FP8 E4M3 conversions in hardware (sm_89+; common.inc has the portable ones): two codes per 16 bits, the first value
// in the low byte; satfinite saturates to +-448 as the portable encoder does
#define TV_HAS_FP8_CVT 1
__device__ __forceinline__ void tv_fp8x4_unpack(uint w, float* f) {
  uint lo, hi;
  asm("{.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;}"
      : "=r"(lo), "=r"(hi) : "r"(w));
  f[0] = tv_cuda_h2f((ushort)(lo & 0xffffu)); f[1] = tv_cuda_h2f((ushort)(lo >> 16));
  f[2] = tv_cuda_h2f((ushort)(hi & 0xffffu)); f[3] = tv_cuda_h2f((ushort)(hi >> 16));
}
__device__ __forceinline__ uint tv_fp8x2_pack(float lo, float hi) {
  ushort r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
// warp (SIMD-group) reductions over all 32 lanes; every lane gets the result
__device__ __forceinline__ float tv_warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float tv_warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) { float o = __shfl_xor_sync(0xffffffffu, v, m); v = o > v ? o : v; }
  return v;
}
#define TV_WARP_SUM(v) tv_warp_sum(v)
#define TV_WARP_MAX(v) tv_warp_max(v)
