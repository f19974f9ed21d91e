// A small C++ stand-in for the parts of the Metal Shading Language the kernels use, over the fiber emulator
// (emu_runtime.h): address-space qualifiers, uint2/uint3/uint4, uchar, half, as_type<>, threadgroup_barrier, simd_shuffle_xor,
// simd_sum/simd_max, exp2. Thread positions come from the emulator; attributes such as [[buffer(0)]] are ignored by
// the C++ compiler (warning switched off). Included once per translation unit; the fake <metal_stdlib> in include/
// is empty so the prelude's #include of it is harmless.
#pragma once
#include "emu_runtime.h"

typedef unsigned int uint;
typedef unsigned short ushort;

struct uint3 { uint x, y, z; };
struct alignas(16) uint4 {
  uint x, y, z, w;
  uint4() = default;
  explicit uint4(uint s) : x(s), y(s), z(s), w(s) {}
  uint4(uint a, uint b, uint c, uint d) : x(a), y(b), z(c), w(d) {}
};
struct alignas(8) uint2 {
  uint x, y;
  uint2() = default;
  explicit uint2(uint s) : x(s), y(s) {}
  uint2(uint a, uint b) : x(a), y(b) {}
};
typedef unsigned char uchar;
struct half {
  ushort bits;
  half() = default;
  half(float f) : bits(emu::float_to_half_bits(f)) {}
  operator float() const { return emu::half_bits_to_float(bits); }
};
static_assert(sizeof(half) == 2, "half must be 2 bytes for as_type");

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { emu::group_barrier(); }
template <class T> inline T simd_shuffle_xor(T v, ushort mask) { return emu::simd_xor(v, mask); }
inline float simd_sum(float v) { return emu::simd_reduce(v, [](float a, float b) { return a + b; }); }
inline float simd_max(float v) { return emu::simd_reduce(v, [](float a, float b) { return a > b ? a : b; }); }
inline float exp2(float x) { return std::exp2(x); }
inline float log2(float x) { return std::log2(x); }
inline float rint(float x) { return std::rint(x); }
template <class T, class F> inline T as_type(F f) {
  static_assert(sizeof(T) == sizeof(F), "as_type needs equal sizes");
  T t;
  std::memcpy(&t, &f, sizeof(T));
  return t;
}
}  // namespace metal

// Metal keywords: address spaces and the kernel qualifier
#define kernel
#define device
#define constant const
#define thread
#define threadgroup static
