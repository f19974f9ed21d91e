"""Speculative decoding with n-gram proposals: the scheduler verifies a decoding sequence's proposals in its next step
and gives back the rejected ones' slots (the fake engine loop proves every position is read back right under random
proposals and acceptances, with prefix caching and preemption); on stories260K, greedy outputs with speculation equal
those without it, batched with varied lengths, with penalties and logprobs, under preemption, and aborts leave nothing
behind; the verification step's sampling keeps the target distribution (chi-square, top-k and temperature); the
speculative_config is vLLM's and its bad values are refused by name."""
from __future__ import annotations

import random

import numpy as np
import pytest
from tinygrad import Tensor

from tests.conftest import assert_all_free
from tests.scheduler_sim import random_requests, sim
from tests.test_block_manager import make_seq
from tests.test_rejection_sampler import CHI2_4_DOF, chi_square
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, EngineConfig, SpeculativeConfig
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.scheduler import Scheduler, SchedulerConfig
from tinyvllm.core.sequence import SequenceStatus
from tinyvllm.engine.speculator import proposal_limit
from tinyvllm.layers.rejection_sampler import greedy_verify, rejection_sample, verify
from tinyvllm.layers.sampler import SamplingBatch

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# stories260K continues these with text it has seen in them, so n-gram proposals are often accepted
PROMPTS = ["Once upon a time, there was a little girl named Lily. Lily liked to play. Once upon a time, there was",
           "Tom had a red ball. Tom liked the red ball. Tom", "The cat sat on the mat. The dog sat on the mat. The",
           "Lily", "One day, a big dog saw a cat. The big dog said, \"Hello cat!\" The cat said"]


# ---- the scheduler ----
def decoding(s, prompt: list[int], max_tokens: int = 16):
  """A sequence that has computed its prompt and sampled its first token."""
  (seq,) = s.add(prompt, max_tokens=max_tokens)
  s.step()
  assert seq.decoding and len(seq.output_token_ids) == 1
  return seq


def test_a_step_verifies_the_last_token_and_its_proposals_and_lands_the_accepted():
  s = sim(num_blocks=16, block_size=4)
  seq = decoding(s, [1, 2, 3, 4, 5])
  s.sched.set_proposals({seq: [8, 9, 10]})
  out = s.sched.schedule()
  (item,) = out.scheduled
  assert (item.start, item.num_new_tokens, item.spec_token_ids, item.samples) == (5, 4, (8, 9, 10), True)
  assert seq.spec_token_ids == [] and seq.num_computed_tokens == 9
  s.sched.update_from_output(out, [[8, 9, 42]], lambda *a: None)   # two accepted, then the target's own token
  assert seq.output_token_ids[1:] == [8, 9, 42] and seq.num_computed_tokens == seq.num_tokens - 1 == 8
  assert (seq.num_draft_tokens, seq.num_accepted_tokens) == (3, 2)
  spec = s.sched.spec
  assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 2)


def test_a_block_holding_only_rejected_proposals_is_freed_and_the_cache_registers_accepted_tokens_only():
  s = sim(num_blocks=16, block_size=4)
  seq = decoding(s, [1, 2, 3, 4])            # positions 0-3 computed: one full block
  s.sched.set_proposals({seq: [8, 9, 10, 11]})
  out = s.sched.schedule()                   # positions 4-8: two more blocks
  assert len(s.alloc.block_table(seq)) == 3 and s.alloc.num_used_blocks == 3
  s.sched.update_from_output(out, [[8, 9, 42]], lambda *a: None)   # 10 and 11 rejected: position 8 held only 10
  assert seq.num_computed_tokens == 7 and len(s.alloc.block_table(seq)) == 2 and s.alloc.num_used_blocks == 2
  # the second block (positions 4-7) is not full of known-computed tokens yet: nothing past the first is cached
  assert s.alloc.num_cached_blocks == 1


