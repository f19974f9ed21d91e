"""`serve --data-parallel-size 2 --distributed-executor-backend ray` against a two-node Ray cluster on the loopback
(tests/ray_cluster.py): the server joins it (RAY_ADDRESS), one engine-core actor lands on each node, requests are
served through both, and SIGTERM exits 0 with the actors gone. Skipped without Ray (the test set-up installs it)."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_process import REPO, ServerProcess
from tests.test_core_process import running, wait_gone
from tests.test_server_dp import per_engine, scrape, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray: pip install -e '.[ray]'")]
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # Ray's own switch: every node and its traffic on 127.0.0.1
ACTOR = r"engine core Ray actor of data-parallel rank (\d) running on node (\w+) \(pid (\d+)\)"


@pytest.fixture(scope="module")
def cluster():
  proc = subprocess.Popen([sys.executable, "-m", "tests.ray_cluster"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          env={**os.environ, **LOOPBACK}, text=True)
  try:
    address = proc.stdout.readline().strip() if proc.stdout else ""
    assert address, "the Ray cluster did not start"
    yield address
  finally:
    if proc.stdin: proc.stdin.close()
    try: proc.wait(60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def test_two_replicas_on_a_two_node_cluster(cluster, stories_dir, tmp_path):
  with pytest.MonkeyPatch.context() as env:
    for name, value in {**LOOPBACK, "RAY_ADDRESS": cluster}.items(): env.setenv(name, value)
    server = ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "64", "--data-parallel-size", "2",
                           "--distributed-executor-backend", "ray")
  with server as s:
    wait_until(lambda: len(re.findall(ACTOR, s.log())) == 2)
    actors = re.findall(ACTOR, s.log())
    assert sorted(rank for rank, _, _ in actors) == ["0", "1"] and len({node for _, node, _ in actors}) == 2, s.log()
    pids = {int(pid) for _, _, pid in actors}
    assert all(running(pid) for pid in pids)
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:   # together: the least-loaded replica takes the second
      replies = list(pool.map(lambda _: httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json(), range(2)))
    texts = [r["choices"][0]["text"] for r in replies]
    assert texts[0] == texts[1] and replies[0]["usage"]["completion_tokens"] == 6   # the same greedy text on each
    assert per_engine(scrape(s), "dp_requests_routed_total") == [1, 1]
    assert s.stop(signal.SIGTERM) == 0
  assert not wait_gone(pids), "an engine-core actor outlived the server"
  assert "Application shutdown complete" in s.log() and "Traceback" not in s.log()
