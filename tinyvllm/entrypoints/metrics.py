"""Prometheus metrics in the server's own registry: the engine core's state as of its latest step, read at scrape time;
request timings as they happen.

With several API server processes (--api-server-count) the request counters and histograms are prometheus_client's
multiprocess values (files in a folder the supervisor gives every server: PROMETHEUS_MULTIPROC_DIR, set before this
module is imported), and whichever server answers /metrics shows their sums; every server gets each step's stats, so
the engine's gauges are its own."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tinyvllm.engine.dp_client import ReplicaStats
from tinyvllm.engine.messages import SchedulerStats
from tinyvllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class EngineCollector:
  """Gauges and counters from the engine core's latest stats snapshot (it sends one with every step, and after an
  abort), read when /metrics is scraped; nothing while the model loads."""

  def __init__(self, get_stats: Callable[[], SchedulerStats | None]):
    self.get_stats = get_stats

  def describe(self) -> list[Metric]: return []

  def collect(self) -> Iterator[Metric]:
    stats = self.get_stats()
    if stats is None: return
    yield _gauge("num_requests_running", "Requests with sequences in the running batch", stats.num_running_reqs)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting_reqs)
    if stats.swap is not None:
      yield _gauge("num_requests_swapped", "Requests with a sequence preempted into the swap space", stats.swap.num_swapped_reqs)
    yield _gauge("kv_cache_blocks_total", "KV cache blocks in the cache", stats.kv_cache_blocks_total)
    yield _gauge("kv_cache_blocks_used", "KV cache blocks held by sequences", stats.kv_cache_blocks_used)
    yield _gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", stats.kv_cache_usage)
    yield _gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
                 stats.prefix_cache_hit_rate)
    yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries)
    yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits)
    yield _counter("num_preemptions", "Sequences preempted (their blocks taken back, recomputed or swapped in later)",
                   stats.num_preemptions)
    if (swap := stats.swap) is not None:
      yield _gauge("cpu_cache_usage_perc", "Fraction of the swap space's blocks in use (0 to 1)", swap.usage)
      yield _counter("swapped_out_blocks", "KV blocks copied to the swap space", swap.swapped_out_blocks)
      yield _counter("swapped_in_blocks", "KV blocks copied back from the swap space", swap.swapped_in_blocks)
      yield _counter("swap_fallbacks", "Preemptions recomputed because the swap space was full", swap.fallbacks)
    if (spec := stats.spec_decoding) is not None:
      yield _counter("spec_decode_num_drafts", "Verifications: a sequence's proposals checked in a step", spec.num_drafts)
      yield _counter("spec_decode_num_draft_tokens", "Proposed tokens verified", spec.num_draft_tokens)
      yield _counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted", spec.num_accepted_tokens)
      yield _counter("spec_decode_num_emitted_tokens", "Tokens emitted by verifications (accepted proposals and the "
                     "target's own token after them)", spec.num_accepted_tokens + spec.num_drafts)
      yield _gauge("spec_decode_acceptance_rate", "Accepted / proposed tokens since start", spec.acceptance_rate)
      yield _gauge("spec_decode_mean_acceptance_length", "Tokens emitted per verification since start",
                   spec.mean_acceptance_length)


class ReplicaCollector:
  """With data parallelism (vLLM's `engine` label): per replica, its running and waiting requests and KV cache blocks in
  use; the unlabelled families above are the sums over the replicas."""

  def __init__(self, get_replicas: Callable[[], list[ReplicaStats]]):
    self.get_replicas = get_replicas

  def describe(self) -> list[Metric]: return []

  def collect(self) -> Iterator[Metric]:
    replicas = self.get_replicas()
    if not replicas: return
    running = GaugeMetricFamily("tinyvllm:dp_num_requests_running", "Running requests of each replica", labels=["engine"])
    waiting = GaugeMetricFamily("tinyvllm:dp_num_requests_waiting", "Waiting requests of each replica", labels=["engine"])
    blocks = GaugeMetricFamily("tinyvllm:dp_kv_cache_blocks_used", "KV cache blocks in use on each replica", labels=["engine"])
    for r in replicas:
      label = [str(r.engine)]
      if r.stats is None: continue
      running.add_metric(label, r.stats.num_running_reqs)
      waiting.add_metric(label, r.stats.num_waiting_reqs)
      blocks.add_metric(label, r.stats.kv_cache_blocks_used)
    yield from (running, waiting, blocks)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily: return GaugeMetricFamily(f"tinyvllm:{name}", doc, value=value)
def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
  return CounterMetricFamily(f"tinyvllm:{name}", doc, value=value)


class ServerMetrics:
  def __init__(self, get_stats: Callable[[], SchedulerStats | None], get_replicas: Callable[[], list[ReplicaStats]] = lambda: [],
               multiprocess_dir: str | None = None):
    """multiprocess_dir: one of several API servers, where they all keep their request metrics (PROMETHEUS_MULTIPROC_DIR)."""
    self.get_replicas = get_replicas
    self.registry = r = CollectorRegistry()
    self.prompt_tokens = Counter("tinyvllm:prompt_tokens", "Prompt tokens prefilled", registry=r)
    self.generation_tokens = Counter("tinyvllm:generation_tokens", "Tokens generated", registry=r)
    self.request_success = Counter("tinyvllm:request_success", "Engine requests finished, by finish reason", ["finished_reason"],
                                   registry=r)
    self.request_aborted = Counter("tinyvllm:request_aborted", "Engine requests aborted (client gone, shutdown)", registry=r)
    self.ttft = Histogram("tinyvllm:time_to_first_token_seconds", "Time to the first generated token", buckets=_LATENCY_BUCKETS,
                          registry=r)
    self.tpot = Histogram("tinyvllm:time_per_output_token_seconds", "Time between successive outputs of a request",
                          buckets=_TOKEN_BUCKETS, registry=r)
    self.e2e = Histogram("tinyvllm:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)
    self.routed = Counter("tinyvllm:dp_requests_routed", "Requests the router sent to each data-parallel replica", ["engine"],
                          registry=r)
    self._routed_seen: dict[int, int] = {}
    if multiprocess_dir is not None:   # the request metrics are read back from every server's files
      r = self.registry = CollectorRegistry()
      multiprocess.MultiProcessCollector(r, path=multiprocess_dir)
    r.register(EngineCollector(get_stats))
    r.register(ReplicaCollector(get_replicas))

  def render(self) -> bytes:
    self._count_routed()
    return generate_latest(self.registry)

  def _count_routed(self) -> None:
    """The routing counts since the last scrape, into the counter (which several servers' files add up)."""
    for replica in self.get_replicas():
      new = replica.routed - self._routed_seen.get(replica.engine, 0)
      if new: self.routed.labels(str(replica.engine)).inc(new)
      self._routed_seen[replica.engine] = replica.routed

  def tracker(self) -> RequestTracker: return RequestTracker(self)


class RequestTracker:
  """Times one engine request from its arrival: first token, each later output, the end."""

  def __init__(self, metrics: ServerMetrics):
    self.metrics, self.arrival = metrics, time.monotonic()
    self.first: float | None = None
    self.last = self.arrival
    self.done = False

  def observe(self, out: RequestOutput) -> None:
    m, now = self.metrics, time.monotonic()
    new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
    if new_tokens:
      if self.first is None:
        self.first = now
        m.ttft.observe(now - self.arrival)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
      else:
        m.tpot.observe(now - self.last)
      self.last = now
      m.generation_tokens.inc(new_tokens)
    if out.finished:
      self.done = True
      m.e2e.observe(now - self.arrival)
      m.request_success.labels(out.outputs[0].finish_reason or "unknown").inc()

  def close(self) -> None:
    """Called when the request's stream ends, finished or not."""
    if not self.done: self.metrics.request_aborted.inc()
    self.done = True