def test_proposals_never_preempt_and_stay_within_the_token_budget():
  s = sim(num_blocks=2, block_size=4, max_num_batched_tokens=3)
  a = decoding(s, [1, 2, 3])                 # one block, 3 of 4 slots computed
  s.add([5, 6, 7, 8], max_tokens=4)
  s.sched.set_proposals({a: [8, 9, 10]})
  out = s.sched.schedule()                   # the budget of 3 leaves a its last token and two proposals
  assert [(i.seq, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled] == [(a, 3, (8, 9))]
  s.sched.update_from_output(out, [[1]], lambda *a: None)
  s2 = sim(num_blocks=2, block_size=4)
  c = decoding(s2, [1, 2])
  s2.add([5, 6, 7], max_tokens=4)
  s2.step()                                  # the other sequence takes the other block
  s2.sched.set_proposals({c: [8, 9]})
  out = s2.sched.schedule()                  # c's proposals need a block: it decodes one token, nobody is preempted
  assert not out.preempted and (c.seq_id, 1, ()) in [(i.seq.seq_id, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled]


@pytest.mark.parametrize("seed", range(6))
def test_random_proposals_and_acceptances_keep_every_position_right(seed):
  """Every position read back holds its sequence's token; rejected positions are computed again, others once."""
  rng = random.Random(seed)
  s = sim(num_blocks=24, block_size=4, prefix=bool(seed % 2), speculate=rng, max_num_seqs=6, max_num_batched_tokens=16)
  for prompt, max_tokens, n in random_requests(rng, 14, 4, 24): s.add(prompt, max_tokens=max_tokens, n=n)
  s.run()
  s.check_done()
  assert s.sched.spec.num_draft_tokens > 0 and s.sched.spec.num_accepted_tokens > 0


def test_a_proposal_limit_keeps_emitted_tokens_within_max_tokens_and_positions_within_the_context():
  seq = make_seq([1] * 10, max_tokens=5)
  assert proposal_limit(seq, max_model_len=100) == 4      # the step may emit 5: all of max_tokens
  assert proposal_limit(seq, max_model_len=12) == 2       # positions 9 .. 11
  assert proposal_limit(seq, max_model_len=10) == 0


# ---- the verification's sampling ----
def test_verification_samples_from_the_target_distribution_with_temperature_and_top_k():
  """Rows of one sequence at temperature 0.7 with top-k 4 (each row its own seed): the first emitted token, and the one
  after an accepted proposal, have softmax(logits / 0.7) over the top 4."""
  rows, k = 12000, 2
  logits = np.array([[1.0, 2.0, 0.5, 1.5, -1.0], [0.2, 0.1, 2.0, 0.3, 1.0], [1.0, 0.0, 0.5, 2.0, 0.5]], np.float32)
  def target(row):
    p = np.exp(row / 0.7)
    p[np.argsort(row)[:1]] = 0
    return p / p.sum()
  params = [SamplingParams(temperature=0.7, top_k=4)] * (rows * (k + 1))
  batch = SamplingBatch.build(params, [i // (k + 1) for i in range(rows * (k + 1))], [i % (k + 1) for i in range(rows * (k + 1))],
                              None, rows * (k + 1), 5)
  tokens, emitted = verify(Tensor(np.tile(logits, (rows, 1))), Tensor(batch.params), Tensor(batch.rng), batch.variant,
                           Tensor(np.tile(np.array([[3, 2]], np.int32), (rows, 1))))
  tokens, emitted = tokens.numpy(), emitted.numpy()
  def fits(drawn: np.ndarray, p: np.ndarray) -> bool:   # never a filtered token, and chi-square on the others
    return not np.isin(drawn, np.flatnonzero(p == 0)).any() and chi_square(drawn, p + 1e-30) < CHI2_4_DOF
  assert fits(tokens[:, 0], target(logits[0])) and fits(tokens[emitted > 1, 1], target(logits[1]))
  assert not fits(np.full(rows, 3), target(logits[0]))   # the proposal alone would fail


def test_greedy_verification_equals_the_rejection_sampler_on_one_hot_distributions():
  rng = np.random.default_rng(3)
  target = rng.integers(0, 6, (50, 4)).astype(np.int32)
  drafts = np.where(rng.random((50, 3)) < 0.6, target[:, :3], rng.integers(0, 6, (50, 3))).astype(np.int32)
  drafts[::7, 1:] = -1   # fewer proposals
  fast = [t.numpy() for t in greedy_verify(Tensor(target), Tensor(drafts))]
  full = [t.numpy() for t in rejection_sample(Tensor(np.eye(6, dtype=np.float32)[target]), Tensor(drafts),
                                              Tensor(rng.random((50, 3)).astype(np.float32)), Tensor(np.zeros((50, 4, 6), np.float32)))]
  assert (fast[0] == full[0]).all() and (fast[1] == full[1]).all()


# ---- the engine on stories260K ----
def greedy(max_tokens: int, **kw) -> SamplingParams: return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def plain(stories_dir):
  return LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256)


@pytest.fixture(scope="module")
def speculating(stories_dir):
  return LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256, speculative_config=NGRAM)


def outputs(llm, prompts, params):
  return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_outputs_equal_plain_decoding_batched_with_varied_lengths(plain, speculating):
  params = [greedy(m) for m in (60, 3, 45, 1, 80)]
  assert outputs(speculating, PROMPTS, params) == outputs(plain, PROMPTS, params)
  stats = speculating.engine.core.stats().spec_decoding
  assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
  assert 1 < stats.mean_acceptance_length <= 1 + NGRAM["num_speculative_tokens"]
  assert_all_free(speculating)


def test_penalties_and_logprobs_equal_plain_decoding(plain, speculating):
  params = greedy(40, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logprobs=3)
  ours = speculating.generate(PROMPTS[:3], params, use_tqdm=False)
  ref = plain.generate(PROMPTS[:3], params, use_tqdm=False)
  for a, b in zip(ours, ref, strict=True):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
      assert mine.keys() == theirs.keys()
      assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 and mine[t].rank == theirs[t].rank for t in mine)
  assert sum(o.metrics.num_accepted_tokens for o in ours) > 0
  assert_all_free(speculating)


