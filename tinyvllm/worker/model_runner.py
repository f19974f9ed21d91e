"""ModelRunner: a scheduled batch in, one sampled token per finishing sequence out.

Each step's metadata (tokens, positions, slot mapping, block tables, query layout, sampling settings) is packed on the
host into one int32 array and copied to the device once (worker/host_io.py). The forward pass plus sampling runs under
a TinyJit capture per layout (the bucketed shapes of the step, worker/step_layout.py), so a replay costs one copy in,
the captured kernels and one copy out of the sampled ids. Which layouts are captured is the cudagraph mode: FULL every
layout, FULL_DECODE_ONLY decode steps only (steps with prompt chunks run eagerly), NONE (--enforce-eager). A step that
scores prompt tokens (prompt_logprobs, worker/logprobs.py) always runs eagerly: the captures stay as they are.
"""
from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.kernels.tinygrad_program import collecting_sources, compile_parallel
from tinyvllm.layers.rejection_sampler import greedy_verify, verify
from tinyvllm.layers.sampler import SamplingBatch
from tinyvllm.layers.tensor_parallel import broadcast_together
from tinyvllm.layers.token_controls import apply_token_controls
from tinyvllm.model.llama import StepInputs, TransformerLM
from tinyvllm.platform import tinygrad_compat as compat
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.host_io import StepIO
from tinyvllm.worker.input_batch import HostBatch, StepBuckets, bucket, prepare_batch
from tinyvllm.worker.kv_cache import KVCache
from tinyvllm.worker.logits_processors import LogitsProcessors
from tinyvllm.worker.logprobs import PromptRows, prompt_rows, score
from tinyvllm.worker.runner_steps import LaunchedStep, PreparedStep, StepResult
from tinyvllm.worker.step_layout import StepLayout, covers, logprobs_bucket, packed_fields
from tinyvllm.worker.token_controls import TokenControls, TokenControlsBuilder

_NO_DRAFTS = np.zeros((0, 0), np.int32)


@dataclass
class StartUpCaptures:
  decode: int = 0      # new captures of decode steps
  prompt: int = 0      # ... of steps with prompt chunks
  seconds: float = 0.0


def freeze_long_lived_objects() -> None:
  """Move everything alive now (weights, captured graphs and their tinygrad objects) out of the garbage collector's
  reach: otherwise every full collection walks them all, which at 256 sequences tripled a step's host time."""
  gc.collect()
  gc.freeze()


class SamplingCapture:
  """A split step's sampling, captured reading the logits tensor its forward pass's capture returns (the same tensor,
  over the same buffer, at every replay) instead of taking it as an input: TinyJit rewrites each input's graph at
  every call (~0.05 ms a call for the logits on a busy 2-core host)."""

  def __init__(self, sample: Callable[[Tensor, Tensor], Tensor | tuple[Tensor, ...]]):
    self._sample = sample
    self._logits: Tensor | None = None
    self._jit: TinyJit | None = None

  def __call__(self, packed: Tensor, logits: Tensor) -> Tensor | tuple[Tensor, ...]:
    if self._jit is None:
      self._logits = logits
      self._jit = compat.capture_on_first_call(TinyJit(lambda p: self._sample(p, logits)))
    if logits is not self._logits: raise RuntimeError("a split step's forward pass gave other logits than its sampling was captured on")
    return self._jit(packed)


