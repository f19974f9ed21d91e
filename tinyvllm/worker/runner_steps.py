"""What the model runner hands out for a step: prepared (host inputs ready), launched (on the device) and its result."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinygrad import Tensor

from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.worker.host_io import Download
from tinyvllm.worker.input_batch import HostBatch
from tinyvllm.worker.logprobs import PromptRows, ScoredPromptChunk, TokenLogprobs, split_chunks
from tinyvllm.worker.step_layout import StepLayout
from tinyvllm.worker.token_controls import TokenControls


@dataclass
class StepResult:
  seqs: list[Sequence]       # each sampled sequence (a fork appears here before it joins the running set)
  token_ids: list[list[int]]   # each one's new tokens: the sampled one, or the accepted proposals and the one after
  logprobs: TokenLogprobs | None = None   # rows spec_rows apart: a sequence's new tokens' from row i * spec_rows on
  prompt_logprobs: list[ScoredPromptChunk] = field(default_factory=list)   # the prompt tokens the step scored
  spec_rows: int = 1


@dataclass
class LaunchedStep:
  """A step enqueued on the device; `result()` waits for its sampled tokens (and the logprobs asked for)."""
  seqs: list[Sequence]       # the sequence of each sampling row
  download: Download
  chains: bool               # whether the next step may take these tokens on the device before they are read
  sample_logprobs: bool = False
  prompt: PromptRows | None = None
  spec_rows: int = 1         # > 1: a verification step (its tokens [S, spec_rows] and their counts come first)

  def result(self) -> StepResult:
    arrays, n = self.download.result(), len(self.seqs)
    if self.spec_rows > 1:
      tokens, emitted, arrays = arrays[0], arrays[1], arrays[2:]
      token_ids = [tokens[i, :emitted[i]].tolist() for i in range(n)]
    else: token_ids, arrays = [[t] for t in arrays[0][:n].tolist()], arrays[1:]
    logprobs = TokenLogprobs(*(a[:n * self.spec_rows] for a in arrays[:4])) if self.sample_logprobs else None
    prompt = [] if self.prompt is None else split_chunks(self.prompt, TokenLogprobs(*(a[:self.prompt.num_rows] for a in arrays[-4:])))
    return StepResult(self.seqs, token_ids, logprobs, prompt, self.spec_rows)


@dataclass
class PreparedStep:
  """A step's host inputs, ready to launch (ModelRunner.prepare); the grammar rows' masks are filled at launch."""
  sched: SchedulerOutput
  host: HostBatch
  layout: StepLayout
  fields: dict[str, np.ndarray]   # the packed input's arrays (the bitmask filled in place at launch)
  prompt: PromptRows | None
  controls: TokenControls
  on_host: bool                   # some row needed every earlier token on the host: the next step must not chain
  logits: Tensor | None = None    # the forward pass's logits, when it was launched ahead of the sampling (launch_forward)

  @property
  def waits_for_tokens(self) -> bool:
    """Whether a grammar row's previous token is still in flight: its sequence's landed output is shorter than the
    index of the token the row samples, so its mask must wait for the step before. (Counted from the landed tokens,
    not the placeholders: a step scheduled after this one adds its own, which this one's masks never need.) An ended
    sequence's rows are not filled and wait for nothing."""
    steps, spec_rows = self.host.sample_steps, self.host.spec_rows
    return any(not seq.is_finished and len(seq.output_token_ids) < steps[row // spec_rows]
               for seq, row, _ in self.controls.grammar_rows)
