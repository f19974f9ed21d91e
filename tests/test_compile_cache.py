"""The compile cache (tinyvllm/platform/compile_cache.py): tinygrad's scheduling and codegen of a
step, kept in its disk cache, are skipped by a second process, which builds the same kernels and gives the same output.

Each run is a fresh Python process on its own cache file (tinygrad's CACHEDB), lowering kernels in-process (PARALLEL=0)
so that tinygrad's codegen (`do_to_program`) and scheduling (`get_kernel_graph`) can be counted there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.platform import compile_cache

REPO = Path(__file__).resolve().parents[1]

# counts tinygrad's codegen and scheduling from here on (the CPU device is opened first: it builds helper programs of its
# own at open, outside the caches), runs BODY, then prints what BODY put in `out` with the counts and the cache's stats
PRELUDE = """
import json, sys
import tinygrad.codegen, tinygrad.schedule
from tinygrad import Device
Device["CPU"]
calls = {"codegen": 0, "schedule": 0}
def counting(name, fn):
  def counted(*args, **kwargs):
    calls[name] += 1
    return fn(*args, **kwargs)
  return counted
tinygrad.codegen.do_to_program = counting("codegen", tinygrad.codegen.do_to_program)
tinygrad.schedule.get_kernel_graph = counting("schedule", tinygrad.schedule.get_kernel_graph)
from tinyvllm.platform import compile_cache
out = {}
"""
EPILOGUE = """
out.update(calls=calls, stats={k: vars(v) for k, v in compile_cache.disk_cache_stats.items()})
print("RESULT " + json.dumps(out))
"""

# a small tensor program: a product, an elementwise tail and a reduction (three kernels, one schedule)
TENSORS = """
import numpy as np
from tinygrad import Tensor
compile_cache.install_disk_caches()
a = Tensor(np.arange(64, dtype=np.float32).reshape(8, 8) / 64).realize()
b = Tensor(np.ones((8, 8), dtype=np.float32)).realize()
c = (a @ b).relu() * 3
out["values"] = [c.sum(axis=1).numpy().tolist(), c.max().item()]
"""


def run(body: str, cache: Path, *args: str, env: dict[str, str] | None = None) -> dict:
  environment = {**os.environ, "CACHEDB": str(cache), "PARALLEL": "0", "PYTHONPATH": str(REPO), **(env or {})}
  done = subprocess.run([sys.executable, "-c", PRELUDE + body + EPILOGUE, *args], env=environment, capture_output=True,
                        text=True, timeout=300, check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> tuple[Path, dict]:
  """A cache file the tensor program was built into by a first process, and what that process saw."""
  cache = tmp_path_factory.mktemp("compile_cache") / "cache.db"
  first = run(TENSORS, cache)
  built = first["stats"]
  assert first["calls"]["codegen"] >= 1 and built["program"]["hits"] == 0 and built["program"]["stores"] >= 1
  assert built["schedule"]["stores"] >= 1
  return cache, first


def test_a_second_process_reads_the_schedule_and_kernels_and_builds_nothing(filled):
  cache, first = filled
  second, built = run(TENSORS, cache), first["stats"]
  assert second["values"] == first["values"]
  # every kernel the first process lowered is read back: codegen never runs, and only the schedules that were not
  # stored (copies from numpy) are computed again
  assert second["calls"]["codegen"] == 0 and second["stats"]["program"]["hits"] == built["program"]["stores"]
  assert second["stats"]["schedule"]["hits"] == built["schedule"]["stores"]
  assert second["calls"]["schedule"] == first["calls"]["schedule"] - built["schedule"]["stores"]
  assert second["stats"]["program"]["stores"] == second["stats"]["schedule"]["stores"] == 0


def test_another_tinygrad_never_reads_an_entry(filled):
  cache, first = filled
  other = run("compile_cache._tinygrad_digest = lambda: 'another tinygrad'\n" + TENSORS, cache)   # its sources differ
  assert other["stats"]["program"]["hits"] == other["stats"]["schedule"]["hits"] == 0
  assert other["calls"]["codegen"] == first["calls"]["codegen"] and other["values"] == first["values"]


def test_other_codegen_settings_never_read_an_entry(filled):
  cache, first = filled
  noopt = run(TENSORS, cache, env={"NOOPT": "1"})   # no kernel optimisations: other kernels
  assert noopt["stats"]["program"]["hits"] == 0 and noopt["calls"]["codegen"] >= 1
  assert noopt["values"] == first["values"]


def test_turned_off_it_reads_and_writes_nothing(filled):
  cache, first = filled
  off = run(TENSORS.replace("compile_cache.install_disk_caches()", "compile_cache.install_disk_caches(False)"), cache)
  assert off["stats"]["program"] == off["stats"]["schedule"] == {"hits": 0, "misses": 0, "stores": 0}
  assert off["calls"]["codegen"] == first["calls"]["codegen"]


ENGINE = """
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], cuda_graph_sizes=[1, 2], max_num_seqs=2, num_gpu_blocks=64, max_model_len=128)
prompt = json.loads(sys.argv[2])
outputs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=int(sys.argv[3])), use_tqdm=False)
out["tokens"] = [o.outputs[0].token_ids for o in outputs]
out["captures"] = llm.engine.core.runner.num_captures
"""


@pytest.mark.slow
def test_a_second_engine_start_skips_scheduling_and_codegen_and_decodes_the_same(stories_dir, reference, tmp_path):
  """Two fresh processes start a stories260K engine capturing decode steps of 1 and 2 sequences and decode two greedy
  sequences (a longer context's layout is captured on the way): the second reads every step's schedule and kernels
  from the cache, runs no codegen, and gives the first's tokens, which are the reference's."""
  args = (str(stories_dir), json.dumps(reference["prompt_ids"]), "20")
  first, second = (run(ENGINE, tmp_path / "cache.db", *args) for _ in range(2))
  expected = reference["greedy_ids"][:20]
  assert first["tokens"] == second["tokens"] == [expected, expected]
  assert first["captures"] == second["captures"] >= 2
  built = first["stats"]
  assert first["calls"]["codegen"] >= 1 and built["program"]["stores"] >= 1 and built["schedule"]["stores"] >= first["captures"]
  assert second["calls"]["codegen"] == 0 and second["stats"]["program"]["hits"] == built["program"]["stores"]
  assert second["stats"]["schedule"]["hits"] == built["schedule"]["stores"]
  assert second["calls"]["schedule"] == first["calls"]["schedule"] - built["schedule"]["stores"]


def test_a_schedule_whose_devices_render_differently_here_is_a_miss():
  from tinygrad import Device
  from tinygrad.uop.ops import Ops, UOp
  Device["CPU"]
  cache, linear = compile_cache.ScheduleDiskCache("schedule", "unused", {}), UOp(Ops.LINEAR, src=())
  here = compile_cache._device_identity("CPU")
  assert here is not None and cache.unpack(({"CPU": here}, linear)) is linear
  assert cache.unpack(({"CPU": here.replace("ClangRenderer", "LLVMRenderer")}, linear)) is None


def test_a_stored_buffer_node_leaves_its_device_buffer_behind():
  """A schedule's placeholder buffers can be the very node of a live buffer: the entry must not carry its data."""
  import pickle
  import zlib

  from tinygrad import Tensor
  node = Tensor([1.0, 2.0], device="CPU").realize().uop.base
  assert node.realized is not None and b"Buffer" in pickle.dumps(node)
  assert b"Buffer" not in zlib.decompress(compile_cache._dumps(node))



def test_start_up_precompiles_the_rest_only_when_the_first_capture_compiled_something():
  """A second start (the first layout's kernels all in the disk cache) does not build the other layouts' graphs a second
  time to collect their sources; a first start compiles them all in parallel before capturing."""
  from tinyvllm.worker.model_runner import ModelRunner

  class Runner:
    def __init__(self, compiled_first: int):
      self.compiled_first, self.batches = compiled_first, []
    def _forward(self, layout, packed, realize=True): return None
    def _prepare(self, sched): return None, None, f"packed-{sched}", None
    def precompile(self, builds):
      self.batches.append([b[1] for b in builds])
      return self.compiled_first if len(self.batches) == 1 else len(builds)

  todo = {"a": 1, "b": 2, "c": 3}
  warm, cold = Runner(compiled_first=0), Runner(compiled_first=5)
  ModelRunner._precompile_warm_up(warm, todo)
  ModelRunner._precompile_warm_up(cold, todo)
  assert warm.batches == [["packed-1"]]
  assert cold.batches == [["packed-1"], ["packed-2", "packed-3"]]
  ModelRunner._precompile_warm_up(empty := Runner(compiled_first=0), {})
  assert empty.batches == []