def test_stop_strings_and_max_tokens_end_where_plain_decoding_does(plain, speculating):
  params = [greedy(50, stop=["mat."]), greedy(7), greedy(33, stop_token_ids=[29])]
  prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
  got = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
         for o in speculating.generate(prompts, params, use_tqdm=False)]
  want = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
          for o in plain.generate(prompts, params, use_tqdm=False)]
  assert got == want and len(got[1][1]) == 7


def test_seeded_sampling_with_speculation_is_reproducible(speculating):
  params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, n=2)
  drafts = speculating.engine.scheduler.spec.num_drafts
  first = [[c.token_ids for c in o.outputs] for o in speculating.generate(PROMPTS[:3], params, use_tqdm=False)]
  again = [[c.token_ids for c in o.outputs] for o in speculating.generate(PROMPTS[:3], params, use_tqdm=False)]
  assert first == again and all(len(t) == 16 for o in first for t in o)
  assert speculating.engine.scheduler.spec.num_drafts > drafts   # the sampled rows were verified, not decoded plainly


def test_greedy_under_preemption_equals_plain_decoding(stories_dir, plain):
  tight = LLM(str(stories_dir), max_num_seqs=5, num_gpu_blocks=24, speculative_config=NGRAM)
  params = greedy(70, ignore_eos=True)
  assert outputs(tight, PROMPTS, params) == outputs(plain, PROMPTS, params)
  assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.scheduler.spec.num_accepted_tokens > 0
  assert_all_free(tight)


@pytest.mark.slow
def test_verifications_laid_out_as_decode_rows_equal_plain_decoding(stories_dir, plain, monkeypatch):
  """A backend that takes small verifications as decode rows (the fused one, for its layer kernel: decode_verify_tokens)
  gets the same greedy tokens: the portable backend made to ask for them here, its attention then reads each row's
  context through the sequence's block table, the step's K/V written first. Steps of up to 8 tokens run so, unpadded,
  so at batch 1 each count of proposals (1..k) is a layout of its own, greedy and sampled: start-up captures them all
  beside the plain decode step."""
  from tinyvllm.layers.portable import PortableBackend
  from tinyvllm.worker import model_runner
  monkeypatch.setattr(PortableBackend, "decode_verify_tokens", 8)
  layouts: list[tuple[int, int]] = []

  def recording(*args, **kwargs):
    host = model_runner_prepare(*args, **kwargs)
    if host.spec_rows > 1: layouts.append(host.arrays["query_index"].shape)
    return host
  model_runner_prepare = model_runner.prepare_batch
  monkeypatch.setattr(model_runner, "prepare_batch", recording)
  rows = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256, cuda_graph_sizes=[1], speculative_config=NGRAM)
  assert rows.engine.runner.num_captures == 1 + 2 * NGRAM["num_speculative_tokens"]
  params = [greedy(m) for m in (60, 3, 45, 1, 80)]
  assert outputs(rows, PROMPTS, params) == outputs(plain, PROMPTS, params)
  assert outputs(rows, PROMPTS[:1], params[:1]) == outputs(plain, PROMPTS[:1], params[:1])
  assert any(tq == 1 for _, tq in layouts) and any(tq > 1 for _, tq in layouts)   # decode rows; a row a sequence above 8 tokens
  assert rows.engine.scheduler.spec.num_accepted_tokens > 0
  assert_all_free(rows)


