"""Token controls (vLLM's logit_bias, allowed_token_ids, bad_words, min_tokens) and custom logits processors (vLLM
v1's batch-level interface): their host-side rows, their device-side application against llguidance's own numpy
reference, and stories260K's greedy output under them against HF transformers' logits."""
from __future__ import annotations

import random
from typing import ClassVar

import numpy as np
import pytest
from tinygrad import Tensor

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.messages import EngineCoreInfo
from tinyvllm.layers.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from tinyvllm.layers.token_controls import apply_token_controls
from tinyvllm.sampling_params import SamplingParams as SP
from tinyvllm.sampling_params import SamplingParamsError
from tinyvllm.worker.logits_processors import batch_update
from tinyvllm.worker.token_controls import TokenControlsBuilder, allowed_row, row_bias

EOS = 2
PROMPT = "Once upon a time"
NEG_INF = float("-inf")


# ---- host rows and device application
def test_row_bias_follows_vllm():
  params = SP(logit_bias={7: 2.5, 9: 0.0}, min_tokens=3, stop_token_ids=[11], max_tokens=8)
  params._bad_words_token_ids = [[5], [20, 21], [30, 31, 32]]
  seq = Sequence("r", [1], params, seed=0, eos_token_ids=frozenset({EOS}))
  assert row_bias(seq, 0, [], 512) == {7: 2.5, 5: NEG_INF, 11: NEG_INF, EOS: NEG_INF}   # 0 bias dropped; EOS and stop held back
  seq.output_token_ids += [20]
  assert row_bias(seq, 3, [], 512) == {7: 2.5, 5: NEG_INF, 21: NEG_INF}    # min_tokens reached; "20 21" completes with 21
  assert row_bias(seq, 3, [30, 31], 512) == {7: 2.5, 5: NEG_INF, 32: NEG_INF}   # proposals count as output (a verification row)
  assert row_bias(Sequence("r", [1], SP(ignore_eos=True, min_tokens=2), 0, eos_token_ids=frozenset({EOS})), 0, [], 512) == {}


