"""Structured output on the GPU (the issue's acceptance 3; docs/benchmarks.md): decode tok/s at batch 64 with every row
under a JSON schema, against free decoding of the same prompts, on the Qwen3-0.6B shape (dummy bf16 weights) with the
real Qwen3 tokenizer (the grammar's tokenizer is the model's).

Greedy decoding with ignore_eos, JSON without optional whitespace (else a random model writes whitespace forever): under
the schema it writes inside a JSON string most of the time (the grammar engine's common case: nearly every token
allowed there) and rarely closes one, so its rows run to max_tokens like the free rows. Each mode runs twice (the first
captures the step layouts, builds the llguidance tokenizer and compiles the grammar) and reports the second: decode
tok/s over the steps after the prompt step, the median step, the rows' token counts, and the host time spent filling
the bitmasks. Results to $OUT/structured_bench.json.

Usage (GPU): DEV=CUDA python bench/structured_bench.py --tokenizer .data/qwen3
       (CPU smoke): python bench/structured_bench.py --smoke
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
from stage_timers import Timers  # (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = {"type": "object", "properties": {
  "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
  "rating": {"type": "integer", "minimum": 0, "maximum": 5}, "summary": {"type": "string"}},
  "required": ["title", "tags", "rating", "summary"]}


class FillTimer:
  """Wraps the runner's bitmask filler to add up the host time its fills take."""
  def __init__(self): self.seconds, self.calls = 0.0, 0

  def install(self):
    from tinyvllm.core.structured_output import BitmaskFiller
    original = BitmaskFiller.fill

    def timed(filler, rows, bitmask):
      t = time.perf_counter()
      original(filler, rows, bitmask)
      self.seconds, self.calls = self.seconds + time.perf_counter() - t, self.calls + 1
    BitmaskFiller.fill = timed


def stage_timers(engine) -> Timers:
  from tinyvllm.worker.runner_steps import LaunchedStep
  from tinyvllm.worker.token_controls import TokenControls
  timers, core = Timers(), engine.core
  timers.wrap(engine, "step", "LLMEngine.step (all)")
  timers.wrap(core, "step", "EngineCore.step")
  timers.wrap(core.scheduler, "schedule", "schedule")
  timers.wrap(core.runner, "prepare", "runner.prepare")
  timers.wrap(core.runner, "launch_forward", "runner.launch_forward")
  timers.wrap(core, "_finish_in_flight", "finish in flight (wait + land)")
  timers.wrap(LaunchedStep, "result", "  wait for the tokens")
  timers.wrap(core.scheduler, "update_from_output", "  update_from_output (grammars advance)")
  timers.wrap(core.runner, "launch", "runner.launch (masks + upload + enqueue)")
  timers.wrap(TokenControls, "fill_bitmask", "  fill the masks")
  return timers


