// CPU emulation of GPU threadgroups, for checking the kernels without a GPU (tests/test_kernels_emulated.py).
//
// Every GPU thread of a threadgroup is a fiber (ucontext, its own stack) on one OS thread; threadgroups run one after
// the other. A barrier suspends the fiber until every thread of the group (threadgroup barrier) or of its 32-lane
// SIMD group (shuffles and SIMD reductions) has arrived, so barrier semantics are real: a thread never runs ahead of
// a barrier the others have not reached. Fibers are resumed in a configurable order (forward, reverse, or a fresh
// random permutation at every round), so a missing barrier shows up as a result that changes with the order.
// Deadlocks (a barrier some threads never reach, e.g. after a non-uniform early exit) are detected and reported.
//
// Threadgroup (shared) memory: the shims define the address-space keyword as `static`, so a kernel's shared arrays are
// one instance shared by the fibers; that is exact because only one threadgroup runs at a time. Dynamic shared memory
// (CUDA `extern __shared__`, the launch's size) is one buffer, filled with 0xff bytes (NaN in every float type) before
// each threadgroup, so a read of memory the group never wrote shows; a write past its end is reported.
//
// Cooperative launches (launch_cooperative; CUDA's for persistent kernels) keep every block of the grid alive at once,
// each with its own fibers, barrier state and dynamic shared memory (poisoned once, at the start), and add a grid
// barrier (grid_barrier) that waits for every thread of every block; rounds visit the blocks in the launch's order and
// run each as far as it goes.
// Static shared arrays are still one instance for all blocks, which now run interleaved: a cooperative kernel must keep
// all its shared memory in dynamic shared memory. A grid barrier outside a cooperative launch is reported as a deadlock.
//
// Launches on different OS threads run independently (the scheduler's state is per thread), so a test can run several
// devices' launches at once, as the all-reduce kernel needs (static shared arrays would still be one instance for all).
#pragma once
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700   // macOS declares the (deprecated) ucontext functions only with it
#endif
#include <ucontext.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <functional>
#include <random>
#include <vector>
#include <algorithm>

namespace emu {

struct Dim3 { unsigned x, y, z; };
struct alignas(16) Bytes16 { unsigned char b[16]; };
constexpr size_t SHARED_GUARD = 256;   // bytes past the dynamic shared memory that must stay untouched

enum State { READY, WAIT_GROUP, WAIT_SIMD, WAIT_GRID, DONE };

// a wgmma in flight (wgmma_m64k16 below): its accumulators, its operands' tiles and the operand values this thread's
// accumulators read when it was issued
struct WgmmaOp {
  float* d;
  int n;
  const void* a;
  const void* b;
  bool bf16;
  std::vector<float> operands;
};

// a cp.async copy not yet landed (copies landing at their wait, below): its destination and the source's bytes at the
// issue
struct PendingCopy {
  void* dst;
  std::vector<unsigned char> bytes;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  int tid = 0;
  State state = READY;
  unsigned wait_gen = 0;
  unsigned simd_parity = 0;
  std::vector<WgmmaOp> wgmma_open;                  // issued, not yet committed
  std::vector<std::vector<WgmmaOp>> wgmma_groups;   // committed groups, oldest first
  const char* error = nullptr;                      // an asynchronous-operation hazard this thread ran into
  std::vector<PendingCopy> copies_open;                 // cp.async copies issued, not yet committed
  std::vector<std::vector<PendingCopy>> copy_groups;    // committed groups, oldest first
};

struct Group;
struct GridSync { int nt = 0, arrived = 0; unsigned gen = 0; };   // the grid barrier of a cooperative launch
inline Group*& current_group() { static thread_local Group* g = nullptr; return g; }
inline Fiber*& current_fiber() { static thread_local Fiber* f = nullptr; return f; }
inline GridSync*& current_grid() { static thread_local GridSync* s = nullptr; return s; }   // null outside a cooperative launch

struct Group {
  int nt = 0;
  Dim3 block{0, 0, 0}, grid{0, 0, 0};
  std::vector<Fiber> fibers;
  ucontext_t sched;
  int arrived = 0;
  unsigned gen = 0;
  int simd_arrived[32] = {0};
  unsigned simd_gen[32] = {0};
  uint64_t slots[2][1024];            // SIMD exchange, double-buffered by each fiber's parity
  uint32_t frags[2][1024][6];         // the same for the mma operand fragments
  const std::function<void()>* body = nullptr;
  const char* error = nullptr;
  std::vector<Bytes16> dynamic_shared;   // the launch's bytes, then SHARED_GUARD guard bytes
  std::vector<std::pair<const void*, PendingCopy>> bulk_pending;   // late bulk copies and their mbarriers
  size_t dynamic_shared_bytes = 0;

