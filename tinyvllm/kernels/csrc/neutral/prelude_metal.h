// Metal dialect prelude: maps the TV_* macros used by the dialect-neutral kernels (common.inc, paged_*.inc, kv_write.inc)
// onto the Metal Shading Language. Compiled with tinygrad's MetalCompiler on macOS. On a machine without Metal the CPU
// emulator compiles this same file as C++ against tests/emulator/shims/metal_shim.h (via the fake <metal_stdlib> in
// tests/emulator/shims/include). Rules the kernels keep so that this works: threadgroup arrays are declared at kernel scope
// only (never passed to helpers), SIMD-group width is 32, blocks are one-dimensional.
#include <metal_stdlib>
using namespace metal;
#define TV_KERNEL(name) kernel void name(
#define TV_KERNEL_END , uint3 tv_tg [[threadgroup_position_in_grid]], uint3 tv_tl [[thread_position_in_threadgroup]])
#define TV_ARG(T, name, i) device T* name [[buffer(i)]]
#define TV_ARG_RO(T, name, i) const device T* name [[buffer(i)]]
#define TV_FN inline
#define TV_TPTR(T) thread T*
#define TV_GPTR(T) device T*
#define TV_SHARED threadgroup
#define TV_TID ((int)tv_tl.x)
#define TV_BID_X ((int)tv_tg.x)
#define TV_BID_Y ((int)tv_tg.y)
#define TV_BID_Z ((int)tv_tg.z)
#define TV_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
// Metal has no programmatic dependent launch: a kernel starts after the one before it (prelude_cuda.h)
#define TV_WAIT_PRIOR_GRIDS()
#define TV_SHFL_XOR(v, m) simd_shuffle_xor((v), (ushort)(m))
#define TV_UNROLL
#define TV_NO_UNROLL
#define TV_I64 long
#define TV_U32X4 uint4
#define TV_ZERO16 uint4(0u)
#define TV_LD16(p) (*((const device uint4*)(p)))
#define TV_ST16(p, v) (*((device uint4*)(p)) = (v))
#define TV_U32X2 uint2
#define TV_ZERO8 uint2(0u)
#define TV_LD8(p) (*((const device uint2*)(p)))
#define TV_ST8(p, v) (*((device uint2*)(p)) = (v))
#define TV_RINT(x) rint(x)
#define TV_AS_FLOAT(u) as_type<float>((uint)(u))
#define TV_AS_UINT(f) as_type<uint>((float)(f))
#define TV_EXP2(x) exp2(x)
#define TV_LD_COHERENT(p) (*(p))   // (another launch's data: no device-wide atomics or fences are used on Metal)
#define TV_FAST_DIV(a, b) ((a) / (b))   // (Metal compiles with fast math: an approximate division already)
#define TV_LOG2(x) log2(x)
#define TV_H2F(h) ((float)as_type<half>((ushort)(h)))
#define TV_F2H(f) as_type<ushort>((half)(f))
#define TV_WARP_SUM(v) simd_sum(v)
#define TV_WARP_MAX(v) simd_max(v)
