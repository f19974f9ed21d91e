"""The peer all-reduce kernel (csrc/cuda/all_reduce.inc) run on the CPU through the C++ emulation, each device's launch
on a thread of its own (as GPUs run them at once), against the sum it promises: every device's partial added in the
devices' order in float32, rounded once to the dtype, the same bits on every device. Several launches in a row (the
exchange slots alternate, the launch counters and flags carry over), launches of other sizes between them (other
grids), 2 and 4 devices, all three dtypes, a tail block, both protocols (pushed LL lines and pulled slots, and the two
alternating); and what the kernel takes and how a group chooses it."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from tests.emulator.cases import from_bits, to_bits
from tests.emulator.emulator import LazyKernels, Spec, emulate
from tinyvllm.kernels import all_reduce as ar
from tinyvllm.layers.tensor_parallel import TensorParallelGroup

# (elements, devices, dtype): one block with a partial round, several blocks with a tail, the most blocks
CASES = [(4096, 2, "bfloat16"), (3 * 512 * 8 + 40, 2, "float16"), (1000, 4, "float32"), (ar.MAX_BLOCKS * ar.THREADS * 8 * 2, 2, "bfloat16"),
         (2048, 4, "bfloat16")]
RESIDUAL_CASES = [(4096, 2, "bfloat16"), (2048, 4, "float16")]
BROADCAST_CASES = [(8, 4, "float32"), (3 * 512 * 4 + 12, 2, "float32")]   # one block of a step's inputs; several with a tail


PROTOCOLS = [True, False]   # LL (pushed), pulled


def _name(numel: int, world: int, dtype: str, residual: bool = False, broadcast: bool = False, ll: bool = True) -> str:
  return f"ar_{numel}_{world}_{dtype}" + ("_residual" if residual else "") + ("_broadcast" if broadcast else "") + ("_ll" if ll else "")


@pytest.fixture(scope="module")
def emu() -> LazyKernels:
  specs = []
  for cases, residual, broadcast in ((CASES, False, False), (RESIDUAL_CASES, True, False), (BROADCAST_CASES, False, True)):
    for (numel, world, dtype), ll in ((case, ll) for case in cases for ll in PROTOCOLS):
      plan = ar.all_reduce_plan(numel, world, dtype, residual, broadcast, ll)
      specs.append(Spec(_name(numel, world, dtype, residual, broadcast, ll), "all_reduce", plan.defines, plan.launches))
  return emulate("cuda", specs)


class Devices:
  """Each emulated device's exchange and signal buffers (zeroed, as PeerAllReduce allocates them) and its table."""

  def __init__(self, world: int):
    self.exchanges = [np.zeros(ar.EXCHANGE_BYTES, np.uint8) for _ in range(world)]
    self.signals = [np.zeros(ar.signal_words(world), np.uint32) for _ in range(world)]
    addresses = [x.ctypes.data for x in self.exchanges], [s.ctypes.data for s in self.signals]
    self.tables = [ar.device_table(rank, *addresses) for rank in range(world)]

  def all_reduce(self, emu: LazyKernels, partials: list[np.ndarray], dtype: str, order: str = "forward",
                 residual: np.ndarray | None = None, broadcast: bool = False, ll: bool = True) -> list[np.ndarray]:
    """Every device's launch at once on its partial (float32 values representable in dtype), with the residual given
    to every device's; each device's result."""
    return self.queued(emu, [Call(partials, dtype, residual, broadcast, ll)], order)[0]

  def queued(self, emu: LazyKernels, calls: list[Call], order: str = "forward") -> list[list[np.ndarray]]:
    """Each device runs its launches of `calls` back to back on a thread of its own (as a GPU runs its queue, never
    waiting for the host between them); each call's results, a list of each device's."""
    world = len(calls[0].partials)
    outs = [[np.full(c.partials[0].size, 0x7FC0 if c.dtype != "float32" else np.nan, np.uint16 if c.dtype != "float32" else np.float32)
             for _ in range(world)] for c in calls]
    for c in calls: emu.library(c.name)   # built before the threads start, once

    def run(rank: int) -> None:
      for c, out in zip(calls, outs, strict=True):
        extra = [] if c.residual is None else [to_bits(c.residual, c.dtype)]
        emu.launch(c.name, 0, [out[rank], to_bits(c.partials[rank], c.dtype), self.tables[rank], *extra], order)
    on_every_device(world, run)
    return outs


def on_every_device(world: int, run: Callable[[int], None]) -> None:
  """run(rank) for every device at once, each on a thread of its own (as GPUs run their queues); a launch that never
  meets the others' fails the test instead of hanging it."""
  errors: list[BaseException] = []

  def guarded(rank: int) -> None:
    try: run(rank)
    except BaseException as e: errors.append(e)
  threads = [threading.Thread(target=guarded, args=(rank,), daemon=True) for rank in range(world)]
  for t in threads: t.start()
  for t in threads: t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "the devices' launches never met (a deadlock)"
  assert not errors, errors