def test_device_controls_match_llguidance_numpy_reference():
  llg_numpy = pytest.importorskip("llguidance.numpy")
  rng = np.random.default_rng(0)
  rows, vocab = 5, 300
  logits = rng.standard_normal((rows, vocab)).astype(np.float32)
  mask = rng.integers(-2**31, 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
  mask[2] = allowed_row([0, 33, 299], mask.shape[1])
  index = np.full((rows, 4), -1, np.int32)
  value = np.zeros((rows, 4), np.float32)
  index[1, :2], value[1, :2] = [1 * vocab + 5, 1 * vocab + 299], [3.0, NEG_INF]
  expected = logits.copy()
  expected[1, 5] += 3.0
  expected[1, 299] = NEG_INF
  llg_numpy.apply_token_bitmask_inplace(expected, mask)
  got = apply_token_controls(Tensor(logits), Tensor(mask), (Tensor(index), Tensor(value))).numpy()
  np.testing.assert_array_equal(got, expected)
  assert np.isfinite(got[2]).sum() == 3


def test_builder_sends_nothing_for_rows_without_controls():
  builder = TokenControlsBuilder(512)
  plain = [Sequence("r", [1], SP(), seed=0) for _ in range(3)]
  controls = builder.build(plain, [0, 0, 0], np.zeros((0, 0), np.int32), 1, 4)
  assert controls.fields() == {}
  allowed = Sequence("a", [1], SP(allowed_token_ids=[3, 40]), seed=0)
  controls = builder.build([*plain, allowed], [0] * 4, np.zeros((0, 0), np.int32), 1, 4)
  assert set(controls.fields()) == {"bitmask"}   # filled at launch, in place
  controls.bitmask[:] = 0   # (whatever an earlier step left there: the fill writes every row)
  controls.fill_bitmask()
  assert (controls.bitmask[:3] == -1).all()
  bits = np.unpackbits(controls.bitmask[3].view(np.uint8), bitorder="little")
  assert np.flatnonzero(bits).tolist() == [3, 40]


def test_a_built_bitmask_stays_apart_from_the_next_steps():
  """A split grammar step's masks are filled and uploaded after the next step is built: consecutive builds hand out
  different arrays (reused every other build), and neither the next build nor its fill touches the one before."""
  builder, no_drafts = TokenControlsBuilder(512), np.zeros((0, 0), np.int32)
  allowed = [Sequence("a", [1], SP(allowed_token_ids=[3, 40]), seed=0)]
  first = builder.build(allowed, [0], no_drafts, 1, 2)
  first.fill_bitmask()
  filled = first.bitmask.copy()
  assert (filled[1] == -1).all() and not (filled[0] == -1).all()
  second = builder.build(allowed, [0], no_drafts, 1, 2)
  assert second.bitmask is not first.bitmask
  second.fill_bitmask()
  np.testing.assert_array_equal(second.bitmask, filled)
  np.testing.assert_array_equal(first.bitmask, filled)
  assert builder.build(allowed, [0], no_drafts, 1, 2).bitmask is first.bitmask


# ---- the batch the logits processors see
def _replay(rows: dict[int, int], update: BatchUpdate) -> dict[int, int]:
  """vLLM's builtin processors' handling of a BatchUpdate (process_dict_updates): added, removed, then moved."""
  for index, params, _, _ in update.added: rows[index] = params.seed
  for index in update.removed: rows.pop(index, None)
  for a, b, direction in update.moved:
    a_entry, b_entry = rows.pop(a, None), rows.pop(b, None)
    if a_entry is not None: rows[b] = a_entry
    if b_entry is not None and direction is MoveDirectionality.SWAP: rows[a] = b_entry
  return rows


def test_batch_updates_replay_to_each_step_rows():
  rng = random.Random(0)
  pool = [Sequence("r", [1], SP(seed=i), seed=i) for i in range(40)]
  state: dict[int, int] = {}
  old: list = []
  for _ in range(200):
    new = rng.sample(pool, rng.randint(0, 12))
    update, old = batch_update(old, new)
    if update is not None:
      state = _replay(state, update)
      assert update.batch_size == len(new)
    assert state == {row: seq.params.seed for row, seq in enumerate(new)}


# ---- request checks
def test_bad_values_are_refused_naming_the_field():
  for kwargs, field in [({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
                        ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens")]:
    with pytest.raises(SamplingParamsError) as e: SP(**kwargs)
    assert e.value.param == field
  processor = InputProcessor(EngineCoreInfo(64, 512, [EOS], 16, 16, True, None), None, 20)
  for kwargs, field in [({"logit_bias": {512: 1}}, "logit_bias"), ({"allowed_token_ids": [5, 600]}, "allowed_token_ids"),
                        ({"bad_words": ["cat"]}, "bad_words")]:
    with pytest.raises(SamplingParamsError) as e: processor.check_request([1, 5], SP(**kwargs))
    assert e.value.param == field and ("vocabulary" in str(e.value) or "tokenizer" in str(e.value))


# ---- stories260K under the controls, against HF transformers' logits
def _reference_greedy(log_softmax, prompt: list[int], steps: int, adjust) -> list[int]:
  """Greedy decoding over HF's logprobs, each step's adjusted by adjust(logprobs, output so far)."""
  out: list[int] = []
  for _ in range(steps):
    out.append(int(np.argmax(adjust(log_softmax(prompt + out)[-1].copy(), out))))
  return out


@pytest.mark.slow
def test_logit_bias_and_allowed_tokens_follow_hf(llm, stories_log_softmax):
  prompt = llm.get_tokenizer()(PROMPT).input_ids
  greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
  bias = {greedy[0]: -100.0, greedy[2]: -5.0, 267: 4.0}
  allowed = [260, 261, 267, 298, 410, 432]

  def biased(lp, out):
    for t, v in bias.items(): lp[t] += v
    return lp

  def restricted(lp, out):
    keep = np.full_like(lp, -np.inf)
    keep[allowed] = lp[allowed]
    return keep
  params = [SamplingParams(temperature=0, max_tokens=8, logit_bias=bias),
            SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed),
            SamplingParams(temperature=0, max_tokens=4, logit_bias={13: 100})]
  outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, params, use_tqdm=False)]
  assert outs[0] == _reference_greedy(stories_log_softmax, prompt, 8, biased) and outs[0][0] != greedy[0]
  assert outs[1] == _reference_greedy(stories_log_softmax, prompt, 8, restricted) and set(outs[1]) <= set(allowed)
  assert outs[2] == [13] * 4    # +100 forces it
  assert_all_free(llm)


@pytest.mark.slow
def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(llm, stories_log_softmax):
  force_eos = {EOS: 100.0}   # (stories260K never ends a story by itself)
  plain, held = llm.generate([PROMPT] * 2, [SamplingParams(temperature=0, max_tokens=16, logit_bias=force_eos),
                                            SamplingParams(temperature=0, max_tokens=16, logit_bias=force_eos, min_tokens=5)],
                             use_tqdm=False)
  assert plain.outputs[0].token_ids == [EOS] and plain.outputs[0].finish_reason == "stop"
  assert len(held.outputs[0].token_ids) == 6 and held.outputs[0].token_ids[-1] == EOS and EOS not in held.outputs[0].token_ids[:5]
  assert held.outputs[0].finish_reason == "stop"
  greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
  stop_token = greedy.token_ids[1]   # ", there was a little girl named Lily. She loved to"
  by_token, by_string = llm.generate([PROMPT] * 2, [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=4),
                                                    SamplingParams(temperature=0, max_tokens=12, stop=["there"], min_tokens=6)],
                                     use_tqdm=False)

  def ban_until_4(lp, out):
    if len(out) < 4: lp[stop_token] = -np.inf
    return lp
  expected = _reference_greedy(stories_log_softmax, llm.get_tokenizer()(PROMPT).input_ids, 12, ban_until_4)
  if stop_token in expected[4:]: expected = expected[:expected.index(stop_token, 4) + 1]
  assert by_token.outputs[0].token_ids == expected and expected[1] != stop_token
  # the stop string was written before min_tokens: it is not looked for then, nor later
  assert by_string.outputs[0].token_ids == greedy.token_ids and by_string.outputs[0].finish_reason == "length"
  assert_all_free(llm)


