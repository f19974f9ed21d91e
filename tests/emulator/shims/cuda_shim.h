// A small C++ stand-in for the CUDA builtins the kernels use, over the fiber emulator (emu_runtime.h): threadIdx,
// blockIdx, __syncthreads, __shfl_xor_sync, uint4/make_uint4, uint2/make_uint2, __uint_as_float/__float_as_uint, exp2f, the
// declaration specifiers. The CUDA prelude is compiled with TV_EMULATOR defined: it then skips its typedefs and its
// two inline-PTX half conversions (cvt.f32.f16 / cvt.rn.f16.f32), which use tv_emu_half_to_float/tv_emu_float_to_half.
#pragma once
#include "emu_runtime.h"

typedef unsigned int uint;
typedef unsigned short ushort;
struct alignas(16) uint4 { uint x, y, z, w; };
inline uint4 make_uint4(uint a, uint b, uint c, uint d) { return uint4{a, b, c, d}; }
struct alignas(8) uint2 { uint x, y; };
inline uint2 make_uint2(uint a, uint b) { return uint2{a, b}; }
typedef unsigned char uchar;
inline float __uint_as_float(uint u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint __float_as_uint(float f) { uint u; std::memcpy(&u, &f, 4); return u; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int mask) { return emu::simd_xor(v, (unsigned)mask); }
inline void __syncthreads() { emu::group_barrier(); }
// device-wide atomics, fences and uncached loads: the fibers switch only at barriers and yields, so plain operations
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline void __threadfence() {}
template <class T> inline T __ldcg(const T* p) { return *p; }
// byte n of the result: byte (s >> 4n) & 7 of the 8 bytes y:x (x's bytes first)
inline uint __byte_perm(uint x, uint y, uint s) {
  const unsigned long long b = ((unsigned long long)y << 32) | x;
  uint r = 0;
  for (int n = 0; n < 4; n++) r |= (uint)((b >> (8 * ((s >> (4 * n)) & 7))) & 0xffu) << (8 * n);
  return r;
}
inline float tv_emu_half_to_float(ushort h) { return emu::half_bits_to_float(h); }
inline ushort tv_emu_float_to_half(float f) { return emu::float_to_half_bits(f); }

// the tensor-core kernel's PTX (mma.sync, cp.async): the mma over the SIMD group's fragments, cp.async as emu::cp_async
inline void tv_emu_mma_16816(float* c, const uint* a, const uint* b, bool bf16) { emu::mma_m16n8k16(c, a, b, bf16); }
inline void tv_emu_cp_async16(void* dst, const void* src) { emu::cp_async(dst, src, 16); }
inline void tv_emu_cp_async(void* dst, const void* src, size_t bytes) { emu::cp_async(dst, src, bytes); }
inline void tv_emu_cp_async_commit() { emu::cp_async_commit(); }
inline void tv_emu_prefetch(const void* p) { emu::prefetch(p); }
inline void tv_emu_cp_async_wait(int pending) { emu::cp_async_wait(pending); }
inline void tv_emu_bulk_copy(void* dst, const void* src, size_t bytes, const void* bar) { emu::bulk_copy(dst, src, bytes, bar); }
inline void tv_emu_mbar_wait(const void* bar) { emu::mbar_wait(bar); }
inline void tv_emu_ldmatrix_x4(uint* r, const void* row, bool trans) { emu::ldmatrix_x4(r, row, trans); }
inline void tv_emu_wgmma(float* d, int n, const void* a, const void* b, bool bf16) { emu::wgmma_m64k16(d, n, a, b, bf16); }
inline void tv_emu_wgmma_commit() { emu::wgmma_commit(); }
inline void tv_emu_wgmma_wait(int pending) { emu::wgmma_wait(pending); }
// `extern __shared__` arrays (dynamic shared memory, sized by the launch): kernels take this pointer under TV_EMULATOR
inline unsigned char* tv_emu_dynamic_shared() { return emu::dynamic_shared(); }
// a persistent kernel's grid barrier (cooperative launches only: Launch.cooperative); kernels call it under TV_EMULATOR
inline void tv_emu_grid_sync() { emu::grid_barrier(); }
// a thread spinning on memory another device's launch writes (the all-reduce's flags) lets its block's other fibers run
inline void tv_emu_yield() { emu::yield(); }

#define TV_EMULATOR 1
#define TV_LINKAGE
#define threadIdx (::emu::thread_pos())
#define blockIdx (::emu::group_pos())
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))