def test_aborts_mid_verification_leave_nothing_behind(speculating):
  engine = speculating.engine
  for i, prompt in enumerate(PROMPTS): engine.add_request(f"abort-{i}", prompt, greedy(60, ignore_eos=True))
  before = engine.scheduler.spec.num_drafts
  while engine.scheduler.spec.num_drafts < before + 3: engine.step()
  for i in range(len(PROMPTS)): engine.abort_request(f"abort-{i}")
  assert_all_free(speculating)


# ---- configuration ----
def test_speculative_config_takes_vllms_keys():
  raw = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
  spec = EngineConfig(model="m", speculative_config=raw).speculative_config
  assert spec == SpeculativeConfig("ngram", 3, None, 4, 4)
  assert SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": 2}).method == "draft_model"
  assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5


@pytest.mark.parametrize("raw, message", [
  ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
  ({"method": "ngram"}, "num_speculative_tokens must be an integer"),
  ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
  ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
  ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical"}, "acceptance_method not supported"),
  ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
  ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
  ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
  ("ngram", "must be a JSON object"),
])
def test_bad_speculative_configs_are_refused_by_name(raw, message):
  with pytest.raises(ConfigError, match=message): EngineConfig(model="m", speculative_config=raw)


def test_speculation_refuses_asynchronous_scheduling_and_the_static_scheduler():
  with pytest.raises(ConfigError, match="synchronous scheduling"):
    EngineConfig(model="m", speculative_config=NGRAM, async_scheduling=True)
  with pytest.raises(ConfigError, match="continuous scheduler"):
    EngineConfig(model="m", speculative_config=NGRAM, scheduler="static")


def test_the_command_line_takes_speculative_config():
  from tinyvllm.cli import build_parser
  from tinyvllm.cli.args import engine_kwargs
  flag = '{"method": "ngram", "num_speculative_tokens": 2}'
  args = build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config", flag])
  assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}


def test_scheduler_counts_nothing_without_proposals():
  s = Scheduler(BlockManager(8, 4), SchedulerConfig())
  seq = make_seq([1, 2, 3])
  s.add([seq])
  out = s.schedule()
  s.update_from_output(out, [[5]], lambda *a: None)
  assert s.spec.num_drafts == 0 and seq.status is SequenceStatus.RUNNING and not out.speculates


def test_the_cores_stats_count_every_token_a_verification_lands(stories_dir):
  import time

  from tinyvllm.engine.core import EngineCore
  from tinyvllm.engine.messages import EngineCoreRequest
  core = EngineCore(EngineConfig(model=str(stories_dir), num_gpu_blocks=64, max_num_seqs=4, speculative_config=NGRAM))
  prompt = [1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
  core.add_request(EngineCoreRequest("r", prompt, greedy(40, ignore_eos=True), [], time.time()))
  landed = counted = 0
  while core.has_unfinished_requests():
    out = core.step()
    landed += sum(len(o.new_token_ids) for o in out.outputs)
    counted += out.scheduler_stats.step_generation_tokens
  assert landed == counted == 40 and out.scheduler_stats.spec_decoding.num_accepted_tokens > 0


def test_a_greedy_verification_takes_the_argmax_path_even_beside_a_sampled_capture(speculating, monkeypatch):
  """A capture of the rejection sampler covers greedy rows too, but a greedy verification never runs under it."""
  import tinyvllm.worker.model_runner as model_runner
  sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2)
  speculating.generate(PROMPTS[1], sampled, use_tqdm=False)
  def refuse(*args, **kwargs): raise AssertionError("a greedy step ran the rejection sampler")
  monkeypatch.setattr(model_runner, "verify", refuse)
  out = speculating.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)[0]
  assert out.metrics.num_draft_tokens > 0