@dataclass
class Call:
  """One all-reduce (or broadcast) call of every device: each device's partial."""
  partials: list[np.ndarray]
  dtype: str
  residual: np.ndarray | None = None
  broadcast: bool = False
  ll: bool = True

  @property
  def name(self) -> str:
    return _name(self.partials[0].size, len(self.partials), self.dtype, self.residual is not None, self.broadcast, self.ll)


def _partials(rng: np.random.Generator, numel: int, world: int, dtype: str) -> list[np.ndarray]:
  return [from_bits(to_bits((rng.standard_normal(numel) * 4).astype(np.float32), dtype), dtype) for _ in range(world)]


def _expected(partials: list[np.ndarray], dtype: str) -> np.ndarray:
  total = partials[0].astype(np.float32)
  for p in partials[1:]: total = total + p.astype(np.float32)
  return to_bits(total, dtype)


@pytest.mark.parametrize("ll", PROTOCOLS, ids=["ll", "pull"])
@pytest.mark.parametrize("numel,world,dtype", CASES)
def test_every_device_gets_the_ordered_float32_sum(emu, numel, world, dtype, ll):
  devices, rng = Devices(world), np.random.default_rng(numel + world)
  for launch in range(3):   # the slots alternate and the counters carry over
    partials = _partials(rng, numel, world, dtype)
    outs = devices.all_reduce(emu, partials, dtype, order=("forward", "reverse", "random")[launch], ll=ll)
    for rank, out in enumerate(outs): assert np.array_equal(out, _expected(partials, dtype)), f"launch {launch}, device {rank}"


@pytest.mark.parametrize("ll", PROTOCOLS, ids=["ll", "pull"])
@pytest.mark.parametrize("numel,world,dtype", RESIDUAL_CASES)
def test_a_residual_is_added_to_the_rounded_sum(emu, numel, world, dtype, ll):
  """residual + sum, the sum rounded to the dtype first: the model's add after the portable all-reduce, bit for bit."""
  devices, rng = Devices(world), np.random.default_rng(numel)
  for launch in range(2):
    partials, residual = _partials(rng, numel, world, dtype), _partials(rng, numel, 1, dtype)[0]
    want = to_bits(residual + from_bits(_expected(partials, dtype), dtype), dtype)
    for rank, out in enumerate(devices.all_reduce(emu, partials, dtype, residual=residual, ll=ll)):
      assert np.array_equal(out, want), f"launch {launch}, device {rank}"


def test_launches_of_other_sizes_between_keep_the_exchange_consistent(emu):
  """Launches of two sizes (grids of other block counts) and both protocols alternate on the same buffers, as a step's
  all-reduces of different shapes do: each block's counter and flags stay in step across the devices."""
  devices, rng = Devices(2), np.random.default_rng(7)
  big = ar.MAX_BLOCKS * ar.THREADS * 8 * 2
  sizes = [(4096, "bfloat16", True), (big, "bfloat16", False), (4096, "bfloat16", False), (3 * 512 * 8 + 40, "float16", True),
           (big, "bfloat16", True), (4096, "bfloat16", True), (big, "bfloat16", False), (3 * 512 * 8 + 40, "float16", False)]
  for numel, dtype, ll in sizes:
    partials = _partials(rng, numel, 2, dtype)
    for out in devices.all_reduce(emu, partials, dtype, ll=ll): assert np.array_equal(out, _expected(partials, dtype))
  counters = [s[ar.MAX_BLOCKS * 2:ar.MAX_BLOCKS * 3] for s in devices.signals]
  # every block index's counter counts every launch (block 0 moves those its grid lacks): one slot for a whole launch
  assert all(np.array_equal(c, np.full(ar.MAX_BLOCKS, len(sizes))) for c in counters)


@pytest.mark.parametrize("ll", PROTOCOLS, ids=["ll", "pull"])
@pytest.mark.parametrize("numel,world,dtype", BROADCAST_CASES)
def test_a_broadcast_gives_every_device_the_first_ones_bits(emu, numel, world, dtype, ll):
  """The step inputs' broadcast: device 0's int32 words (NaN and subnormal patterns among them: moved, never added) on
  every device, between all-reduces on the same buffers (the counters stay in step, the slots alternate)."""
  devices, rng = Devices(world), np.random.default_rng(numel)
  for launch in range(3):
    words = rng.integers(-2**31, 2**31, numel, dtype=np.int64).astype(np.int32)
    words[:3] = [0x7FC00001, 0x00000001, -1]   # a NaN with a payload, the smallest subnormal, all bits set
    partials = [words.view(np.float32)] + [np.full(numel, np.float32(launch + 1)) for _ in range(world - 1)]
    for rank, out in enumerate(devices.all_reduce(emu, partials, dtype, order=("forward", "reverse", "random")[launch],
                                                  broadcast=True, ll=ll)):
      assert np.array_equal(out.view(np.int32), words), f"launch {launch}, device {rank}"
    between, between_dtype = next((n, d) for n, w, d in CASES if w == world)   # an all-reduce between broadcasts
    sums = _partials(rng, between, world, between_dtype)
    for out in devices.all_reduce(emu, sums, between_dtype, ll=not ll): assert np.array_equal(out, _expected(sums, between_dtype))


