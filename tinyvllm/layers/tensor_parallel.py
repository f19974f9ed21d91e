"""Tensor parallelism's devices and collectives, on tinygrad's multi-device tensors.

The model runs on every device of the group at once, each device on its share: a tinygrad tensor whose device is the
group's tuple of devices is computed on all of them. Its weights are *local views*: device i's buffer holds shard i (q,
k and v of its heads, its columns of gate/up, its rows of o and down, its part of the vocabulary), the tensor's shape
is the shard's, and every op on it runs per device on that device's shard. So a layer runs exactly as on one device
(the hand-written kernels included), on H / tp heads and I / tp intermediate columns; only the products whose
reduction runs over the shards (o and down, the vocabulary-split embedding) meet: their per-device partial sums are
copied to every device and summed there (`all_reduce`), and the vocabulary-split logits are viewed as one tensor
sharded on the vocabulary and copied to the first device (`gather_columns`), where the sampler runs. Activations
between layers are replicated: the same values on every device. A backend may run these collectives in kernels of its
own (tinyvllm/kernels/all_reduce.py); the group's are the portable ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tinygrad import Tensor, UOp

if TYPE_CHECKING:
  from tinyvllm.backend.interface import Collectives


@dataclass(frozen=True)
class TensorParallelGroup:
  devices: tuple[str, ...]   # device i holds shard i

  @property
  def size(self) -> int: return len(self.devices)

  @property
  def first(self) -> str: return self.devices[0]

  def local(self, parts: list[Tensor]) -> Tensor:
    """A realized local view: device i's buffer holds parts[i] (equal shapes and dtypes)."""
    if len(parts) != self.size: raise ValueError(f"{len(parts)} shards for {self.size} devices")
    stacked = Tensor.stack(*parts).shard(self.devices, axis=0).contiguous().realize()
    return Tensor(_local_of(stacked)).reshape(parts[0].shape)

  def replicate(self, t: Tensor) -> Tensor:
    """t copied to every device, realized (a weight every shard needs whole: norms, RoPE tables)."""
    return t.to(self.devices).contiguous().realize()

  def broadcast(self, t: Tensor) -> Tensor:
    """t (on the first device) on every device, lazily: a step's inputs. Broadcast a whole buffer (the step's packed
    input) or a computed tensor, not a slice of a buffer: tinygrad copies a slice from a view at its offset, which the
    CPU's vectorised loads (they assume 16-byte alignment) read out of line."""
    return t if isinstance(t.device, tuple) else t.to(self.devices)

  def all_reduce(self, partial: Tensor, residual: Tensor | None = None) -> Tensor:
    """The sum over devices of a local view's per-device values, replicated on every device (plus `residual`, added to
    the sum rounded to its dtype): each device adds every shard (copied to it), in the same order everywhere (so that
    every device gets the same bits), in float32.
    Written as copies and adds rather than tinygrad's ALLREDUCE op, which runs as a function call of its own between
    two CUDA graphs: 72 of them split a Qwen3-8B decode step into as many graphs, 3.8 ms of host time a step."""
    shards = [Tensor(partial.uop.mselect(i)) for i in range(self.size)]
    total = [functools.reduce(lambda a, b: a + b, [s.to(device).float() for s in shards]).cast(partial.dtype)
             for device in self.devices]
    out = Tensor(UOp.mstack(*[t.uop for t in total]))
    return out if residual is None else residual + out

  def gather_columns(self, local: Tensor) -> Tensor:
    """A local view's shards side by side along its last axis, on the first device."""
    return Tensor(local.uop.unshard(local.ndim - 1)).to(self.first)

  @functools.cached_property
  def rank_slots(self) -> Tensor:
    """A local view of bools [size]: device i's is one-hot at i (realized on first use: before any capture)."""
    return self.local([Tensor(np.arange(self.size) == rank, device=self.first) for rank in range(self.size)])

  def place_columns(self, local: Tensor) -> Tensor:
    """A local view [..., size * n] where device i holds its shard [..., n] in columns i*n..(i+1)*n and zeros
    elsewhere: all-reduced, the shards side by side (each column the sum of one value and zeros: exact)."""
    slots = self.rank_slots.reshape(*(1,) * (local.ndim - 1), self.size, 1)
    placed = slots.where(local.unsqueeze(-2), 0)
    return placed.reshape(*local.shape[:-1], self.size * local.shape[-1])

  def first_of(self, replicated: Tensor) -> Tensor:
    """The first device's buffer of a tensor with a value on every device (no copy)."""
    return Tensor(replicated.uop.mselect(0))


def _local_of(sharded: Tensor):
  """The per-device value under a realized sharded tensor (tinygrad's UNSHARD of the shards' buffer)."""
  uop = sharded.uop
  if uop.op.name != "UNSHARD": raise RuntimeError(f"expected a realized sharded tensor, got {uop.op}")
  return uop.src[0]


def group_devices(device: str, size: int) -> tuple[str, ...]:
  """`size` consecutive devices of `device`'s backend, from its index (CUDA -> CUDA:0, CUDA:1, ...; CUDA:2 -> CUDA:2, ...)."""
  backend, _, index = device.partition(":")
  start = int(index) if index.isdigit() else 0
  return tuple(f"{backend}:{start + i}" for i in range(size))


def broadcast_together(collectives: Collectives, tensors: list[Tensor]) -> list[Tensor]:
  """The tensors (of one 4-byte dtype; on the group's first device, or already on every device) on every device, those
  to move in one broadcast. Why one: a backend's collective kernels must reach every device in the same order, and a
  CUDA graph runs kernels that do not depend on each other in any order, so a step's collectives follow one another
  by their data (the inputs' one broadcast, then the all-reduces layer by layer, then the logits' gather)."""
  moving = [i for i, t in enumerate(tensors) if not isinstance(t.device, tuple)]
  if not moving: return tensors
  if len({tensors[i].dtype for i in moving}) > 1: raise ValueError("broadcast_together takes tensors of one dtype")
  flat = [tensors[i].reshape(-1) for i in moving]
  moved, out, offset = collectives.broadcast(flat[0].cat(*flat[1:]) if len(flat) > 1 else flat[0]), list(tensors), 0
  for i in moving:
    out[i], offset = moved[offset:offset + tensors[i].numel()].reshape(tensors[i].shape), offset + tensors[i].numel()
  return out
