"""`bench`: speed measurements: decode and throughput (in-process) and serve (an HTTP client against a running server)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from tinyvllm.cli.args import (
  add_engine_args,
  bounded,
  engine_kwargs,
  model_of,
  non_negative_int,
  output_file,
  positive_int,
)


def decode_tokens(text: str) -> int:
  """bench decode's --max-tokens: the first token comes from the prefill, so a decode measurement needs a second."""
  value = positive_int(text)
  if value < 2:
    raise argparse.ArgumentTypeError(f"must be >= 2 for a decode measurement (the first token comes from the prefill), got {text!r}")
  return value


def goodput_slo(text: str) -> str:
  """One --goodput item, METRIC:MS with a metric bench serve measures and a time > 0."""
  try:
    from tinyvllm.bench.serve import parse_goodput  # a pure HTTP client: no engine imported
  except ImportError as e: raise argparse.ArgumentTypeError(f"needs the serve extra ({e.name} is not installed)") from None
  try: ms = parse_goodput([text])
  except ValueError as e: raise argparse.ArgumentTypeError(str(e)) from None
  if not all(0 < v < float("inf") for v in ms.values()):
    raise argparse.ArgumentTypeError(f"a goodput SLO must be a number of milliseconds > 0, got {text!r}")
  return text


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("bench", help="measure speed")
  kinds = p.add_subparsers(dest="bench", required=True)
  d = kinds.add_parser("decode", help="decode tok/s with the KV cache (and, with --no-kv-cache, recomputing the whole sequence "
                                      "for every token)")
  add_engine_args(d)
  d.add_argument("--batch-size", type=positive_int, default=1, help="sequences decoded together")
  d.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per sequence")
  d.add_argument("--max-tokens", type=decode_tokens, default=256,
                 help="new tokens per sequence (>= 2: the first comes from the prefill, the decode phase makes the rest)")
  d.add_argument("--no-kv-cache", action="store_true",
                 help="also time decoding without a KV cache: each new token comes from a fresh one-token request over the "
                      "whole sequence so far (prefix cache emptied), so a step costs a full prefill of prompt + tokens so far "
                      "plus a request's set-up")
  d.add_argument("--prompts", choices=("random", "repeated"), default="random",
                 help="random token ids, or a text the model is about to repeat: its own greedy text from its BOS token, "
                      "then that text again from the start, cut at a different point per prompt (where n-gram speculation pays)")
  d.set_defaults(run=run_decode)
  add_throughput_parser(kinds)
  add_serve_parser(kinds)


def add_throughput_parser(kinds: argparse._SubParsersAction) -> None:
  t = kinds.add_parser("throughput", help="offline throughput: a seeded mix of random-token requests through one generate call")
  add_engine_args(t)
  w = t.add_argument_group("workload (vLLM's random dataset)")
  w.add_argument("--num-prompts", type=positive_int, default=1000, help="requests in the timed run")
  w.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per request (random token ids)")
  w.add_argument("--output-len", type=positive_int, default=128, help="tokens each request generates (ignore_eos, temperature 1)")
  w.add_argument("--random-range-ratio", type=bounded(float, 0, 1, high_open=True), default=0.0,
                 help="lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: every request the same lengths)")
  w.add_argument("--num-iters-warmup", type=non_negative_int, default=2,
                 help="untimed runs of the same requests before the timed one (default 2: on the CPU a step layout with "
                      "prompt chunks is captured when met the second time)")
  w.add_argument("--output-json", type=output_file, help="write the results, the settings and the machine as JSON here")
  t.set_defaults(run=run_throughput)