class ModelRunner:
  def __init__(self, model: TransformerLM, kv_cache: KVCache, max_num_seqs: int, max_model_len: int,
               cudagraph_mode: str = "FULL", capture_repeated_prompt_layouts: bool = False, num_speculative_tokens: int = 0,
               logits_processors: LogitsProcessors | None = None):
    """Buckets as coarse as the model's backend allows (StepBuckets); `max_num_seqs` also sizes the sampled tokens
    each step keeps on the device for the next one (asynchronous scheduling).
    `capture_repeated_prompt_layouts` (the CPU): a layout with prompt chunks runs eagerly when first met and is captured
    when met again. There a capture costs 3-4 eager steps (tinygrad lowers the step once more into the graph) and
    many prompt layouts are met once: capturing each at once made the tests of generation, engine features and the
    prefix cache 40% slower than running them eagerly.
    `num_speculative_tokens` (k): a step verifying proposals samples 1 + k rows per sequence (verify()).
    `logits_processors`: custom processors applied to every step's logits, which then runs eagerly (a processor makes
    tensors from its state: a capture would replay the first step's)."""
    backend = model.backend
    self.model, self.kv_cache, self.cudagraph_mode = model, kv_cache, "NONE" if logits_processors else cudagraph_mode
    self._processors = logits_processors
    self.chain_rows = bucket(max_num_seqs)
    self.last_tokens = Tensor.zeros(self.chain_rows, dtype=dtypes.int32, device=model.device).contiguous().realize()
    self.buckets = StepBuckets(min(backend.min_context_bucket, bucket(max_model_len, 16)),
                               bucket(max_num_seqs) if backend.pads_prefill_rows else 1, backend.splits_query_runs,
                               backend.min_prompt_tokens, backend.coarse_query_runs, backend.decode_verify_tokens)
    self.max_num_seqs, self.max_model_len, self.num_speculative_tokens = max_num_seqs, max_model_len, num_speculative_tokens
    self._kernels = backend.builds_kernels
    self.vocab_size = model.config.vocab_size
    self._captures: dict[StepLayout, TinyJit] = {}
    self._split: dict[StepLayout, tuple[Callable, Callable]] = {}   # launch_forward's steps: forward pass, sampling
    self._capture_when_repeated = capture_repeated_prompt_layouts
    self._met_once: set[StepLayout] = set()   # prompt layouts run eagerly once, to be captured when met again
    self.capture_seconds = 0.0    # spent in steps that captured a new layout (building + running them)
    self._io = StepIO(model.device)
    self._controls = TokenControlsBuilder(self.vocab_size, self._io.host_array)

  def execute(self, sched: SchedulerOutput) -> StepResult: return self.launch(self.prepare(sched)).result()

  def prepare(self, sched: SchedulerOutput) -> PreparedStep:
    """The step's host inputs, before its launch. Rows that need every earlier token on the host to be prepared
    (penalties, a bad word of several tokens, logits processors) must have none in flight; a grammar row may (its mask
    is filled at launch, once the step before has landed: `PreparedStep.waits_for_tokens`)."""
    host, layout, fields, prompt, controls = self._plan(sched)
    if self._processors is not None: self._processors.update(host.sample_seqs)
    # processors may read any row's output: every row's tokens must be on the host; otherwise only rows with penalties
    # or token controls may need theirs there (the variant says whether the step has any: a plain step checks no row)
    variant = layout.variant
    on_host = self._processors is not None or ((variant.penalties or variant.bias)
                                               and any(s.params.needs_output_on_host for s in host.sample_seqs))
    if on_host and any(item.token_source >= 0 and item.seq.params.needs_output_on_host for item in sched.scheduled):
      raise RuntimeError("a sequence that needs its output on the host (penalties, a bad word of several tokens) was "
                         "scheduled before its previous token was read")
    return PreparedStep(sched, host, layout, fields, prompt, controls, on_host)

  def launch_forward(self, step: PreparedStep) -> None:
    """Enqueue the step's forward pass alone, leaving its sampling to `launch`, which fills the grammar rows' masks
    then: the step before may land in between, while this one's forward pass runs. Steps that score prompt tokens or
    verify proposals, and steps under logits processors, are not split (they run whole at `launch`)."""
    if step.layout.prompt_logprobs >= 0 or step.layout.verifies or self._processors is not None: return
    packed = self._upload(step.fields, "inputs")
    self._move_blocks(step)
    step.logits = self._split_fns(step.layout)[0](packed)

  def launch(self, step: PreparedStep) -> LaunchedStep:
    """Fill the grammar rows' masks, enqueue the step (or its sampling, after `launch_forward`) and the copy of its
    samples to the host; tokens still in flight come from the previous step's samples on the device."""
    host, layout = step.host, step.layout
    if step.waits_for_tokens: raise RuntimeError("a grammar's mask was asked for before its sequence's previous token landed")
    step.controls.fill_bitmask()
    # (after launch_forward, the masks into the same upload buffer: the copy is ordered after the forward pass)
    packed = self._upload(step.fields, "bitmask" if step.logits is not None else "all")
    if step.logits is not None: out = self._split_fns(layout)[1](packed, step.logits)
    else:
      self._move_blocks(step)
      out = self._step_fn(self._covering(layout))(packed)
    return LaunchedStep(host.sample_seqs, self._io.download_later(out if isinstance(out, tuple) else (out,)), self.chains(step),
                        layout.logprobs >= 0, step.prompt, host.spec_rows)

  def chains(self, step: PreparedStep) -> bool:
    """Whether the step after this one may take its tokens on the device, before they are read."""
    return len(step.host.sample_seqs) <= self.chain_rows and not step.on_host and step.host.spec_rows == 1

  def _upload(self, fields: dict[str, np.ndarray], part: str = "all") -> Tensor:
    """The step's packed input on the device: "all" of it, its "inputs" (all but the trailing bitmask, which the
    forward pass does not read) or the "bitmask" alone (after the inputs, into the same buffer). "all" copies the
    bitmask apart too: packing it with the inputs would copy its 1.2 MB (batch 64, Qwen3's vocabulary) once more."""
    arrays, size = list(fields.values()), sum(a.size for a in fields.values())
    if next(reversed(fields), None) == "bitmask":
      bitmask = fields["bitmask"].reshape(-1)
      if part == "bitmask": return self._io.upload(bitmask, size, size - bitmask.size)
      if part == "all": self._io.upload(bitmask, size, size - bitmask.size)
      arrays = arrays[:-1]
    return self._io.upload(np.concatenate([a.reshape(-1) for a in arrays]), size)

  def _move_blocks(self, step: PreparedStep) -> None:
    """The step's swaps and block copies, enqueued before its forward pass."""
    sched = step.sched
    if sched.blocks_to_swap_out: self.kv_cache.swap_out(sched.blocks_to_swap_out)   # first: its blocks may be reused below
    if sched.blocks_to_swap_in: self.kv_cache.swap_in(sched.blocks_to_swap_in)
    if sched.block_copies: self.kv_cache.copy_blocks(sched.block_copies)

  def _plan(self, sched: SchedulerOutput) -> tuple[HostBatch, StepLayout, dict[str, np.ndarray], PromptRows | None, TokenControls]:
    """The step's host batch, its layout, its packed int32 fields (the bitmask's rows not yet filled), the prompt
    tokens it scores and its token controls."""
    host = prepare_batch(sched.scheduled, self.kv_cache.block_size, self.buckets, self.num_speculative_tokens)
    sampling = self._sampling_batch(host)
    controls = self._controls.build(host.sample_seqs, host.sample_steps, host.arrays.get("draft_tokens", _NO_DRAFTS),
                                    host.spec_rows, len(host.logits_index))
    variant = replace(sampling.variant, bias=controls.bias_index is not None, mask=controls.bitmask is not None)
    prompt = prompt_rows(sched.scheduled, host.query_start)
    fields = packed_fields(host, sampling, prompt, controls)
    layout = StepLayout(tuple((name, a.shape) for name, a in fields.items()), host.context_len, variant,
                        logprobs_bucket(host.sample_seqs), prompt.k if prompt is not None else -1, host.prompt_chunks)
    return host, layout, fields, prompt, controls

  def _prepare(self, sched: SchedulerOutput) -> tuple[HostBatch, StepLayout, Tensor, PromptRows | None]:
    """The step's host batch, its layout, its packed metadata uploaded to the device, and the prompt tokens it scores
    (warm-up and scoring: no step in flight)."""
    host, layout, fields, prompt, controls = self._plan(sched)
    controls.fill_bitmask()
    return host, layout, self._upload(fields), prompt

  def warm_up(self, sizes: list[int], max_num_batched_tokens: int) -> StartUpCaptures:
    """Capture now rather than when first met, compiling all their kernels in parallel first: the decode steps of
    `sizes` sequences (bucketed, up to max_num_seqs) and, where the backend takes coarse prompt layouts and FULL
    captures them, every prompt layout of `sizes` tokens (bucketed, up to max_num_batched_tokens) at each query run it
    may have. All at contexts up to the smallest context bucket (a longer one is captured when first met), sampled by
    the random sampler (which covers greedy rows). Their K/V goes to the cache's block 0, so call this before any
    request runs."""
    if self.cudagraph_mode == "NONE": return StartUpCaptures()
    t, decode, prompt = time.perf_counter(), {}, {}
    decode_rows = sorted({bucket(b) for b in sizes if 1 <= b <= self.max_num_seqs})
    # decode steps, and those verifying proposals: greedy ones too, since a greedy verification takes its own path (the
    # argmax), much cheaper than the rejection sampler a random capture would run it with
    kinds = [(0, 1.0)] + ([(self.num_speculative_tokens, 1.0), (self.num_speculative_tokens, 0.0)] if self.num_speculative_tokens else [])
    for proposals, temperature in kinds:
      for sched in (self._warm_up_batch([1 + proposals] * rows, proposals, temperature) for rows in decode_rows):
        decode.setdefault(self._prepare(sched)[1], sched)
    # a verification laid out as decode rows is not padded: at batch 1, each count of proposals is a layout of its own
    for proposals in range(1, min(self.num_speculative_tokens, self.buckets.decode_verify_tokens - 1) + 1):
      for temperature in (1.0, 0.0):
        sched = self._warm_up_batch([1 + proposals], proposals, temperature)
        decode.setdefault(self._prepare(sched)[1], sched)
    if self.cudagraph_mode == "FULL" and self.buckets.coarse_query_runs:
      for sched in self._prompt_batches(sizes, max_num_batched_tokens): prompt.setdefault(self._prepare(sched)[1], sched)
    todo = {layout: sched for layout, sched in (decode | prompt).items() if layout not in self._captures}
    if self._kernels: self._precompile_warm_up(todo)
    for sched in todo.values():
      _, layout, packed, _ = self._prepare(sched)   # again: a same-sized upload buffer may hold another batch's data
      self._step_fn(layout, precompiled=True)(packed)
    return StartUpCaptures(sum(layout in todo for layout in decode), sum(layout in todo for layout in prompt),
                           time.perf_counter() - t)

  def _precompile_warm_up(self, todo: dict[StepLayout, SchedulerOutput]) -> None:
    """Compile the start-up captures' kernels in parallel before capturing them. The first layout goes alone: when it
    compiled nothing (every source was in the disk cache: a second start), the others are not built twice to collect
    their sources (about 0.1 s a layout); a source still missing is then compiled when its capture meets it."""
    builds = [(functools.partial(self._forward, layout), self._prepare(sched)[2]) for layout, sched in todo.items()]
    if builds and self.precompile(builds[:1]) > 0: self.precompile(builds[1:])

  def _prompt_batches(self, sizes: list[int], max_num_batched_tokens: int) -> list[SchedulerOutput]:
    """A step of N token rows whose longest run takes query run Tq, for every (N, Tq) of `sizes` tokens."""
    batches, longest = [], min(self.max_model_len, max_num_batched_tokens)
    for n in sorted({self.buckets.tokens(b, True) for b in sizes if 2 <= b <= max_num_batched_tokens}):
      for tq in self.buckets.query_runs(n):
        run = min(tq, longest)
        batches.append(self._warm_up_batch([run] * max(1, min(self.max_num_seqs, n // run))))
    return batches

  def _warm_up_batch(self, runs: list[int], proposals: int = 0, temperature: float = 1.0) -> SchedulerOutput:
    """Sequences whose first `runs[i]` tokens are computed and sampled (at `temperature`: the random sampler also
    covers greedy rows), the last `proposals` of them verified as proposals; every block table all block 0."""
    def item(i: int, run: int) -> ScheduledSequence:
      seq = Sequence("warm-up", [0] * (run - proposals), SamplingParams(temperature=temperature), seed=i)
      return ScheduledSequence(seq, 0, run, [0] * -(-run // self.kv_cache.block_size), True, spec_token_ids=(0,) * proposals)
    return SchedulerOutput([item(i, run) for i, run in enumerate(runs)])

  def logits(self, sched: SchedulerOutput) -> np.ndarray:
    """Float32 logits of each sampling row, without sampling (eager; for scoring and checks, not the hot path)."""
    host = prepare_batch(sched.scheduled, self.kv_cache.block_size, self.buckets)
    logits, caches = self.model(self._step_inputs({k: Tensor(a) for k, a in host.arrays.items()}, host.context_len),
                                self.kv_cache.layers)
    Tensor.realize(logits, *[t for pair in caches for t in pair])
    return logits.numpy()[:len(host.sample_seqs)]

  def _covering(self, layout: StepLayout) -> StepLayout:
    """The layout itself, or a captured one with the same inputs whose sampler covers it (see `covers`). A greedy
    verification is never covered: its own path (the argmax) is far cheaper than the rejection sampler."""
    if layout in self._captures or (layout.verifies and not layout.variant.random): return layout
    return next((c for c in self._captures if c.shapes == layout.shapes and c.context_len == layout.context_len
                 and c.logprobs == layout.logprobs and c.multi_token == layout.multi_token and covers(c.variant, layout.variant)),
                layout)

  def _step_fn(self, layout: StepLayout, precompiled: bool = False):
    """`precompiled`: a start-up capture, its kernels compiled already (and captured now, even where prompt layouts
    are captured when met again)."""
    eager = (self.cudagraph_mode == "NONE" or (layout.multi_token and self.cudagraph_mode == "FULL_DECODE_ONLY")
             or layout.prompt_logprobs >= 0)
    jit = self._captures.get(layout)
    if (jit is None and not eager and not precompiled and layout.multi_token and self._capture_when_repeated
        and layout not in self._met_once):
      self._met_once.add(layout)
      eager = True
    if eager: return lambda packed: self._forward(layout, packed)
    if jit is not None: return jit
    # captured on the first call (~1 s saved per new layout on the GPU): the step has nothing to initialise (weights
    # and caches are realized at load, per-step data comes in through `packed`)
    jit = self._captures[layout] = compat.capture_on_first_call(TinyJit(functools.partial(self._forward, layout)))
    return lambda packed: self._timed_capture(jit, packed, precompile=self._kernels and not precompiled)

  def _timed_capture(self, jit: TinyJit, packed: Tensor, precompile: bool):
    t = time.perf_counter()
    if precompile: self.precompile([(jit.fxn, packed)])
    out = jit(packed)
    freeze_long_lived_objects()
    self.capture_seconds += time.perf_counter() - t
    return out

  @staticmethod
  def precompile(builds: list[tuple[Callable[[Tensor], object], Tensor]]) -> int:
    """Build each step's graph without realizing it, then compile every kernel source met, in parallel (the real build
    that follows finds them compiled). Returns how many sources were compiled."""
    with collecting_sources() as pending:
      for build, packed in builds: build(packed, realize=False)
    return compile_parallel(pending)

  @property
  def num_captures(self) -> int: return len(self._captures)

  def _step_inputs(self, f: dict[str, Tensor], context_len: int, token_ids: Tensor | None = None,
                   logits_index: Tensor | None = None) -> StepInputs:
    meta = AttentionMetadata(f["slot_mapping"], f["block_tables"], f["query_index"], f["query_pos"], f["output_index"],
                             f["context_lens"], f["query_start"], f["new_keys"], f["row_order"], self.kv_cache.block_size,
                             context_len)
    return StepInputs(f["token_ids"] if token_ids is None else token_ids, f["positions"], meta,
                      f["logits_index"] if logits_index is None else logits_index)

  def _forward(self, layout: StepLayout, packed: Tensor, realize: bool = True) -> Tensor | tuple[Tensor, ...]:
    """Outputs: the sampled tokens; then, if asked for, the sampled tokens' logprobs (logprob, rank, top ids, top
    logprobs) and the scored prompt tokens' (the same four)."""
    logits, prompt_logits, caches = self._model_logits(layout, packed)
    return self._sample(layout, packed, logits, prompt_logits, caches, realize)

  def _split_fns(self, layout: StepLayout) -> tuple[Callable, Callable]:
    """The step's forward pass (packed -> logits, the caches written) and its sampling ((packed, logits) -> what
    _forward returns), each captured on its first call where the step would be."""
    fns = self._split.get(layout)
    if fns is None:
      forward = functools.partial(self._forward_logits, layout)
      sample = functools.partial(self._sample_logits, layout)
      eager = (self.cudagraph_mode == "NONE" or (layout.multi_token and self.cudagraph_mode == "FULL_DECODE_ONLY")
               or (layout.multi_token and self._capture_when_repeated))
      if not eager: forward, sample = compat.capture_on_first_call(TinyJit(forward)), SamplingCapture(sample)
      fns = self._split[layout] = (forward, sample)
    return fns

  def _forward_logits(self, layout: StepLayout, packed: Tensor) -> Tensor:
    logits, _, caches = self._model_logits(layout, packed)
    logits = logits.contiguous()
    Tensor.realize(logits, *[t for pair in caches for t in pair])
    return logits

  def _sample_logits(self, layout: StepLayout, packed: Tensor, logits: Tensor) -> Tensor | tuple[Tensor, ...]:
    return self._sample(layout, packed, logits, None, [], realize=True)

  def _model_logits(self, layout: StepLayout, packed: Tensor) -> tuple[Tensor, Tensor | None, list]:
    """The sampling rows' logits, the scored prompt rows' (or None) and the caches after the step's KV writes."""
    f = layout.unpack(packed)
    source = f["token_source"]
    token_ids = (source >= 0).where(self.last_tokens[source.maximum(0)], f["token_ids"])
    scores_prompt = layout.prompt_logprobs >= 0   # then the model also returns the prompt rows' logits, after the samples'
    # a tensor-parallel model reads its inputs on every device: the packed input is broadcast whole, with the token ids
    # (this step's own, on the first device) in the same call
    model_f = f
    if self.model.collectives is not None:
      moved, token_ids = broadcast_together(self.model.collectives, [packed, token_ids])
      model_f = layout.unpack(moved)
    logits_index = model_f["logits_index"].cat(model_f["prompt_index"]) if scores_prompt else None
    logits, caches = self.model(self._step_inputs(model_f, layout.context_len, token_ids, logits_index), self.kv_cache.layers)
    if scores_prompt: return logits[:layout.rows], logits[layout.rows:], caches
    return logits, None, caches

  def _sample(self, layout: StepLayout, packed: Tensor, logits: Tensor, prompt_logits: Tensor | None, caches: list,
              realize: bool) -> Tensor | tuple[Tensor, ...]:
    """The token controls, the sampler (or the verification of proposals), the logprobs asked for, the tokens kept on
    the device for the next step."""
    f = layout.unpack(packed)
    raw_logits = logits   # what the logprobs come from (vLLM's raw_logprobs)
    if layout.variant.bias or layout.variant.mask:
      bias = (f["bias_index"], f["bias_value"].bitcast(dtypes.float32)) if layout.variant.bias else None
      logits = apply_token_controls(logits, f["bitmask"] if layout.variant.mask else None, bias)
    if self._processors is not None: logits = self._processors.apply(logits.float())
    penalties = None
    if "penalty_index" in f: penalties = (f["penalty_index"], f["penalty_value"].bitcast(dtypes.float32))
    outputs: tuple[Tensor, ...]
    if layout.verifies:   # verification: tokens [S, 1 + k] (-1 past the emitted ones) and their counts [S]
      drafts = f["draft_tokens"]
      if layout.variant.random:
        params, rng = f["params"].bitcast(dtypes.float32), f["rng"].bitcast(dtypes.uint32)
        outputs = verify(logits, params, rng, layout.variant, drafts, penalties)
      else:   # every row greedy: the backend's sampler gives each row's argmax (one kernel on the GPU, which takes
        # float32 logits: the GEMM's bfloat16 ones went to the portable argmax, 0.4 ms of a 2.5 ms step at batch 1)
        argmax = self.model.backend.sample(logits.float(), f["params"], f["rng"], layout.variant, penalties)
        outputs = greedy_verify(argmax.reshape(drafts.shape[0], -1), drafts)
      tokens = outputs[0].reshape(-1).maximum(0)   # each row's token (the logprobs of those past the emitted go unread)
    else:
      tokens = self.model.backend.sample(logits, f["params"], f["rng"], layout.variant, penalties)
      outputs = (tokens,)
    if layout.logprobs >= 0: outputs += score(raw_logits, tokens, layout.logprobs)
    if prompt_logits is not None: outputs += score(prompt_logits, f["prompt_target"], layout.prompt_logprobs)
    chained = () if layout.verifies else (self.last_tokens,)
    if realize and chained:   # (a build that only collects kernel sources must leave no assignment pending)
      kept = min(layout.rows, self.chain_rows)
      self.last_tokens.assign(tokens[:kept].pad((0, self.chain_rows - kept)))
    if realize: Tensor.realize(*outputs, *chained, *[t for pair in caches for t in pair])
    return outputs[0] if len(outputs) == 1 else outputs

  def _sampling_batch(self, host: HostBatch) -> SamplingBatch:
    """One row per logits row: a verifying sequence's row j draws its output token sample_step + j, after its output
    and the first j proposals (the history penalties count)."""
    seqs, k1 = host.sample_seqs, host.spec_rows
    drafts = host.arrays["draft_tokens"] if k1 > 1 else np.zeros((len(seqs), 0), np.int32)
    histories = None
    if any(s.params.uses_penalties for s in seqs):
      histories = [(s.prompt_token_ids, s.output_token_ids + [t for t in drafts[i, :j] if t >= 0])
                   for i, s in enumerate(seqs) for j in range(k1)]
    return SamplingBatch.build([s.params for s in seqs for _ in range(k1)], [s.seed for s in seqs for _ in range(k1)],
                               [step + j for step in host.sample_steps for j in range(k1)], histories,
                               len(host.logits_index), self.vocab_size)