@pytest.mark.slow
def test_bad_words_single_and_multi_token(llm):
  tok = llm.get_tokenizer()
  greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
  assert " little" in greedy.text and " named Lily" in greedy.text
  single, multi = tok.encode("little", add_special_tokens=False), tok.encode("named Lily", add_special_tokens=False)
  assert len(single) == 1 and len(multi) == 2   # (SentencePiece: "little" and " little" are the same token)
  banned = SamplingParams(temperature=0, max_tokens=24, bad_words=["little", "named Lily"])
  out = llm.generate([PROMPT], banned, use_tqdm=False)[0].outputs[0]
  ids = out.token_ids
  assert single[0] not in ids and not any(ids[i:i + 2] == multi for i in range(len(ids)))
  assert ids[:4] == greedy.token_ids[:4] and ids[4] != greedy.token_ids[4]   # ", there was a" then not " little"
  assert_all_free(llm)


@pytest.mark.slow
def test_free_rows_are_unchanged_beside_controlled_rows(llm):
  free = ["Tom and Sue", "The dog was happy."]
  alone = [o.outputs[0].token_ids for o in llm.generate(free, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
  greedy = SamplingParams(temperature=0, max_tokens=12)
  mixed = llm.generate([free[0], PROMPT, free[1], PROMPT],
                       [greedy, SamplingParams(temperature=0, max_tokens=12, bad_words=["there"]), greedy,
                        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[13, 14])], use_tqdm=False)
  assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
  assert set(mixed[3].outputs[0].token_ids) <= {13, 14}
  assert_all_free(llm)


# ---- custom logits processors
class ForceToken(LogitsProcessor):
  """vLLM's example processor: rows whose request has extra_args {"target_token": t} always emit t."""
  seen: ClassVar[list[BatchUpdate | None]] = []

  def __init__(self, vllm_config, device, is_pin_memory):
    self.targets: dict[int, int] = {}

  @classmethod
  def validate_params(cls, sampling_params):
    target = (sampling_params.extra_args or {}).get("target_token")
    if target is not None and not (isinstance(target, int) and 0 <= target < 512): raise ValueError(f"target_token {target!r}")

  def is_argmax_invariant(self) -> bool: return False

  def update_state(self, batch_update):
    ForceToken.seen.append(batch_update)
    if batch_update is None: return
    for index, params, _, _ in batch_update.added:
      target = (params.extra_args or {}).get("target_token")
      if target is None: self.targets.pop(index, None)
      else: self.targets[index] = target
    for index in batch_update.removed: self.targets.pop(index, None)
    for a, b, direction in batch_update.moved:
      ta, tb = self.targets.pop(a, None), self.targets.pop(b, None)
      if ta is not None: self.targets[b] = ta
      if tb is not None and direction is MoveDirectionality.SWAP: self.targets[a] = tb

  def apply(self, logits: Tensor) -> Tensor:
    if not self.targets: return logits
    rows, vocab = logits.shape
    target = np.full((rows, 1), -1, np.int32)
    for index, token in self.targets.items(): target[index] = token
    hit = Tensor(target).to(logits.device) == Tensor.arange(vocab).reshape(1, vocab).to(logits.device)
    keep = (Tensor(target).to(logits.device) < 0)
    return (keep | hit).where(logits, float("-inf"))


@pytest.mark.slow
def test_logits_processor_sees_the_batch_and_forces_its_rows(stories_dir, reference):
  llm = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64, logits_processors=[ForceToken])
  params = [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0, max_tokens=6, extra_args={"target_token": 13})]
  outs = llm.generate([reference["prompt_ids"], PROMPT], params, use_tqdm=False)
  assert outs[0].outputs[0].token_ids == reference["greedy_ids"][:10]
  assert outs[1].outputs[0].token_ids == [13] * 6
  assert any(u is not None and u.added for u in ForceToken.seen) and any(u is not None and u.removed for u in ForceToken.seen)
  with pytest.raises(SamplingParamsError) as e: llm.generate([PROMPT], SamplingParams(extra_args={"target_token": 10**6}), use_tqdm=False)
  assert e.value.param == "extra_args" and "target_token" in str(e.value)
  assert_all_free(llm)


def test_the_mask_thread_ends_with_its_builder():
  """The thread a grammar row's masks are filled on belongs to the builder: dropping the builder (its engine gone) ends
  it, no thread left behind."""
  import gc
  import threading
  import time
  pytest.importorskip("llguidance")
  # (threads of engines that earlier tests left to the collector, or froze out of its reach, are not this builder's)
  earlier = {t for t in threading.enumerate() if t.name.startswith("tinyvllm-masks")}
  builder = TokenControlsBuilder(512)
  seq = Sequence("g", [1], SP(), seed=0)
  seq.grammar = object()   # (build only notes the row; nothing is filled here)
  controls = builder.build([seq], [0], np.zeros((0, 0), np.int32), 1, 2)
  masks = lambda: [t for t in threading.enumerate() if t.name.startswith("tinyvllm-masks") and t not in earlier]
  controls.pool.submit(lambda: None).result()   # the thread runs
  assert len(masks()) == 1
  del builder, controls
  gc.collect()
  deadline = time.monotonic() + 10
  while masks() and time.monotonic() < deadline: time.sleep(0.01)
  assert not masks()