def add_serve_parser(kinds: argparse._SubParsersAction) -> None:
  s = kinds.add_parser("serve", help="serving benchmark: stream /v1/completions from a running server (a pure HTTP client)")
  s.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
  s.add_argument("--model", help="model name to send (default: the server's)")
  s.add_argument("--num-prompts", type=positive_int, default=100)
  s.add_argument("--input-len", type=positive_int, default=512, help="prompt tokens per request (random token ids)")
  s.add_argument("--output-len", type=positive_int, default=128, help="tokens each request generates (ignore_eos)")
  s.add_argument("--request-rate", type=bounded(float, 0, low_open=True, allow_inf=True), default=float("inf"),
                 help="requests/s, Poisson arrivals (inf: all at once)")
  s.add_argument("--max-concurrency", type=positive_int, help="most requests in flight at once (default: no cap)")
  s.add_argument("--seed", type=non_negative_int, default=0)
  s.add_argument("--num-warmups", "--warmup", type=non_negative_int, default=0,
                 help="warm-up requests sent (together) before the timed ones, neither timed nor counted")
  s.add_argument("--goodput", nargs="+", type=goodput_slo, metavar="METRIC:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
  s.add_argument("--vocab-size", type=positive_int, help="draw prompt ids below this (default: the server's vocab_size)")
  s.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"), help="default: $TINYVLLM_API_KEY")
  s.add_argument("--result-file", type=output_file, help="write the results as JSON here")
  s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
  s.set_defaults(run=run_serve)


def run_decode(args: argparse.Namespace) -> int:
  from tinyvllm.bench.decode import run_decode_bench
  from tinyvllm.engine.llm import LLM
  if args.max_model_len is not None and not _decode_fits(args, args.max_model_len): return 2   # before the model loads
  llm = LLM(model_of(args), **engine_kwargs(args))
  if not _decode_fits(args, llm.engine.max_model_len): return 2
  results = run_decode_bench(llm.engine, args.batch_size, args.prompt_len, args.max_tokens, args.no_kv_cache,
                             repeated=args.prompts == "repeated")
  for r in results: print(r.line())
  if len(results) == 2:
    print(f"the KV cache makes decoding {results[0].decode_tok_s / results[1].decode_tok_s:.1f}x faster than a full prefill "
          "of the sequence for every token")
  return 0


def _decode_fits(args: argparse.Namespace, context: int) -> bool:
  if args.prompt_len + args.max_tokens <= context: return True
  _usage_error(f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} exceeds the context ({context} tokens): lower them")
  return False


def run_throughput(args: argparse.Namespace) -> int:
  from tinyvllm.bench.throughput import Workload, report_json, run_throughput
  from tinyvllm.engine.llm import LLM
  llm = LLM(model_of(args), **engine_kwargs(args))
  engine = llm.engine
  workload = Workload.random(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                             engine.model_config.vocab_size, seed=args.seed if args.seed is not None else 0)
  if workload.input_lens[1] + workload.output_lens[1] > engine.max_model_len:
    return _usage_error(f"the longest request ({workload.input_lens[1]} prompt + {workload.output_lens[1]} output tokens) "
                        f"exceeds the context ({engine.max_model_len}): lower --input-len, --output-len or --random-range-ratio")
  result = run_throughput(llm, workload, [workload] * args.num_iters_warmup)
  print(result.line())
  print(result.cpu_line())
  print(result.warmup_line())
  if args.output_json:
    flags = {"input_len": args.input_len, "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
             "num_iters_warmup": args.num_iters_warmup}
    report = report_json(result, workload, flags, engine, args.model or "stories260K (shipped)")
    with open(args.output_json, "w") as f: json.dump(report, f, indent=1)
  return 0


def run_serve(args: argparse.Namespace) -> int:
  try:
    from tinyvllm.bench.serve import ServeBenchConfig, parse_goodput, report, run_benchmark
  except ImportError as e:
    return _usage_error(f"`bench serve` needs the serve extra ({e.name} is not installed): pip install -e '.[serve]'")
  goodput = parse_goodput(args.goodput)   # each item was checked at parse time (goodput_slo)
  cfg = ServeBenchConfig(url=args.url.rstrip("/"), num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                         request_rate=args.request_rate, max_concurrency=args.max_concurrency, model=args.model, seed=args.seed,
                         goodput=goodput, vocab_size=args.vocab_size, api_key=args.api_key, progress=not args.disable_tqdm,
                         num_warmups=args.num_warmups)
  try:
    result = asyncio.run(run_benchmark(cfg))
  except Exception as e:  # the server is unreachable or refused the test request
    return _usage_error(f"benchmark failed: {type(e).__name__}: {e}", code=1)
  print(report(result))
  if args.result_file:
    with open(args.result_file, "w") as f: json.dump(result, f, indent=2)
  return 0 if result["failed"] == 0 else 1


def _usage_error(message: str, code: int = 2) -> int:
  print(f"error: {message}", file=sys.stderr)
  return code