  int simd_size(int sg) const { return std::min(32, nt - sg * 32); }
};

// a copy's source bytes as they are at its issue, to land at dst later
inline PendingCopy pending_copy(void* dst, const void* src, size_t bytes) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  return PendingCopy{dst, std::vector<unsigned char>(s, s + bytes)};
}
inline void land_copy(const PendingCopy& c) { std::memcpy(c.dst, c.bytes.data(), c.bytes.size()); }

inline void fiber_entry() {
  Group* g = current_group();
  (*g->body)();
  Fiber* f = current_fiber();
  for (auto& group : f->copy_groups) for (const PendingCopy& c : group) land_copy(c);   // (a block may exit with copies
  for (const PendingCopy& c : f->copies_open) land_copy(c);                             // in flight)
  f->copy_groups.clear();
  f->copies_open.clear();
  if (!f->error && (!f->wgmma_open.empty() || !f->wgmma_groups.empty()))
    f->error = "the thread exited with wgmma products in flight (never waited for)";
  f->state = DONE;
  swapcontext(&current_fiber()->ctx, &g->sched);
}

inline void yield() { swapcontext(&current_fiber()->ctx, &current_group()->sched); }

inline unsigned char* dynamic_shared() { return current_group()->dynamic_shared.data()->b; }

inline void reset_dynamic_shared(Group& g) {
  unsigned char* p = g.dynamic_shared.data()->b;
  std::memset(p, 0xff, g.dynamic_shared_bytes);
  std::memset(p + g.dynamic_shared_bytes, 0xa5, SHARED_GUARD);
}

inline bool dynamic_shared_intact(const Group& g) {
  const unsigned char* p = g.dynamic_shared.data()->b + g.dynamic_shared_bytes;
  return std::all_of(p, p + SHARED_GUARD, [](unsigned char c) { return c == 0xa5; });
}

inline void group_barrier() {
  Group* g = current_group();
  Fiber* f = current_fiber();
  f->state = WAIT_GROUP;
  f->wait_gen = g->gen;
  if (++g->arrived == g->nt) { g->arrived = 0; g->gen++; }
  yield();
}

inline void simd_barrier() {
  Group* g = current_group();
  Fiber* f = current_fiber();
  const int sg = f->tid / 32;
  f->state = WAIT_SIMD;
  f->wait_gen = g->simd_gen[sg];
  if (++g->simd_arrived[sg] == g->simd_size(sg)) { g->simd_arrived[sg] = 0; g->simd_gen[sg]++; }
  yield();
}

// every thread of every block of a cooperative launch (CUDA's grid.sync()); elsewhere it never releases (a deadlock)
inline void grid_barrier() {
  GridSync* s = current_grid();
  Fiber* f = current_fiber();
  f->state = WAIT_GRID;
  f->wait_gen = s ? s->gen : 0;
  if (s && ++s->arrived == s->nt) { s->arrived = 0; s->gen++; }
  yield();
}