def decode(engine, prompts: list[list[int]], new_tokens: int, structured: bool) -> dict:
  from tinyvllm import SamplingParams
  from tinyvllm.sampling_params import StructuredOutputsParams
  constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if structured else None
  params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=constraint)
  engine.reset_prefix_cache()
  ids = [f"{'json' if structured else 'free'}-{i}" for i in range(len(prompts))]
  for rid, prompt in zip(ids, prompts, strict=True): engine.add_request(rid, prompt, params)
  finals, steps = {}, []
  while not finals and engine.has_unfinished_requests():   # the prompt step (and its tokens read)
    for out in engine.step(): finals[out.request_id] = out
  start = last = time.perf_counter()
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
    now = time.perf_counter()
    steps.append(now - last)
    last = now
  counts = [len(finals[rid].outputs[0].token_ids) for rid in ids]
  decoded = sum(c - 1 for c in counts)   # (each row's first token came from the prompt step)
  texts = [finals[rid].outputs[0].text for rid in ids]
  return {"mode": "json_schema" if structured else "free", "batch": len(prompts), "decode_tok_s": decoded / (last - start),
          "median_step_ms": float(np.median(steps)) * 1e3, "steps": len(steps), "tokens_min": min(counts), "tokens_max": max(counts),
          "sample": texts[0][:120], "token_ids": [finals[rid].outputs[0].token_ids for rid in ids]}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen3-0.6b")
  p.add_argument("--tokenizer", default=".data/qwen3", help="the Qwen3 tokenizer folder (../shared/data/tokenizers/qwen3)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--smoke", action="store_true", help="CPU check: the shipped stories260K (random weights), batch 4, 16 tokens")
  p.add_argument("--profile", type=int, default=0, help="print the N functions of most host time in the structured run")
  p.add_argument("--stages", action="store_true", help="time the engine step's stages (host ms a call) in both runs")
  p.add_argument("--repeat", type=int, default=1, help="timed runs of each mode (the report takes each mode's median)")
  p.add_argument("--check-sync", action="store_true",
                 help="then check the structured run's greedy tokens against an engine without asynchronous scheduling")
  args = p.parse_args()
  from tinygrad import Device

  from tinyvllm import LLM
  if args.smoke:
    from tinyvllm.model.embedded import embedded_model_path
    llm = LLM(str(embedded_model_path()), load_format="dummy", max_num_seqs=4, num_gpu_blocks=64)
    batch, prompt_len, new_tokens = 4, 8, 16
  else:
    settings = dict(load_format="dummy", dtype="bfloat16", tokenizer=args.tokenizer, max_num_seqs=args.batch, kv_cache_memory=8,
                    enable_prefix_caching=False, cuda_graph_sizes=[args.batch])
    llm = LLM(args.model, **settings)
    batch, prompt_len, new_tokens = args.batch, args.prompt_len, args.new_tokens
  engine, timer = llm.engine, FillTimer()
  timer.install()
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, min(10000, engine.model_config.vocab_size), size=(batch, prompt_len)).tolist()
  for structured in (False, True): decode(engine, prompts, new_tokens, structured)   # warm: captures, the grammar
  runs: dict[bool, list[dict]] = {False: [], True: []}
  for _ in range(args.repeat):   # the modes alternate, so that a slower spell of the host touches both
    for structured in (False, True):
      timer.seconds = timer.calls = 0
      stages = stage_timers(engine) if args.stages else None
      profiler = cProfile.Profile() if args.profile and structured else None
      if profiler is not None: profiler.enable()
      row = decode(engine, prompts, new_tokens, structured)
      if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
      if stages is not None:
        stages.restore()
        row["stages_ms_per_call"] = {name: stage["ms_per_call"] for name, stage in stages.report().items()}
      row["bitmask_fill_ms_per_step"] = timer.seconds / max(timer.calls, 1) * 1e3
      print(json.dumps({k: v for k, v in row.items() if k != "token_ids"}), flush=True)
      runs[structured].append(row)
  rows = [sorted(runs[mode], key=lambda r: r["decode_tok_s"])[len(runs[mode]) // 2] for mode in (False, True)]
  pair_ratios = sorted(j["decode_tok_s"] / f["decode_tok_s"] for f, j in zip(runs[False], runs[True], strict=True))
  free, structured_row = rows
  if args.check_sync and not args.smoke:
    del llm, engine
    reference = decode(LLM(args.model, **settings, async_scheduling=False).engine, prompts, new_tokens, True)["token_ids"]
    equal = sum(a == b for a, b in zip(runs[True][-1]["token_ids"], reference, strict=True))
    print(f"sync check: {equal} of {batch} structured rows equal the engine without asynchronous scheduling", flush=True)
    structured_row["sync_equal_rows"] = equal
  for row in rows: row.pop("token_ids")
  summary = {"ratio": structured_row["decode_tok_s"] / free["decode_tok_s"], "round_ratios": pair_ratios,
             "device": str(Device.DEFAULT), "rows": rows}
  print(f"batch {batch}: free {free['decode_tok_s']:.0f} tok/s, every row under a JSON schema {structured_row['decode_tok_s']:.0f} "
        f"tok/s ({summary['ratio']:.1%} of the medians; rounds {', '.join(f'{r:.0%}' for r in pair_ratios)}); "
        f"bitmask fill {structured_row['bitmask_fill_ms_per_step']:.3f} ms a step", flush=True)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "structured_bench.json").write_text(json.dumps(summary, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
