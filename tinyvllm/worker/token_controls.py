"""A step's token controls on the host: per logits row, the sparse bias and the bitmask of allowed tokens that
layers/token_controls.py applies on the device (vLLM's semantics for each):

- logit_bias: added to the token's logit;
- bad_words: a one-token word is always banned (-inf); a longer word's last token is banned when the output ends with
  its other tokens;
- min_tokens: EOS (unless ignore_eos) and stop_token_ids are banned while the row's token would come before it;
- allowed_token_ids: a bitmask row with only their bits set;
- structured output: the sequence's grammar fills its bitmask rows (core/structured_output.py), ANDed with
  allowed_token_ids.
A verification step has 1 + k rows per sequence: row j samples the token after the sequence's output and its first j
proposals, so its controls see them as output. Rows without controls get no bias and an all-ones mask row; a step
without any control sends neither array.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.core.sequence import Sequence
from tinyvllm.core.structured_output import BitmaskFiller, StructuredOutputGrammar

MIN_BIAS_LEN = 16   # bias arrays are padded to a power of two >= this, so that captures are reused


@dataclass
class TokenControls:
  bias_index: np.ndarray | None = None   # [R, L] int32: row * V + token, -1 for padding
  bias_value: np.ndarray | None = None   # [R, L] float32
  bitmask: np.ndarray | None = None      # [R, ceil(V / 32)] int32, bit set = allowed (llguidance's layout)
  # what fill_bitmask writes into bitmask: (sequence with a grammar, its first row, its proposals) and
  # allowed_token_ids by row
  grammar_rows: list[tuple[Sequence, int, list[int]]] = field(default_factory=list)
  allowed_rows: dict[int, list[int]] = field(default_factory=dict)
  filler: BitmaskFiller | None = None
  pool: ThreadPoolExecutor | None = None   # the builder's thread for start_fill
  _filling: Future | None = None

  def start_fill(self) -> None:
    """Begin fill_bitmask on the builder's thread (llguidance computes the masks with the GIL released), so the
    caller's other host work runs meanwhile; fill_bitmask then waits for it. Returns once the thread runs: a thread
    waiting for the GIL gets it only when the holder blocks or after the switch interval (5 ms), so while the caller
    ran Python the fill often started only when fill_bitmask waited for it (1.6 ms after start_fill, median, on the
    CPU bench). (One long-lived thread: a new thread a step took 0.6 ms a step to start on a busy host.)"""
    if self._filling is not None or self.bitmask is None or self.pool is None: return
    running = threading.Event()
    self._filling = self.pool.submit(self._fill, running)
    running.wait()   # (the GIL released: the thread takes it, and hands it back at llguidance's call)

  def fill_bitmask(self) -> None:
    """The grammars' rows, all ones into the others, then allowed_token_ids ANDed in, into `bitmask` in place (the
    array `fields` hands out). Each grammar must have taken every earlier token of its sequence: the step's launch
    calls this, after the step before has landed (build runs earlier, while that step may still be in flight). A
    sequence that ended meanwhile gets all-ones rows: its token is dropped when it lands."""
    if self._filling is None: return self._fill()
    self._filling.result()   # (raises what the fill raised)

  def _fill(self, running: threading.Event | None = None) -> None:
    if running is not None: running.set()
    if self.bitmask is None: return
    rows = [r for seq, row, proposals in self.grammar_rows if not seq.is_finished
            and (r := _constrained_rows(seq.grammar, row, proposals)) is not None]
    _set_all_ones_but(self.bitmask, [row for _, row, proposals in rows if not proposals])
    if rows:
      assert self.filler is not None
      self.filler.fill(rows, self.bitmask)
    words = self.bitmask.shape[1]
    for row, token_ids in self.allowed_rows.items(): self.bitmask[row] &= allowed_row(token_ids, words)

  def fields(self) -> dict[str, np.ndarray]:
    """The packed input's int32 fields (the bias values bit-cast)."""
    out: dict[str, np.ndarray] = {}
    if self.bias_index is not None and self.bias_value is not None:
      out["bias_index"], out["bias_value"] = self.bias_index, self.bias_value.view(np.int32)
    if self.bitmask is not None: out["bitmask"] = self.bitmask
    return out


def has_controls(seq: Sequence) -> bool:
  p = seq.params
  return (bool(p.logit_bias or p.allowed_token_ids or p.bad_words) or seq.grammar is not None
          or seq.num_output_tokens < p.min_tokens)


def stop_token_ids(seq: Sequence) -> list[int]:
  """What min_tokens holds back: the ids that would end the sequence."""
  return list(seq.params.stop_token_ids or []) + ([] if seq.params.ignore_eos else sorted(seq.eos_token_ids))


def row_bias(seq: Sequence, index: int, proposals: list[int], vocab_size: int) -> dict[int, float]:
  """The bias of the row sampling seq's output token `index`, after its output and `proposals`."""
  p = seq.params
  bias = {t: float(v) for t, v in (p.logit_bias or {}).items() if v != 0}
  banned: list[int] = []
  for word in p.bad_words_token_ids:
    prefix = word[:-1]
    if not prefix: banned.append(word[-1])
    else:
      history = (seq.output_token_ids + proposals)[-len(prefix):]
      if history == prefix: banned.append(word[-1])
  if index < p.min_tokens: banned += stop_token_ids(seq)
  bias.update(dict.fromkeys(banned, float("-inf")))
  return {t: v for t, v in bias.items() if 0 <= t < vocab_size}