template <class T> inline uint64_t to_bits(T v) { uint64_t b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <class T> inline T from_bits(uint64_t b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }

// the exchange bank (slots / frags) this lane's next SIMD exchange writes; banks alternate per lane, so back-to-back
// exchanges never overwrite a value a slower lane has yet to read
inline unsigned take_exchange_bank() {
  Fiber* f = current_fiber();
  const unsigned p = f->simd_parity;
  f->simd_parity ^= 1u;
  return p;
}

// this lane's value into the group's exchange slots; returns the bank once every lane of the SIMD group has written
template <class T> inline unsigned simd_publish(T v) {
  const unsigned p = take_exchange_bank();
  current_group()->slots[p][current_fiber()->tid] = to_bits(v);
  simd_barrier();
  return p;
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j .. 8j + 7 give the row addresses of 8x8 matrix j (16-bit
// elements, 16 bytes a row); lane l receives, for each j, the element pair at row l / 4, columns 2 (l % 4) and + 1 (with
// trans: of the transposed matrix, i.e. rows 2 (l % 4) and + 1 of column l / 4)
inline void ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  Group* g = current_group();
  const unsigned p = simd_publish(reinterpret_cast<uintptr_t>(row));
  const int tid = current_fiber()->tid, base = (tid / 32) * 32, lane = tid % 32;
  auto at = [&](int j, int rr, int c) {
    const char* addr = reinterpret_cast<const char*>(static_cast<uintptr_t>(g->slots[p][base + j * 8 + rr]));
    uint16_t v;
    std::memcpy(&v, addr + c * 2, 2);
    return (uint32_t)v;
  };
  for (int j = 0; j < 4; j++) {
    const int a = lane / 4, b = (lane % 4) * 2;
    r[j] = trans ? (at(j, b, a) | (at(j, b + 1, a) << 16)) : (at(j, a, b) | (at(j, a, b + 1) << 16));
  }
}

inline float half_bits_to_float(uint16_t h);

// mma.sync.m16n8k16.row.col with float32 accumulators, PTX's fragment layout (g = lane / 4, t = lane % 4):
// a[0..3] = A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]; b[0..1] = B[2t..2t+1][g], B[2t+8..][g];
// c[0..3] = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]. Elements are bfloat16 or float16 bits, two per word.
inline void mma_m16n8k16(float* c, const uint32_t* a, const uint32_t* b, bool bf16) {
  Group* g = current_group();
  Fiber* f = current_fiber();
  const unsigned p = take_exchange_bank();
  for (int i = 0; i < 4; i++) g->frags[p][f->tid][i] = a[i];
  for (int i = 0; i < 2; i++) g->frags[p][f->tid][4 + i] = b[i];
  simd_barrier();
  const int base = (f->tid / 32) * 32, lane = f->tid % 32, row = lane / 4, col = (lane % 4) * 2;
  auto elem = [&](int holder, int reg, int k) {
    const uint32_t w = g->frags[p][base + holder][reg], bits = (k % 2) ? (w >> 16) : (w & 0xffffu);
    if (bf16) { const uint32_t x = bits << 16; float v; std::memcpy(&v, &x, 4); return v; }
    return half_bits_to_float((uint16_t)bits);
  };
  auto a_at = [&](int r, int k) { return elem((r % 8) * 4 + (k % 8) / 2, (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k); };
  auto b_at = [&](int k, int n) { return elem(n * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k); };
  for (int i = 0; i < 4; i++) {
    const int r = row + (i >= 2 ? 8 : 0), n = col + i % 2;
    float s = c[i];
    for (int k = 0; k < 16; k++) s += a_at(r, k) * b_at(k, n);
    c[i] = s;
  }
}

// cp.async (global to shared memory, CUDA): by default a plain copy at the issue, the earliest the hardware may land
// it (a stage refilled while other threads still read it shows up). With late copies on (the launch's choice,
// set_late_copies), a copy lands when its thread waits for its commit group, the latest the hardware may land it
// (data read before the wait that covers it reads what was there before: a missing wait shows up).
// asynchronous operations in commit groups (cp.async copies, wgmma products): commit closes the open group; a wait
// retires the oldest committed groups, `retire` applied to each operation, until at most `pending` remain
template <class T> inline void commit_group(std::vector<T>& open, std::vector<std::vector<T>>& groups) {
  groups.push_back(std::move(open));
  open.clear();
}
template <class T, class F> inline void retire_groups(std::vector<std::vector<T>>& groups, int pending, F retire) {
  while ((int)groups.size() > pending) {
    for (T& op : groups.front()) retire(op);
    groups.erase(groups.begin());
  }
}

inline bool& late_copies() { static thread_local bool on = false; return on; }
// the launch's buffers (the harness sets them before each launch, tv_emu_set_buffers): an L2 prefetch, which the
// hardware never faults on, must still name a byte of one of them (a prefetch past a weight's end is an error)
inline std::vector<std::pair<const unsigned char*, size_t>>& launch_buffers() {
  static thread_local std::vector<std::pair<const unsigned char*, size_t>> buffers;
  return buffers;
}
inline void prefetch(const void* p) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (const auto& [base, bytes] : launch_buffers()) if (c >= base && c < base + bytes) return;
  if (!current_fiber()->error) current_fiber()->error = "an L2 prefetch outside the launch's buffers";
}
inline void cp_async(void* dst, const void* src, size_t bytes) {
  if (!late_copies()) { std::memcpy(dst, src, bytes); return; }
  current_fiber()->copies_open.push_back(pending_copy(dst, src, bytes));
}
inline void cp_async_commit() { commit_group(current_fiber()->copies_open, current_fiber()->copy_groups); }
// wait until at most `pending` of this thread's committed groups are in flight: the older ones land
inline void cp_async_wait(int pending) {
  retire_groups(current_fiber()->copy_groups, pending, land_copy);
}

// a bulk copy (cp.async.bulk, counted on an mbarrier): at the issue, or with late copies on, when a thread of the block
// first waits on its barrier (the hardware completes the barrier's phase only once its bytes have landed)
inline void bulk_copy(void* dst, const void* src, size_t bytes, const void* bar) {
  if (!late_copies()) { std::memcpy(dst, src, bytes); return; }
  current_group()->bulk_pending.emplace_back(bar, pending_copy(dst, src, bytes));
}
inline void mbar_wait(const void* bar) {
  auto& pending = current_group()->bulk_pending;
  for (const auto& [b, c] : pending) if (b == bar) land_copy(c);
  pending.erase(std::remove_if(pending.begin(), pending.end(), [bar](const auto& p) { return p.first == bar; }), pending.end());
}

// wgmma.mma_async.m64nNk16 from shared memory (wgmma.inc): both operands K-major, 128 bytes a row in 128-byte
// swizzled 8-row atoms (the 16-byte chunk bits 4-6 of an address XOR its row bits 7-9). Each thread sums its own
// accumulators, d[4j + i] = D[16 w + g + 8 (i / 2)][8 j + 2 t + i % 2] for warp w of the warpgroup: the operands sit in
// shared memory, written before the barrier that precedes the product, so no exchange is needed.
// Asynchronous as on the GPU: an issued product joins the open group (wgmma_commit closes it) and runs when a
// wgmma_wait retires its group, from the operands as they are then; those must equal what they were at the issue (a
// stage refilled while a product still reads it is an error, whichever moment the hardware would have read it).
inline float wgmma_operand(const void* tile, int r, int k, bool bf16) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(tile) + (uintptr_t)(r * 128 + k * 2);
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const void*>(u ^ (((u >> 7) & 7u) << 4)), 2);
  if (bf16) { const uint32_t x = (uint32_t)bits << 16; float v; std::memcpy(&v, &x, 4); return v; }
  return half_bits_to_float(bits);
}