@pytest.mark.parametrize("ll", PROTOCOLS, ids=["ll", "pull"])
def test_a_device_queueing_broadcasts_back_to_back_never_runs_ahead(emu, ll):
  """A step's launches queued on each device with nothing between them: the first device of a broadcast has nothing
  to receive, yet it must not finish before the others have arrived, else two broadcasts later it would overwrite
  what a slower device has yet to read (their lines or slot, and their launch number, would never be this launch's)."""
  numel, world, dtype = BROADCAST_CASES[0]
  devices, rng = Devices(world), np.random.default_rng(3)
  words = [rng.integers(-2**31, 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(5)]
  calls = [Call([w.view(np.float32)] + [np.zeros(numel, np.float32)] * (world - 1), dtype, broadcast=True, ll=ll) for w in words]
  between, between_dtype = next((n, d) for n, w, d in CASES if w == world)
  sums = _partials(rng, between, world, between_dtype)
  results = devices.queued(emu, [*calls, Call(sums, between_dtype, ll=ll)], order="reverse")
  for w, outs in zip(words, results, strict=False):
    assert all(np.array_equal(out.view(np.int32), w) for out in outs)
  assert all(np.array_equal(out, _expected(sums, between_dtype)) for out in results[-1])


def test_plan_blocks_and_refusals():
  one = ar.all_reduce_plan(4096, 2, "bfloat16")   # 512 vectors: one block of 512 threads
  assert one.launches[0].grid == (1, 1, 1) and one.defines["TV_CHUNK"] == 4096
  big = ar.all_reduce_plan(ar.MAX_BLOCKS * ar.THREADS * 8 * 2, 2, "bfloat16")
  assert big.launches[0].grid == (ar.MAX_BLOCKS, 1, 1) and big.defines["TV_CHUNK"] == ar.THREADS * 8 * 2
  tail = ar.all_reduce_plan(3 * 512 * 8 + 40, 2, "float16")
  grid, chunk = tail.launches[0].grid[0], tail.defines["TV_CHUNK"]
  assert (grid - 1) * chunk < 3 * 512 * 8 + 40 <= grid * chunk
  assert "16-byte vectors" in ar.unsupported_reason(4100, "bfloat16", 2)
  assert "exchange slot" in ar.unsupported_reason(ar.SLOT_BYTES // 2 + 8, "bfloat16", 2)
  assert "devices" in ar.unsupported_reason(4096, "bfloat16", 9)
  assert ar.unsupported_reason(4096, "float64", 2) == "dtype float64"
  assert one.ll and one.defines["TV_LL"] == 1   # a decode step's call pushes
  assert not ar.all_reduce_plan(ar.LL_MAX_BYTES // 2 + 8, 2, "bfloat16").ll   # a larger one pulls
  with pytest.raises(ValueError, match="LL protocol"): ar.all_reduce_plan(ar.LL_MAX_BYTES // 2 + 8, 2, "bfloat16", ll=True)
  assert ar.MAX_WORLD * 2 * ar.LL_MAX_BYTES <= ar.LL_SLOT_BYTES   # every device's lines fit an LL slot
  assert [p.name for p in ar.all_reduce_plan(4096, 2, "bfloat16", residual=True).launches[0].params] == \
    ["out", "partial", "table", "residual"]
  with pytest.raises(ValueError, match="does not take"): ar.all_reduce_plan(4100, 2, "bfloat16")


def test_a_group_without_peer_access_uses_the_copies_and_adds():
  """On the CPU (no CUDA, no peer access) the model's collectives are the group's portable ones, and the log says why."""
  group, said = TensorParallelGroup(("CPU:0", "CPU:1")), []
  assert ar.collectives_for(group, "metal", said.append) is group
  assert ar.collectives_for(group, "cuda", said.append) is group
  assert ar.collectives_for(group, "cuda", said.append, enabled=False) is group
  assert said == ["all-reduce: copies between the devices and adds (no peer all-reduce kernel for metal)",
                  "all-reduce: copies between the devices and adds (no peer access between the GPUs)",
                  "all-reduce: copies between the devices and adds (--disable-custom-all-reduce)"]


def test_disable_custom_all_reduce_reaches_the_kernels():
  """vLLM's --disable-custom-all-reduce is a real switch: it sets the backend's kernel options."""
  from tinyvllm.engine_args import engine_config
  assert engine_config("m", {"disable_custom_all_reduce": True}).kernel_options().custom_all_reduce is False
  assert engine_config("m", {}).kernel_options().custom_all_reduce is True