def allowed_row(token_ids: list[int], words: int) -> np.ndarray:
  """A bitmask row ([words] int32) with the bits of token_ids set."""
  ids = np.asarray(token_ids, np.int64)
  ids = ids[ids < words * 32]
  row = np.zeros(words, np.uint32)
  np.bitwise_or.at(row, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
  return row.view(np.int32)


def _constrained_rows(grammar: StructuredOutputGrammar | None, row: int, proposals: list[int]
                      ) -> tuple[StructuredOutputGrammar, int, list[int]] | None:
  """What the filler computes for a sequence's rows (grammar, first row, proposals): all of them once its reasoning has
  ended; while it reasons, the rows after a proposal that ends it (their masks: the grammar's from its start), or none
  (free rows keep all ones)."""
  if grammar is None: return None
  if grammar.active: return grammar, row, proposals
  if grammar.reasoning_end not in proposals: return None
  at = proposals.index(grammar.reasoning_end)
  return grammar, row + at + 1, proposals[at + 1:]


def _set_all_ones_but(bitmask: np.ndarray, written: list[int]) -> None:
  """All ones into every row of bitmask but `written`, the rows llguidance computes whole (a grammar row without
  proposals: it writes each of its words). With every row a grammar's (a structured batch) nothing is written here:
  setting the 1.2 MB of a 64-row mask on Qwen3's vocabulary each step cost ~0.2 ms on a busy host. A verification's
  rows stay all ones first: llguidance leaves those after the first proposal the grammar rejects as they were."""
  if len(written) == len(bitmask): return   # (rows are distinct: each row is one sequence's)
  free = np.ones(len(bitmask), bool)
  free[written] = False
  bitmask[free] = -1


def _bucket(n: int) -> int: return max(MIN_BIAS_LEN, 1 << (max(n, 1) - 1).bit_length())


class TokenControlsBuilder:
  """Builds each step's controls; holds the structured-output bitmask filler (llguidance's threads), made when first
  needed."""

  def __init__(self, vocab_size: int, host_array: Callable[[tuple[int, ...]], np.ndarray] | None = None):
    """host_array: makes the bitmask arrays (the runner's uploads' host memory: pinned on CUDA)."""
    self.vocab_size, self.words = vocab_size, -(-vocab_size // 32)
    self._host_array = host_array or (lambda shape: np.empty(shape, np.int32))
    self._filler: BitmaskFiller | None = None
    self._pool: ThreadPoolExecutor | None = None
    self._bitmasks: dict[int, list[np.ndarray]] = {}   # padded rows -> the two arrays _bitmask hands out in turn

  def build(self, seqs: list[Sequence], steps: list[int], drafts: np.ndarray, spec_rows: int, padded_rows: int) -> TokenControls:
    """seqs[i] samples rows i * spec_rows .. + spec_rows - 1 (its output token steps[i] + j, after its drafts[i, :j];
    -1 past its own proposals)."""
    biases: dict[int, dict[int, float]] = {}
    allowed: dict[int, list[int]] = {}
    grammars: list[tuple[Sequence, int, list[int]]] = []
    for i, (seq, step) in enumerate(zip(seqs, steps, strict=True)):
      if not has_controls(seq): continue
      proposals = [int(t) for t in drafts[i] if t >= 0] if spec_rows > 1 else []
      p = seq.params
      biased = bool(p.logit_bias or p.bad_words_token_ids) or step < p.min_tokens   # (a grammar alone has no bias)
      for j in range(spec_rows):
        if biased and (bias := row_bias(seq, step + j, proposals[:j], self.vocab_size)): biases[i * spec_rows + j] = bias
        if p.allowed_token_ids: allowed[i * spec_rows + j] = p.allowed_token_ids
      if seq.grammar is not None: grammars.append((seq, i * spec_rows, proposals))
    controls = TokenControls(grammar_rows=grammars, allowed_rows=allowed)
    if biases: controls.bias_index, controls.bias_value = self._bias_arrays(biases, padded_rows)
    if allowed or grammars:   # written whole by fill_bitmask
      controls.bitmask = self._bitmask(padded_rows)
      if grammars and self._filler is None:
        self._filler, self._pool = BitmaskFiller(), ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-masks")
      controls.filler, controls.pool = self._filler, self._pool
    return controls

  def _bitmask(self, rows: int) -> np.ndarray:
    """A [rows, words] bitmask, its contents left as they were until fill_bitmask writes every row: one of two arrays
    kept per row count, taken in turn. Two, because a step's masks may still wait to be filled and uploaded while the
    next step is built (a split grammar step: engine/core.py); it is free again once that step has landed (on CUDA the
    device copies it from pinned memory as the step runs), which comes before the step after next fills its masks
    (the engine launches a step with at most the one before it in flight). (A fresh 1.2 MB array each step, at batch
    64 on Qwen3's vocabulary, cost ~0.25 ms of page faults while the other one was alive.)"""
    ring = self._bitmasks.setdefault(rows, [])
    if len(ring) < 2: ring.append(self._host_array((rows, self.words)))
    else: ring.append(ring.pop(0))
    return ring[-1]

  def _bias_arrays(self, biases: dict[int, dict[int, float]], padded_rows: int) -> tuple[np.ndarray, np.ndarray]:
    length = _bucket(max(len(b) for b in biases.values()))
    index, value = np.full((padded_rows, length), -1, np.int32), np.zeros((padded_rows, length), np.float32)
    for row, bias in biases.items():
      index[row, :len(bias)] = row * self.vocab_size + np.fromiter(bias.keys(), np.int64, len(bias))
      value[row, :len(bias)] = np.fromiter(bias.values(), np.float32, len(bias))
    return index, value
