"""Tensor parallelism's all-reduce on CUDA: one kernel a device that reads the other devices' partial sums straight from
their memory (peer access), in place of the portable all-reduce's copies and adds (TensorParallelGroup.all_reduce).

Why: as copies and adds, every all-reduce puts copy nodes and edges between the devices into the step's CUDA graph. A
Qwen3-8B decode step at TP=2 held 72 of them (1,022 nodes): it cost the host 3.5 ms to launch and the GPUs 5.3 ms to run,
against 5.8 ms for the whole step on one GPU. With this kernel each device's part of the step is a chain of its own
kernels, and the devices meet only inside the all-reduce kernels (csrc/cuda/all_reduce.inc says how).

Small calls (a decode step's) push: each device stores its partial into the others' memory, each word paired with the
launch's number, and reads theirs from its own as they arrive (NCCL's low-latency protocol); larger ones pull, after
a flag handshake. Each device's exchange and signal buffers are allocated once, when the model is built (outside any capture). A call
larger than an exchange slot (a long prompt chunk), in a dtype or size the kernel does not take, goes to the portable
all-reduce; the sums are the same bits either way (the devices' partials added in their order in float32).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType

from tinyvllm.kernels.attention import DTYPE_NAMES
from tinyvllm.kernels.plan import DTYPE_CODES, ELEM_BYTES, Launch, Param, cdiv, dtype_code
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tinygrad_program import run_kernel
from tinyvllm.layers.tensor_parallel import TensorParallelGroup
from tinyvllm.platform import tinygrad_compat as compat

THREADS = 512
MAX_BLOCKS = 32          # blocks of one launch (the signal buffer's flag rows); larger calls give each block more vectors
SLOT_BYTES = 8 << 20     # one of an exchange buffer's two slots: 256 rows of 16,384 bfloat16 values
LL_MAX_BYTES = 512 << 10  # the largest call the push (LL) protocol takes: 64 rows of 4,096 bfloat16 values, a decode step's
MAX_WORLD = 8
LL_SLOT_BYTES = MAX_WORLD * 2 * LL_MAX_BYTES   # one of the two LL slots: every device's data, each word paired with a flag
EXCHANGE_BYTES = 2 * SLOT_BYTES + 2 * LL_SLOT_BYTES


@dataclass(frozen=True)
class AllReducePlan:
  numel: int
  world: int
  dtype: str
  residual: bool
  broadcast: bool
  ll: bool
  defines: dict[str, int | str] = field(compare=False)
  launches: tuple[Launch, ...] = field(compare=False)


def table_words(world: int) -> int:
  """uint32 words of a device's table: its rank, then each device's exchange and signal addresses (two words each)."""
  return 1 + 4 * world


def signal_words(world: int) -> int:
  """uint32 words of a device's signal buffer: a flag per (block, device), then a launch counter per block."""
  return MAX_BLOCKS * (world + 1)


def peer_defines(world: int, words: int) -> dict[str, int]:
  """What a kernel that meets the group through peer.inc's LL lines needs: the group and buffer layout, and the words
  each device sends (`words` 4-byte words)."""
  return {"TV_W": world, "TV_MAX_BLOCKS": MAX_BLOCKS, "TV_LL_BASE": 2 * SLOT_BYTES, "TV_LL_SLOT": LL_SLOT_BYTES,
          "TV_LL_WORDS": words}


def unsupported_reason(numel: int, dtype: str, world: int) -> str | None:
  if dtype not in DTYPE_CODES: return f"dtype {dtype}"
  vec = 16 // ELEM_BYTES[dtype_code(dtype)]
  if numel % vec: return f"{numel} elements are not whole 16-byte vectors"
  if numel * ELEM_BYTES[dtype_code(dtype)] > SLOT_BYTES: return f"{numel} elements exceed an exchange slot ({SLOT_BYTES >> 20} MiB)"
  if not 2 <= world <= MAX_WORLD: return f"{world} devices"
  return None


