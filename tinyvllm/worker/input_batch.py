"""Host-side step inputs: one scheduled batch flattened into named int32 arrays, padded to bucket sizes.

Padding keeps the number of distinct shapes (hence compiled kernels and JIT captures) small: N tokens, S query rows,
the query run Tq and the context length L are each rounded up to a power of two (StepBuckets: a backend whose padding
costs little takes coarser ones). Padding tokens write nowhere (slot -1); padding rows have context length 0.

A query row is normally one sequence's run of new tokens, so Tq is the longest run. A backend that computes every
padded query (the portable attention: [S, Tq, L] scores) may have runs cut into rows of a shorter Tq instead, rows
of one sequence sharing its block table: a step with one 64-token prompt chunk and seven decodes is then 16 rows of 8
queries (128 query slots) rather than 8 rows of 64 (512).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from tinyvllm.core.scheduler_output import ScheduledSequence
from tinyvllm.core.sequence import Sequence


def bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return 1 << (max(n, minimum) - 1).bit_length()


COARSE_QUERY_RUNS = (64, 256, 1024, 4096, 16384, 65536)   # powers of four from 64 (coarse_query_runs)


@dataclass(frozen=True)
class StepBuckets:
  """How coarsely a backend's steps are padded. The fused kernels skip padding rows and padded queries, so they take
  coarse buckets for steps with prompt chunks: few enough layouts that all of them (at the smallest context bucket)
  are captured at start-up."""
  min_context: int = 16          # the smallest context bucket L
  min_prefill_rows: int = 1      # the fewest query rows (and sampling rows) of a step with prompt chunks
  split_runs: bool = False       # cut query runs into rows of the Tq with the fewest padded query slots (module docstring)
  min_prompt_tokens: int = 1     # the fewest token rows N of a step with prompt chunks
  coarse_query_runs: bool = False   # Tq of a step with prompt chunks from COARSE_QUERY_RUNS (at most N)
  # a step verifying proposals of at most this many tokens is laid out as decode rows (Tq = 1, a row a token, the rows
  # of a sequence sharing its block table, no padding rows): a backend's decode kernels (the persistent layer kernel)
  # then take it
  decode_verify_tokens: int = 0

  def tokens(self, n_real: int, multi_token: bool) -> int:
    """N: the token rows of a step of n_real tokens."""
    return bucket(n_real, self.min_prompt_tokens if multi_token else 1)

  def query_runs(self, num_tokens: int) -> list[int]:
    """Every Tq a step with prompt chunks in N = num_tokens token rows may take (runs not split)."""
    if not self.coarse_query_runs: return [1 << i for i in range(1, num_tokens.bit_length())]
    # a run of r tokens takes the first coarse Tq >= r: the first takes every short run, the others runs over tq / 4
    return sorted({min(tq, num_tokens) for tq in COARSE_QUERY_RUNS if tq == COARSE_QUERY_RUNS[0] or tq // 4 < num_tokens})


@dataclass
class HostBatch:
  arrays: dict[str, np.ndarray]   # the step metadata, all int32 (see prepare_batch for each one's meaning)
  context_len: int                # L: keys gathered per sequence by the portable attention
  sample_seqs: list[Sequence]     # the sequence each sampling row is for (forks share their parent's logits row)
  sample_steps: list[int]         # the index in its sequence's output of each row's token (the sampler's noise step)
  prompt_chunks: bool = False     # some sequence computes prompt tokens (more than its last token and its proposals)
  spec_rows: int = 1              # logits rows per sampling sequence: 1, or 1 + k when the step verifies proposals

  def __getattr__(self, name: str) -> np.ndarray:
    try: return self.__dict__["arrays"][name]
    except KeyError: raise AttributeError(name) from None


def _empty(n: int, s: int, tq: int, max_blocks: int) -> dict[str, np.ndarray]:
  z = lambda *shape: np.zeros(shape, np.int32)
  return {
    "token_ids": z(n), "positions": z(n),
    "token_source": np.full(n, -1, np.int32),   # row of the previous step's samples holding the token (-1: token_ids)
    "slot_mapping": np.full(n, -1, np.int32),   # cache slot each new token's K/V goes to (-1: padding, not written)
    "output_index": z(n),                       # where each flat token's output sits in the [S * Tq] padded layout
    "block_tables": z(s, max_blocks),           # physical block of each logical block
    "query_index": z(s, tq), "query_pos": z(s, tq),   # flat index and position of each padded query
    "context_lens": z(s),                       # keys visible to each row's last query (0: padding)
    "new_keys": z(s),                           # keys of them this step computes (0: padding)
    "row_order": z(s),                          # the rows by descending context_lens: attention's launch order
    "query_start": z(s + 1),                    # flat offset of each row's first new token (exclusive scan)
  }


def launch_order(context_lens: np.ndarray) -> np.ndarray:
  """The rows by descending context (ties in row order; padding rows, 0, last): attention's blocks start in this order,
  so the longest rows' blocks do not start last and leave the GPU waiting on a few of them (an H200, 256 rows of
  contexts uniform in [100, 2,048], GQA 8: the tensor-core decode form 192 -> 162 µs a layer)."""
  return np.argsort(-context_lens, kind="stable").astype(np.int32)


def _fill_tokens(a: dict[str, np.ndarray], scheduled: list[ScheduledSequence], starts: np.ndarray, n_real: int) -> None:
  """Token ids of the flat tokens. A token still in flight (asynchronous scheduling: always the last of its run) is left
  0 here and taken on the device from the previous step's samples, row `token_source`."""
  sources = np.fromiter((item.token_source for item in scheduled), np.int32, len(scheduled))
  in_flight = sources >= 0
  runs = (item.seq.token_slice(item.start, item.start + item.num_new_tokens - int(f) - len(item.spec_token_ids))
          + list(item.spec_token_ids) for item, f in zip(scheduled, in_flight, strict=True))
  if in_flight.any(): runs = (run + [0] * int(f) for run, f in zip(runs, in_flight, strict=True))
  a["token_ids"][:n_real] = np.fromiter(chain.from_iterable(runs), np.int32, n_real)
  if in_flight.any(): a["token_source"][(starts[1:] - 1)[in_flight]] = sources[in_flight]


