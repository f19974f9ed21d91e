"""Serving benchmark: an HTTP client that streams /v1/completions from a running server (vLLM's `bench serve`).

Random token-id prompts of exactly input_len tokens, ignore_eos and max_tokens output_len (so each request returns
exactly output_len tokens), Poisson arrivals at request_rate (inf: all at once), at most max_concurrency in flight.
A test request, then num_warmups warm-up requests (other random prompts of the same lengths, sent together) run
first, neither timed nor counted.
TTFT is the time to the first streamed token, ITL the gaps between later chunks, TPOT = (latency - TTFT) / (output
tokens - 1). This module is a pure client: it does not import the engine or tinygrad. It streams through aiohttp, as
vLLM's benchmark does: one process reads about 1.7x more streamed events a second than through httpx (whose ceiling,
near 15,000 a second, capped what a fast server could be measured at). `client_cpu` in the result is the share of the
run the client's process spent on the CPU: near 1.0, the client, not the server, set the pace.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

METRICS = ("ttft", "tpot", "itl", "e2el")
PROMPT_ID_LIMIT = 10000       # ids are drawn from [0, min(vocab, 10000)), as the offline benchmark does


@dataclass
class ServeBenchConfig:
  url: str
  num_prompts: int
  input_len: int
  output_len: int
  request_rate: float = math.inf
  max_concurrency: int | None = None
  model: str | None = None
  seed: int = 0
  goodput: dict[str, float] = field(default_factory=dict)     # metric -> SLO in ms
  vocab_size: int | None = None
  api_key: str | None = None
  progress: bool = True
  num_warmups: int = 0


@dataclass
class RequestResult:
  prompt_len: int
  success: bool = False
  error: str = ""
  output_tokens: int = 0
  ttft: float = 0.0
  latency: float = 0.0
  itl: list[float] = field(default_factory=list)

  @property
  def tpot(self) -> float | None:
    return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
  """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
  slos = {}
  for item in items or []:
    name, _, value = item.partition(":")
    if name not in ("ttft", "tpot", "e2el"): raise ValueError(f"goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
    try: slos[name] = float(value)
    except ValueError: raise ValueError(f"goodput SLO {item!r} is not a number of milliseconds") from None
  return slos


async def _sse_chunks(resp: aiohttp.ClientResponse):
  async for line in resp.content:
    if not line.startswith(b"data:"): continue
    data = line[5:].strip()
    if data == b"[DONE]": return
    yield json.loads(data)


def _headers(cfg: ServeBenchConfig) -> dict[str, str]:
  return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def send_request(session: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str, prompt: list[int]) -> RequestResult:
  payload = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}
  result, start = RequestResult(len(prompt)), time.perf_counter()
  last = start
  try:
    async with session.post(f"{cfg.url}/v1/completions", json=payload, headers=_headers(cfg)) as resp:
      if resp.status != 200:
        result.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
        return result
      async for chunk in _sse_chunks(resp):
        if "error" in chunk:
          result.error = str(chunk["error"].get("message"))
          return result
        now = time.perf_counter()
        if chunk.get("choices"):      # one engine step's tokens
          if result.ttft == 0.0: result.ttft = now - start
          else: result.itl.append(now - last)
          last = now
        if chunk.get("usage"): result.output_tokens = chunk["usage"]["completion_tokens"]
  except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:   # ValueError: bad JSON, or a line past the buffer
    result.error = f"{type(e).__name__}: {e}"
    return result
  result.latency = time.perf_counter() - start
  result.success = result.output_tokens > 0
  if not result.success: result.error = "the stream ended without a usage chunk"
  return result


async def _server_model(session: aiohttp.ClientSession, cfg: ServeBenchConfig) -> tuple[str, int | None]:
  async with session.get(f"{cfg.url}/v1/models", headers=_headers(cfg)) as resp:
    resp.raise_for_status()
    card = (await resp.json())["data"][0]
  return card["id"], card.get("vocab_size")


def random_prompts(cfg: ServeBenchConfig, vocab_size: int, count: int | None = None, seed: int | None = None) -> list[list[int]]:
  rng, high = random.Random(cfg.seed if seed is None else seed), min(vocab_size, PROMPT_ID_LIMIT)
  return [[rng.randrange(high) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts if count is None else count)]


def arrival_gaps(cfg: ServeBenchConfig) -> list[float]:
  """Seconds to wait after sending each request: exponential at request_rate (a Poisson process), 0 when inf."""
  if math.isinf(cfg.request_rate): return [0.0] * cfg.num_prompts
  rng = random.Random(cfg.seed + 1)
  return [rng.expovariate(cfg.request_rate) for _ in range(cfg.num_prompts)]