def takes_ll(numel: int, dtype: str) -> bool:
  """Whether a call is small enough for the push (LL) protocol, whose latency is lowest; larger ones pull."""
  return numel * ELEM_BYTES[dtype_code(dtype)] <= LL_MAX_BYTES


def all_reduce_plan(numel: int, world: int, dtype: str, residual: bool = False, broadcast: bool = False,
                    ll: bool | None = None) -> AllReducePlan:
  """The launch for `numel` elements over `world` devices (adding a residual after the sum; or, `broadcast`, giving
  every device the first device's elements): as many blocks (up to MAX_BLOCKS) as whole rounds of THREADS vectors
  need, each block a contiguous chunk; pushed (LL) where `ll` (default: where the call is small enough), else pulled."""
  if residual and broadcast: raise ValueError("a broadcast adds no residual")
  if (reason := unsupported_reason(numel, dtype, world)) is not None: raise ValueError(f"the all-reduce kernel does not take {reason}")
  ll = takes_ll(numel, dtype) if ll is None else ll
  if ll and not takes_ll(numel, dtype): raise ValueError(f"{numel} elements exceed the LL protocol's {LL_MAX_BYTES >> 10} KiB")
  code = dtype_code(dtype)
  vec = 16 // ELEM_BYTES[code]
  vectors = numel // vec
  chunk = cdiv(vectors, min(MAX_BLOCKS, cdiv(vectors, THREADS)))
  grid = cdiv(vectors, chunk)
  defines: dict[str, int | str] = {"TV_DTYPE": code, "TV_NT": THREADS, "TV_N": numel, "TV_CHUNK": chunk * vec,
                                   "TV_SLOT": SLOT_BYTES // ELEM_BYTES[code], "TV_GRID": grid, "TV_RESIDUAL": int(residual),
                                   "TV_BROADCAST": int(broadcast), "TV_LL": int(ll),
                                   **peer_defines(world, numel * ELEM_BYTES[code] // 4)}
  params = (Param("out", "elem", True, numel), Param("partial", "elem", False, numel),
            Param("table", "uint", False, table_words(world)), *([Param("residual", "elem", False, numel)] if residual else []))
  launch = Launch("tv_all_reduce", (grid, 1, 1), THREADS, params)
  return AllReducePlan(numel, world, dtype, residual, broadcast, ll, defines, (launch,))


def device_table(rank: int, exchanges: list[int], signals: list[int]) -> np.ndarray:
  """Device `rank`'s table (uint32 words) from every device's exchange and signal buffer address."""
  words = [rank]
  for x, s in zip(exchanges, signals, strict=True): words += [x & 0xFFFFFFFF, x >> 32, s & 0xFFFFFFFF, s >> 32]
  return np.array(words, dtype=np.uint32)


@functools.cache
def _compiled(numel: int, world: int, dtype: str, residual: bool, broadcast: bool = False) -> tuple[AllReducePlan, str]:
  plan = all_reduce_plan(numel, world, dtype, residual, broadcast)
  return plan, kernel_source("cuda", "all_reduce", plan.defines)


class PeerAllReduce:
  """The collectives of one tensor-parallel group of CUDA devices that reach each other's memory (the backend
  interface's Collectives): the all-reduce, the step inputs' broadcast and the logits' gather, all in its kernel."""

  def __init__(self, group: TensorParallelGroup):
    self.group = group
    # zeros: every flag, launch counter and LL line's number starts at 0 (the kernels count launches from 1)
    self._exchanges = [Tensor.zeros(EXCHANGE_BYTES, dtype=dtypes.uint8, device=d).contiguous().realize() for d in group.devices]
    self._signals = [Tensor.zeros(signal_words(group.size), dtype=dtypes.uint32, device=d).contiguous().realize()
                     for d in group.devices]
    exchanges, signals = [compat.device_address(t) for t in self._exchanges], [compat.device_address(t) for t in self._signals]
    self.table = group.local([Tensor(device_table(rank, exchanges, signals), device=group.first) for rank in range(group.size)])
    group.rank_slots.realize()   # gather_columns' placement, realized now: outside any capture

  def _takes(self, numel: int, dtype: DType) -> bool:
    """Whether the kernel takes `numel` elements of `dtype` over this group (else the group's copies run)."""
    return unsupported_reason(numel, DTYPE_NAMES.get(dtype, dtype.name), self.group.size) is None

  def all_reduce(self, partial: Tensor, residual: Tensor | None = None) -> Tensor:
    """The sum over the group's devices of a local view's per-device values, on every device (residual + it)."""
    if (not self._takes(partial.numel(), partial.dtype)
        or (residual is not None and (residual.dtype != partial.dtype or residual.shape != partial.shape))):
      return self.group.all_reduce(partial, residual)
    plan, source = _compiled(partial.numel(), self.group.size, DTYPE_NAMES[partial.dtype], residual is not None)
    out = Tensor.empty(*partial.shape, dtype=partial.dtype, device=partial.device)
    extra = [] if residual is None else [residual.contiguous()]
    return run_kernel(plan.launches[0], source, [out, partial.contiguous(), self.table, *extra])[0]

  def broadcast(self, t: Tensor) -> Tensor:
    """t (on the first device) on every device, each device reading the first one's memory in one kernel, so the
    step's graph holds no copy between the GPUs for its inputs; one that is not of a 4-byte dtype or does not fit an
    exchange slot is copied (the group's broadcast)."""
    if isinstance(t.device, tuple): return t
    numel = t.numel()
    # whole 16-byte vectors, at least one word of padding: the padded copy is a kernel of its own even where `t` is an
    # input of a captured step (a step's input itself cannot be one device's part of the kernel's multi-device input)
    padded = (numel // 4 + 1) * 4
    if t.dtype.itemsize != 4 or not self._takes(padded, dtypes.float32): return self.group.broadcast(t)
    flat = t.reshape(-1).bitcast(dtypes.float32).pad((0, padded - numel)).contiguous()   # the kernel moves bits, never adds
    stand_ins = [Tensor.empty(padded, dtype=dtypes.float32, device=d) for d in self.group.devices[1:]]   # never read
    plan, source = _compiled(padded, self.group.size, "float32", False, True)
    out = Tensor.empty(padded, dtype=dtypes.float32, device=self.group.devices)
    out = run_kernel(plan.launches[0], source, [out, Tensor(UOp.mstack(flat.uop, *[s.uop for s in stand_ins])), self.table])[0]
    return out[:numel].bitcast(t.dtype).reshape(t.shape)

  def gather_columns(self, local: Tensor) -> Tensor:
    """The shards side by side on the first device: all-reduced among zeros where that fits an exchange slot, so the
    step's graph holds no copy between the GPUs (a copy node costs more there than this kernel); else copied."""
    placed = (*local.shape[:-1], self.group.size * local.shape[-1])
    if not self._takes(int(np.prod(placed)), local.dtype): return self.group.gather_columns(local)
    return self.group.first_of(self.all_reduce(self.group.place_columns(local)))


def collectives_for(group: TensorParallelGroup, dialect: str, log: Callable[[str], None], enabled: bool = True
                    ) -> PeerAllReduce | TensorParallelGroup:
  """The collectives a group's model uses: the peer kernel on CUDA devices that reach each other's memory (unless not
  `enabled`: --disable-custom-all-reduce), else the group's copies and adds (`log` says which)."""
  if enabled and dialect == "cuda" and compat.peers_accessible(group.devices):
    log(f"all-reduce: a kernel on each GPU reading the others' memory ({', '.join(group.devices)})")
    return PeerAllReduce(group)
  why = ("--disable-custom-all-reduce" if not enabled else "no peer access between the GPUs" if dialect == "cuda"
         else f"no peer all-reduce kernel for {dialect}")
  log(f"all-reduce: copies between the devices and adds ({why})")
  return group