def query_run_length(counts: np.ndarray, longest_run: int, buckets: StepBuckets, num_tokens: int,
                     prompt_chunks: bool = True) -> int:
  """Tq: the longest run rounded up (coarse_query_runs, for a step with prompt chunks: to COARSE_QUERY_RUNS, at most the
  step's N tokens), or
  (split_runs) the power of two whose rows hold the runs in the fewest padded query slots (rows rounded up as
  prepare_batch does them), the longer on a tie (fewer rows to gather keys for)."""
  longest = bucket(longest_run)
  if longest > 1 and buckets.coarse_query_runs and not buckets.split_runs and prompt_chunks:
    return min(next(tq for tq in COARSE_QUERY_RUNS if tq >= longest), num_tokens)
  if not buckets.split_runs: return longest
  def slots(tq: int) -> int: return bucket(int((-(-counts // tq)).sum()), buckets.min_prefill_rows if tq > 1 else 1) * tq
  return min((1 << i for i in range(longest.bit_length())), key=lambda tq: (slots(tq), -tq))


def _fill_split_rows(a: dict[str, np.ndarray], seq_tables: np.ndarray, rows_of_seq: np.ndarray, counts: np.ndarray,
                     computed: np.ndarray, starts: np.ndarray, seq_of: np.ndarray, offset: np.ndarray, pos: np.ndarray,
                     tq: int) -> None:
  """The query rows of a step whose runs are cut into rows of Tq (split_runs): each row a piece of its sequence's run,
  with the sequence's block table."""
  rows, n_real = int(rows_of_seq.sum()), len(seq_of)
  first_row = np.zeros(len(counts) + 1, np.int64)
  np.cumsum(rows_of_seq, out=first_row[1:])
  row_of = first_row[seq_of] + offset // tq       # each flat token's query row
  row_seq = np.repeat(np.arange(len(counts)), rows_of_seq)   # the sequence of each query row
  row_start = (np.arange(rows) - first_row[row_seq]) * tq    # its first query's index in the sequence's run
  a["block_tables"][:rows] = seq_tables[row_seq]
  a["output_index"][:n_real] = row_of * tq + offset % tq
  a["query_index"][row_of, offset % tq], a["query_pos"][row_of, offset % tq] = np.arange(n_real), pos
  a["new_keys"][:rows] = np.minimum(row_start + tq, counts[row_seq])
  a["context_lens"][:rows] = computed[row_seq] + a["new_keys"][:rows]
  a["query_start"][:rows], a["query_start"][rows:] = starts[row_seq] + row_start, n_real


def prepare_batch(scheduled: list[ScheduledSequence], block_size: int, buckets: StepBuckets = StepBuckets(),
                  num_speculative_tokens: int = 0) -> HostBatch:
  """The step's arrays padded to `buckets` (the fused kernels take coarse ones, so that few layouts (captures) exist:
  their padding rows cost nothing, while the portable path computes every padded row).

  A step that verifies proposals (speculative decoding, k = num_speculative_tokens) takes the logits of 1 + k rows per
  sampling sequence (`logits_index`: its last token's and each proposal's, the last repeated past its proposals) and
  the proposals themselves (`draft_tokens` [S, k], -1 past a sequence's own); its runs of 1 + k tokens are bucketed
  as decodes are, not as prompt chunks, and up to `buckets.decode_verify_tokens` tokens laid out as decode rows.

  Vectorised over the flat tokens: at 256 sequences, per-sequence numpy calls cost more than the GPU's whole step (and
  at one sequence, each numpy call is a few microseconds of a step that the host must prepare in under a millisecond:
  a step whose runs each fit one row takes the short path)."""
  seqs = len(scheduled)
  counts = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, seqs)
  computed = np.fromiter((item.start for item in scheduled), np.int64, seqs)
  n_real, ends, longest = int(counts.sum()), computed + counts, int(counts.max())
  prompt_chunks = any(item.num_new_tokens > 1 + len(item.spec_token_ids) for item in scheduled)
  as_decode = not prompt_chunks and longest > 1 and n_real <= buckets.decode_verify_tokens   # (a verification)
  # decode rows are not padded: the layer kernel's step grows with its rows, padding rows included
  num_tokens = n_real if as_decode else buckets.tokens(n_real, prompt_chunks)
  tq = 1 if as_decode else query_run_length(counts, longest, buckets, num_tokens, prompt_chunks)
  context_len = bucket(int(ends.max()), buckets.min_context)
  max_blocks = -(-context_len // block_size)
  rows_of_seq = -(-counts // tq) if tq < longest else None   # query rows each run takes, where runs are split
  rows = seqs if rows_of_seq is None else int(rows_of_seq.sum())
  min_rows = buckets.min_prefill_rows if prompt_chunks else 1
  a = _empty(num_tokens, rows if as_decode else bucket(rows, min_rows), tq, max_blocks)
  starts = np.zeros(seqs + 1, np.int64)
  np.cumsum(counts, out=starts[1:])
  seq_of = np.repeat(np.arange(seqs), counts)     # the sequence of each flat token
  offset = np.arange(n_real) - starts[seq_of]     # its index in the sequence's run
  pos = computed[seq_of] + offset
  tables = [item.block_table[:max_blocks] for item in scheduled]
  held = np.fromiter((len(t) for t in tables), np.int64, seqs)
  seq_tables = a["block_tables"][:seqs] if rows_of_seq is None else np.zeros((seqs, max_blocks), np.int32)
  seq_tables[np.arange(max_blocks) < held[:, None]] = np.fromiter(chain.from_iterable(tables), np.int32, int(held.sum()))
  _fill_tokens(a, scheduled, starts, n_real)
  a["positions"][:n_real] = pos
  a["slot_mapping"][:n_real] = seq_tables[seq_of, pos // block_size] * block_size + pos % block_size
  if rows_of_seq is None:   # a row per sequence
    a["output_index"][:n_real] = seq_of * tq + offset
    a["query_index"][seq_of, offset], a["query_pos"][seq_of, offset] = np.arange(n_real), pos
    a["context_lens"][:seqs], a["new_keys"][:seqs] = ends, counts
    a["query_start"][1:seqs + 1], a["query_start"][seqs + 1:] = starts[1:], n_real
  else: _fill_split_rows(a, seq_tables, rows_of_seq, counts, computed, starts, seq_of, offset, pos, tq)
  if len(a["row_order"]) > 1: a["row_order"][:] = launch_order(a["context_lens"])
  spec_rows = 1 + num_speculative_tokens if any(item.spec_token_ids for item in scheduled) else 1
  sample_seqs, sample_steps, logits_index, drafts = _sampling_rows(scheduled, starts[1:].tolist(), spec_rows)
  a["logits_index"] = np.zeros(bucket(len(sample_seqs), min_rows) * spec_rows, np.int32)
  a["logits_index"][:len(logits_index)] = logits_index
  if spec_rows > 1:
    a["draft_tokens"] = np.full((bucket(len(sample_seqs), min_rows), spec_rows - 1), -1, np.int32)
    for row, proposals in enumerate(drafts): a["draft_tokens"][row, :len(proposals)] = proposals
  return HostBatch(a, context_len, sample_seqs, sample_steps, prompt_chunks, spec_rows)


def _sampling_rows(scheduled: list[ScheduledSequence], ends: list[int], spec_rows: int):
  """Per sampling sequence (a sequence, then the samples forked off it): itself, its token's index in its output, the
  flat tokens whose logits it samples from (spec_rows of them) and the proposals it verifies."""
  sample_seqs, sample_steps, logits_index, drafts = [], [], [], []
  for item, end in zip(scheduled, ends, strict=True):
    if not item.samples: continue
    proposals = item.spec_token_ids
    first = end - 1 - len(proposals)
    rows = [first + min(j, len(proposals)) for j in range(spec_rows)]
    for target in (item.seq, *item.forks):
      sample_seqs.append(target)
      sample_steps.append(item.sample_index if target is item.seq else 0)
      logits_index.extend(rows if target is item.seq else [first] * spec_rows)
      drafts.append(proposals if target is item.seq else ())
  return sample_seqs, sample_steps, logits_index, drafts