async def run_benchmark(cfg: ServeBenchConfig) -> dict[str, Any]:
  # no connection limit, no total timeout (a stream lasts as long as the server takes); lines up to 1 MiB
  session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20,
                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
  async with session as client:
    model, server_vocab = await _server_model(client, cfg)
    model = cfg.model or model
    vocab = cfg.vocab_size or server_vocab
    if not vocab: raise ValueError("the server does not report its vocabulary size: pass --vocab-size")
    prompts = random_prompts(cfg, vocab)
    probe = await send_request(client, cfg, model, prompts[0])   # fail fast (and warm up) before timing anything
    if not probe.success: raise RuntimeError(f"the test request failed: {probe.error}")
    limiter = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    await _warm_up(client, cfg, model, random_prompts(cfg, vocab, cfg.num_warmups, seed=cfg.seed + 2), limiter)
    bar = tqdm(total=cfg.num_prompts, desc="requests", disable=not cfg.progress, dynamic_ncols=True)

    async def one(prompt: list[int]) -> RequestResult:
      async with limiter if limiter is not None else contextlib.nullcontext():
        result = await send_request(client, cfg, model, prompt)
      bar.update(1)
      return result

    start, cpu_start, tasks = time.perf_counter(), time.process_time(), []
    for prompt, gap in zip(prompts, arrival_gaps(cfg), strict=True):
      tasks.append(asyncio.create_task(one(prompt)))
      if gap: await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    client_cpu = (time.process_time() - cpu_start) / duration
    bar.close()
  return {"model": model, **summarize(results, duration, cfg.goodput), "client_cpu": client_cpu, "config": _config_json(cfg)}


async def _warm_up(client: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str, prompts: list[list[int]],
                   limiter: asyncio.Semaphore | None) -> None:
  """The warm-up requests, all at once (at most max_concurrency in flight): prompts other than the timed ones, so that
  the timed run finds none of them in the prefix cache."""
  async def one(prompt: list[int]) -> RequestResult:
    async with limiter if limiter is not None else contextlib.nullcontext():
      return await send_request(client, cfg, model, prompt)
  for result in await asyncio.gather(*(one(p) for p in prompts)):
    if not result.success: raise RuntimeError(f"a warm-up request failed: {result.error}")


def _config_json(cfg: ServeBenchConfig) -> dict[str, Any]:
  out = asdict(cfg)
  out.pop("api_key")
  out["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
  return out


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
  ms = np.asarray(seconds, dtype=np.float64) * 1000 if seconds else np.zeros(1)
  return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
          f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
  values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
  return all(values[name] * 1000 <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict[str, Any]:
  ok = [r for r in results if r.success]
  inputs, outputs = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
  out: dict[str, Any] = {
    "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
    "total_input_tokens": inputs, "total_output_tokens": outputs, "request_throughput": len(ok) / duration,
    "output_throughput": outputs / duration, "total_token_throughput": (inputs + outputs) / duration,
  }
  samples = {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot) is not None],
             "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
  for name in METRICS: out.update(_stats(name, samples[name]))
  if goodput: out["request_goodput"] = sum(_meets(r, goodput) for r in ok) / duration
  out["errors"] = sorted({r.error for r in results if not r.success})[:10]
  return out


def report(m: dict[str, Any]) -> str:
  lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="),
           f"{'Successful requests:':<44}{m['completed']:>16}", f"{'Failed requests:':<44}{m['failed']:>16}",
           f"{'Benchmark duration (s):':<44}{m['duration_s']:>16.2f}",
           f"{'Total input tokens:':<44}{m['total_input_tokens']:>16}", f"{'Total generated tokens:':<44}{m['total_output_tokens']:>16}",
           f"{'Request throughput (req/s):':<44}{m['request_throughput']:>16.2f}",
           f"{'Output token throughput (tok/s):':<44}{m['output_throughput']:>16.2f}",
           f"{'Total token throughput (tok/s):':<44}{m['total_token_throughput']:>16.2f}"]
  if "request_goodput" in m: lines.append(f"{'Request goodput (req/s):':<44}{m['request_goodput']:>16.2f}")
  titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)", "itl": "Inter-token Latency",
            "e2el": "End-to-end Latency"}
  for name in METRICS:
    lines.append("{s:{c}^60}".format(s=f" {titles[name]} ", c="-"))
    for stat in ("mean", "median", "p90", "p99"):
      lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<44}{m[f'{stat}_{name}_ms']:>16.2f}")
  if "client_cpu" in m: lines.append(f"{'Client CPU share (1.0: the client set the pace):':<50}{m['client_cpu']:>10.2f}")
  for error in m.get("errors", []): lines.append(f"error: {error}")
  lines.append("=" * 60)
  return "\n".join(lines)
