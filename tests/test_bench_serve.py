"""`bench serve` (a pure HTTP client) against a real server on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import REPO, ServerProcess
from tinyvllm.bench.serve import RequestResult, parse_goodput, summarize

STATS = ("mean", "median", "p90", "p99")


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  with ServerProcess(stories_dir, tmp_path_factory.mktemp("log") / "server.log", "--num-gpu-blocks", "128") as s: yield s


def bench(server, result_file, *args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, str(REPO / "main.py"), "bench", "serve", "--url", server.url, "--result-file", str(result_file),
         "--disable-tqdm", *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def prompt_tokens(server) -> float:
  text = httpx.get(f"{server.url}/metrics").text
  return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "tinyvllm:prompt_tokens_total")


@pytest.mark.slow
def test_bench_serve_all_at_once(server, tmp_path):
  before = prompt_tokens(server)
  out = bench(server, tmp_path / "r.json", "--num-prompts", "6", "--input-len", "24", "--output-len", "8", "--request-rate", "inf",
              "--max-concurrency", "4", "--seed", "1", "--goodput", "ttft:600000", "tpot:600000", "e2el:600000")
  assert out.returncode == 0, out.stderr
  assert "Serving Benchmark Result" in out.stdout and "Mean TTFT (ms):" in out.stdout
  r = json.loads((tmp_path / "r.json").read_text())
  assert (r["completed"], r["failed"], r["errors"]) == (6, 0, [])
  assert r["total_input_tokens"] == 6 * 24 and r["total_output_tokens"] == 6 * 8
  assert prompt_tokens(server) - before == 7 * 24   # the test request and six timed ones, each exactly 24 prompt tokens
  assert r["duration_s"] > 0 and r["request_throughput"] == pytest.approx(6 / r["duration_s"])
  assert r["output_throughput"] == pytest.approx(48 / r["duration_s"])
  assert r["total_token_throughput"] == pytest.approx((48 + 144) / r["duration_s"])
  assert r["request_goodput"] == pytest.approx(r["request_throughput"])   # SLOs nobody misses
  for name in ("ttft", "tpot", "itl", "e2el"):
    values = [r[f"{stat}_{name}_ms"] for stat in STATS]
    assert all(v > 0 for v in values) and values[1] <= values[2] <= values[3], (name, values)
  assert r["mean_ttft_ms"] < r["mean_e2el_ms"] and r["p99_e2el_ms"] <= r["duration_s"] * 1000
  assert r["config"]["request_rate"] == "inf" and r["config"]["max_concurrency"] == 4 and "api_key" not in r["config"]
  assert r["client_cpu"] > 0 and "Client CPU share" in out.stdout   # the client's own CPU time over the run


@pytest.mark.slow
def test_bench_serve_warm_up_requests_reach_the_server_but_are_not_counted(server, tmp_path):
  before = prompt_tokens(server)
  out = bench(server, tmp_path / "r.json", "--num-prompts", "2", "--input-len", "20", "--output-len", "4", "--num-warmups", "3")
  assert out.returncode == 0, out.stderr
  r = json.loads((tmp_path / "r.json").read_text())
  assert (r["completed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 2 * 20, 2 * 4)
  assert prompt_tokens(server) - before == (1 + 3 + 2) * 20   # the test request, three warm-ups, two timed ones
  assert r["config"]["num_warmups"] == 3
  assert bench(server, tmp_path / "r.json", "--warmup", "-1").returncode == 2   # --warmup: the same flag


@pytest.mark.slow
def test_bench_serve_poisson_rate_and_unmet_slo(server, tmp_path):
  out = bench(server, tmp_path / "r.json", "--num-prompts", "4", "--input-len", "24", "--output-len", "8", "--request-rate", "20",
              "--goodput", "ttft:0.001")
  assert out.returncode == 0, out.stderr
  r = json.loads((tmp_path / "r.json").read_text())
  assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 32)
  assert r["request_goodput"] == 0 and r["config"]["request_rate"] == 20


@pytest.mark.slow
def test_bench_serve_refuses_bad_arguments_and_dead_servers(server, tmp_path):
  assert bench(server, tmp_path / "r.json", "--goodput", "latency:5").returncode == 2
  assert bench(server, tmp_path / "r.json", "--request-rate", "0").returncode == 2
  dead = bench(type("S", (), {"url": "http://127.0.0.1:9"})(), tmp_path / "r.json", "--num-prompts", "1")
  assert dead.returncode == 1 and "benchmark failed" in dead.stderr


def test_bench_serve_is_a_pure_client():
  code = "import sys, tinyvllm.bench.serve, tinyvllm.cli; tinyvllm.cli.build_parser(); print('tinygrad' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "False", out.stderr


def test_summary_formulas():
  results = [RequestResult(10, True, output_tokens=11, ttft=0.1, latency=1.1, itl=[0.1] * 10),
             RequestResult(10, True, output_tokens=5, ttft=0.3, latency=0.7, itl=[0.1] * 4),
             RequestResult(10, False, error="HTTP 500")]
  m = summarize(results, duration=2.0, goodput=parse_goodput(["ttft:200", "tpot:150"]))
  assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500"])
  assert m["mean_tpot_ms"] == pytest.approx(100.0)   # (1.1 - 0.1) / 10 and (0.7 - 0.3) / 4
  assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_e2el_ms"] == pytest.approx(900.0)
  assert m["p99_itl_ms"] == pytest.approx(100.0) and m["request_throughput"] == 1.0 and m["output_throughput"] == 8.0
  assert m["request_goodput"] == 0.5   # only the first meets ttft <= 200 ms