// the operand values thread tid's accumulators read: its two rows of A, then its n / 4 columns of B, 16 k each
inline std::vector<float> wgmma_operands(int tid, int n, const void* a, const void* b, bool bf16) {
  const int w = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  std::vector<float> v;
  v.reserve(32 + n * 4);
  for (int half = 0; half < 2; half++) for (int k = 0; k < 16; k++) v.push_back(wgmma_operand(a, 16 * w + g + 8 * half, k, bf16));
  for (int j = 0; j < n / 8; j++) for (int i = 0; i < 2; i++) for (int k = 0; k < 16; k++)
    v.push_back(wgmma_operand(b, 8 * j + 2 * t + i, k, bf16));
  return v;
}

inline void wgmma_m64k16(float* d, int n, const void* a, const void* b, bool bf16) {
  Fiber* f = current_fiber();
  f->wgmma_open.push_back(WgmmaOp{d, n, a, b, bf16, wgmma_operands(f->tid, n, a, b, bf16)});
}

inline void wgmma_commit() { commit_group(current_fiber()->wgmma_open, current_fiber()->wgmma_groups); }

// retire the oldest committed groups until at most `pending` remain: each product from its operands as they are now
inline void wgmma_wait(int pending) {
  Fiber* f = current_fiber();
  retire_groups(f->wgmma_groups, pending, [f](WgmmaOp& op) {
    const std::vector<float> now = wgmma_operands(f->tid, op.n, op.a, op.b, op.bf16);
    if (std::memcmp(now.data(), op.operands.data(), now.size() * sizeof(float)) != 0 && !f->error)
      f->error = "a wgmma's operands in shared memory changed while it was in flight";
    const float* va = now.data();
    const float* vb = now.data() + 32;
    for (int j = 0; j < op.n / 8; j++) for (int i = 0; i < 4; i++) {
      float s = op.d[4 * j + i];
      for (int k = 0; k < 16; k++) s += va[(i / 2) * 16 + k] * vb[(j * 2 + i % 2) * 16 + k];
      op.d[4 * j + i] = s;
    }
  });
}

// value of lane (lane ^ mask) of this SIMD group (mask < 32; a partner outside a partial group returns v)
template <class T> inline T simd_xor(T v, unsigned mask) {
  Group* g = current_group();
  Fiber* f = current_fiber();
  const unsigned p = simd_publish(v);
  const int sg = f->tid / 32, lane = f->tid % 32, partner = lane ^ (int)mask;
  if (partner >= g->simd_size(sg)) return v;
  return from_bits<T>(g->slots[p][sg * 32 + partner]);
}

