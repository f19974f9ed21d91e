"""The engine's custom logits processors (layers/logits_processor.py's interface) around the model runner's steps.

The runner's rows are rebuilt every step, in the scheduler's order; the processors see them as vLLM's persistent batch:
`batch_update` compares the step's sampling rows with the last step's and says what changed (a new sequence takes a
row left free, else a new one at the end; the rest are swapped into place).
"""
from __future__ import annotations

import importlib
from typing import Any

from tinygrad import Tensor

from tinyvllm.core.sequence import Sequence
from tinyvllm.layers.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


def processor_class(spec: str | type) -> type[LogitsProcessor]:
  """A LogitsProcessor subclass, or its qualified name ("package.module.Class" or "package.module:Class")."""
  cls: Any = spec
  if isinstance(spec, str):
    module, _, name = spec.replace(":", ".").rpartition(".")
    try: cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
      raise ValueError(f"logits_processors: cannot import {spec!r}: {e}") from None
  if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
    raise ValueError(f"logits_processors: {spec!r} is not a subclass of tinyvllm.layers.logits_processor.LogitsProcessor")
  return cls


def batch_update(old: list[Sequence | None], new: list[Sequence]) -> tuple[BatchUpdate | None, list[Sequence | None]]:
  """What turns the rows `old` into `new` (None: nothing), and the rows after it (`new`)."""
  new_ids = {s.seq_id for s in new}
  rows, free = list(old), [i for i, s in enumerate(old) if s is None or s.seq_id not in new_ids]
  gone, kept = {i for i in free if old[i] is not None}, {s.seq_id for s in old if s is not None} & new_ids
  added = []
  for seq in (s for s in new if s.seq_id not in kept):
    row = free.pop(0) if free else len(rows)   # a row left free (its request is replaced), else one at the end
    if row == len(rows): rows.append(None)
    gone.discard(row)
    rows[row] = seq
    added.append((row, seq.params, seq.prompt_token_ids, seq.output_token_ids))
  for row in gone: rows[row] = None
  where = {s.seq_id: i for i, s in enumerate(rows) if s is not None}
  moved = []
  for row, seq in enumerate(new):
    at, other = where[seq.seq_id], rows[row]
    if at == row: continue
    moved.append((at, row, MoveDirectionality.SWAP if other is not None else MoveDirectionality.UNIDIRECTIONAL))
    rows[at], rows[row], where[seq.seq_id] = other, seq, row
    if other is not None: where[other.seq_id] = at
  if not (added or gone or moved) and len(new) == len(old): return None, list(new)
  return BatchUpdate(len(new), sorted(gone), added, moved), list(new)


class LogitsProcessors:
  """The processors of one engine, built once, and the batch they last saw."""

  def __init__(self, classes: list[type[LogitsProcessor]], config: Any, device: str):
    self.processors = [cls(config, device, False) for cls in classes]
    self._rows: list[Sequence | None] = []
    self._all_greedy = False

  def update(self, seqs: list[Sequence]) -> None:
    """Before a step: tell each processor how its batch changed."""
    update, self._rows = batch_update(self._rows, seqs)
    self._all_greedy = all(s.params.greedy for s in seqs)
    for processor in self.processors: processor.update_state(update)

  def apply(self, logits: Tensor) -> Tensor:
    """The step's logits [padded rows, V] through every processor (argmax-invariant ones not in all-greedy steps), each
    seeing the batch's rows only."""
    rows = len(self._rows)
    batch, padding = logits[:rows], logits[rows:]
    for processor in self.processors:
      if not (self._all_greedy and processor.is_argmax_invariant()): batch = processor.apply(batch)
    return batch.cat(padding) if padding.shape[0] else batch