// reduction over the lanes of this SIMD group, in lane order (every lane gets the same value)
template <class T, class Op> inline T simd_reduce(T v, Op op) {
  Group* g = current_group();
  Fiber* f = current_fiber();
  const unsigned p = simd_publish(v);
  const int sg = f->tid / 32;
  T acc = from_bits<T>(g->slots[p][sg * 32]);
  for (int l = 1; l < g->simd_size(sg); l++) acc = op(acc, from_bits<T>(g->slots[p][sg * 32 + l]));
  return acc;
}

inline Dim3& thread_pos() { static thread_local Dim3 d; return d; }
inline Dim3& group_pos() { static thread_local Dim3 d; return d; }

inline void init_group(Group& g, Dim3 grid, int nt, size_t shared_bytes, size_t stack_bytes,
                       const std::function<void()>& body) {
  g.nt = nt;
  g.grid = grid;
  g.dynamic_shared_bytes = shared_bytes;
  g.dynamic_shared.resize((shared_bytes + SHARED_GUARD + 15) / 16);
  g.fibers.resize(nt);
  for (auto& f : g.fibers) f.stack.resize(stack_bytes);
  g.body = &body;
}

// block `block` from its start: every fiber at the kernel's entry, no barrier arrivals, dynamic shared memory poisoned
inline void start_group(Group& g, Dim3 block, const ucontext_t& tmpl) {
  g.block = block;
  g.arrived = 0;
  g.bulk_pending.clear();
  reset_dynamic_shared(g);
  for (int i = 0; i < 32; i++) g.simd_arrived[i] = 0;
  for (int t = 0; t < g.nt; t++) {
    Fiber& f = g.fibers[t];
    f.tid = t;
    f.state = READY;
    f.simd_parity = 0;
    f.wgmma_open.clear();
    f.wgmma_groups.clear();
    f.copies_open.clear();
    f.copy_groups.clear();
    f.error = nullptr;
    f.ctx = tmpl;
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
}

inline bool runnable(const Group& g, const Fiber& f) {
  switch (f.state) {
    case READY: return true;
    case WAIT_GROUP: return g.gen != f.wait_gen;
    case WAIT_SIMD: return g.simd_gen[f.tid / 32] != f.wait_gen;
    case WAIT_GRID: return current_grid() && current_grid()->gen != f.wait_gen;
    default: return false;
  }
}

// one round over a block: each runnable fiber runs to its next barrier or its exit, in `order` (0 forward, 1 reverse,
// 2 a random permutation); counts the exits in `done`; false when no fiber could run
inline bool run_round(Group& g, int order, std::mt19937& rng, std::vector<int>& perm, int& done) {
  for (int t = 0; t < g.nt; t++) perm[t] = order == 1 ? g.nt - 1 - t : t;
  if (order == 2) std::shuffle(perm.begin(), perm.end(), rng);
  bool progress = false;
  for (int k = 0; k < g.nt; k++) {
    Fiber& f = g.fibers[perm[k]];
    if (!runnable(g, f)) continue;
    f.state = READY;
    current_group() = &g;
    current_fiber() = &f;
    group_pos() = g.block;
    thread_pos() = {(unsigned)f.tid, 0, 0};
    swapcontext(&g.sched, &f.ctx);
    progress = true;
    if (f.state == DONE) done++;
  }
  return progress;
}

inline int finish(int rc) { current_group() = nullptr; current_grid() = nullptr; return rc; }

// no fiber can run yet not all have exited: a barrier some threads never reach (e.g. after a non-uniform early exit)
inline int report_deadlock(const Group* groups, size_t n, const char* where) {
  int count[DONE + 1] = {0};
  for (size_t i = 0; i < n; i++) for (const auto& f : groups[i].fibers) count[f.state]++;
  std::fprintf(stderr, "emu: deadlock in %s: %d threads exited, %d wait at a threadgroup barrier, %d at a SIMD operation, "
               "%d at the grid barrier (barrier or shuffle not reached by every thread)\n", where, count[DONE],
               count[WAIT_GROUP], count[WAIT_SIMD], count[WAIT_GRID]);
  return finish(1);
}

// the first asynchronous-operation hazard a thread of the block ran into, or 0
inline int report_hazard(const Group& g) {
  for (const auto& f : g.fibers)
    if (f.error) {
      std::fprintf(stderr, "emu: block (%u,%u,%u) thread %d: %s\n", g.block.x, g.block.y, g.block.z, f.tid, f.error);
      return finish(4);
    }
  return 0;
}

inline int report_overrun(const Group& g) {
  std::fprintf(stderr, "emu: block (%u,%u,%u) wrote past its %zu bytes of dynamic shared memory\n", g.block.x, g.block.y,
               g.block.z, g.dynamic_shared_bytes);
  return finish(3);
}

// order: 0 forward, 1 reverse, 2 random permutation every round (seeded); shared_bytes: dynamic shared memory
inline int launch(Dim3 grid, int nt, int order, unsigned seed, const std::function<void()>& body, size_t shared_bytes = 0,
                  size_t stack_bytes = 256 * 1024) {
  if (nt < 1 || nt > 1024) { std::fprintf(stderr, "emu: bad block size %d\n", nt); return 2; }
  Group g;
  init_group(g, grid, nt, shared_bytes, stack_bytes, body);
  std::mt19937 rng(seed);
  std::vector<int> perm(nt);
  ucontext_t tmpl;
  getcontext(&tmpl);
  for (unsigned bz = 0; bz < grid.z; bz++) for (unsigned by = 0; by < grid.y; by++) for (unsigned bx = 0; bx < grid.x; bx++) {
    start_group(g, {bx, by, bz}, tmpl);
    int done = 0;
    while (done < nt) {
      if (!run_round(g, order, rng, perm, done)) {
        char where[64];
        std::snprintf(where, sizeof where, "block (%u,%u,%u)", bx, by, bz);
        return report_deadlock(&g, 1, where);
      }
    }
    if (!dynamic_shared_intact(g)) return report_overrun(g);
    if (const int rc = report_hazard(g)) return rc;
  }
  return finish(0);
}

// a cooperative launch (a persistent kernel): every block resident at once, each with its own fibers, barriers and
// dynamic shared memory. Each round visits the blocks in `order` (a fresh permutation per round for 2) and runs each
// until all its threads wait at the grid barrier or have exited, so a block runs ahead of the others as far as the
// kernel lets it: a threadgroup barrier where a grid barrier is needed shows up
inline int launch_cooperative(Dim3 grid, int nt, int order, unsigned seed, const std::function<void()>& body,
                              size_t shared_bytes, size_t stack_bytes = 128 * 1024) {
  if (nt < 1 || nt > 1024) { std::fprintf(stderr, "emu: bad block size %d\n", nt); return 2; }
  const size_t nb = (size_t)grid.x * grid.y * grid.z;
  std::vector<Group> groups(nb);
  GridSync sync;
  sync.nt = (int)(nb * nt);
  current_grid() = &sync;
  ucontext_t tmpl;
  getcontext(&tmpl);
  for (size_t b = 0; b < nb; b++) {
    init_group(groups[b], grid, nt, shared_bytes, stack_bytes, body);
    start_group(groups[b], {(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)}, tmpl);
  }
  std::mt19937 rng(seed);
  std::vector<int> perm(nt), blocks(nb);
  int done = 0;
  while (done < sync.nt) {
    for (size_t b = 0; b < nb; b++) blocks[b] = (int)(order == 1 ? nb - 1 - b : b);
    if (order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
    bool progress = false;
    for (int b : blocks) while (run_round(groups[b], order, rng, perm, done)) progress = true;
    if (!progress) {
      char where[80];
      std::snprintf(where, sizeof where, "the cooperative grid (%u,%u,%u)", grid.x, grid.y, grid.z);
      return report_deadlock(groups.data(), nb, where);
    }
  }
  for (const auto& g : groups) {
    if (!dynamic_shared_intact(g)) return report_overrun(g);
    if (const int rc = report_hazard(g)) return rc;
  }
  return finish(0);
}

// IEEE half <-> float, round to nearest even (what the GPUs' conversion instructions do)
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) bits = sign;
    else { float f = std::ldexp((float)man, -24); std::memcpy(&bits, &f, 4); bits |= sign; }
  } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
  else bits = sign | ((exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;                      // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;                     // overflow (>= 65520 after rounding) -> inf
  if (ax < 0x38800000u) {                                           // subnormal half (or zero)
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | (uint16_t)std::nearbyint(a * 16777216.0f);       // units of 2^-24, ties to even
  }
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);                     // round mantissa to 10 bits, ties to even
  return sign | (uint16_t)(((r >> 13) - (112u << 10)) & 0xffffu);
}

}  // namespace emu
