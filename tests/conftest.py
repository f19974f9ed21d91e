"""Shared test fixtures: where ../shared lives (skipping, or failing in CI, when it is absent), the stories260K engine
and its greedy reference, the Qwen3 tokenizer, the kernel dialects, and the check that an engine holds nothing after
its requests."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TINYVLLM_SHARED", REPO.parent / "shared"))

# tinygrad lowers new kernels in a pool of PARALLEL worker processes, by default the CPUs over the xdist workers. At one
# worker a process (CI: 2 cores, -n 2) the pool runs nothing in parallel and only adds pickling and a fresh worker
# every 16 kernels: a quarter of each capture's time. There the kernels are lowered in-process. (Set before tinygrad is
# imported; server processes the tests start inherit it.)
if (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) \
    // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) <= 1:
  os.environ.setdefault("PARALLEL", "0")
SHARED_DATA = SHARED / "data"
STORIES = SHARED_DATA / "models" / "stories260K-hf"

# The longest files on 2 CPU cores (seconds, measured with --durations), run first: with --dist loadfile each xdist
# worker takes the next file when it is free, and a long file taken last leaves the other worker idle till it ends.
LONGEST_FILES = ("test_invariance.py", "test_speculative.py", "test_draft_model.py", "test_structured_output.py",
                 "test_swap_preemption.py", "test_gguf.py", "test_moe.py", "test_cli_hardening.py", "test_server.py",
                 "test_server_api_servers.py", "test_async_scheduling.py", "test_server_hardening.py",
                 "test_priority_scheduling.py", "test_fp8_kv_cache.py", "test_embedded_model.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """The longest files first (in LONGEST_FILES's order), every other file after them in its usual order."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's tests keep their order


def require_shared(path: Path) -> Path:
  """Return `path`, or skip the test when ../shared is missing (CI sets TINYVLLM_REQUIRE_SHARED=1 to fail instead)."""
  if path.exists(): return path
  if os.environ.get("TINYVLLM_REQUIRE_SHARED") == "1": pytest.fail(f"required test data missing: {path}")
  pytest.skip(f"test data not found at {path} (../shared beside the checkout holds it)")


def assert_all_free(llm) -> None:
  """Nothing is left of the engine's requests: no blocks in use (on the device or in the swap space), no queued or
  running sequence, no step in flight, no block move pending, no frontend state (detokenizers, prompt logprobs)."""
  engine, sched = llm.engine, llm.engine.scheduler
  assert engine.allocator.num_used_blocks == 0 and not engine.requests and engine.core._in_flight is None
  assert not sched.waiting and not sched.running and not engine.output_processor.states
  assert sched.swap_space is None or (sched.swap_space.num_used_blocks == 0 and not sched.swap_space.tables)
  assert not sched.pending_copies and not sched.pending_swap_out and not sched.pending_swap_in


@pytest.fixture(scope="session")
def stories_dir() -> Path: return require_shared(STORIES)


@pytest.fixture(scope="session")
def shared_data() -> Path: return require_shared(SHARED_DATA)


@pytest.fixture(scope="session")
def reference(stories_dir: Path) -> dict:
  """stories260K's greedy reference: prompt_ids, greedy_ids, greedy_text, the zoo prompt, the first positions' argmax."""
  return json.loads((stories_dir / "reference_greedy.json").read_text())


@pytest.fixture(scope="session")
def stories_log_softmax(stories_dir: Path):
  """HF transformers' stories260K on CPU float32 (the reference): ids -> [len(ids), vocab] log_softmax of its logits, row p
  the distribution of the token after ids[:p + 1]."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = transformers.LlamaForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32).eval()

  def log_softmax(ids: list[int]):
    with torch.no_grad(): return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
  return log_softmax


@pytest.fixture(scope="module")
def llm(stories_dir: Path):
  """A stories260K engine (files that need another engine define their own `llm`)."""
  from tinyvllm import LLM
  return LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=256)


@pytest.fixture(scope="module", params=(1, 2), ids=("one-engine", "dp2"))
def data_parallel_size(request) -> int:
  """The server suites' servers run as one engine and as two data-parallel replicas behind the endpoint."""
  return request.param


@pytest.fixture(scope="module", params=("cuda", "metal"))
def dialect(request) -> str:
  """Each kernel dialect, for the emulated kernel tests (tests/emulator)."""
  return request.param


@pytest.fixture(scope="module")
def qwen(shared_data: Path):
  """The Qwen3 tokenizer of ../shared (ours)."""
  from tests.test_tokenizer import QWEN3, tokenizer_at
  return tokenizer_at(QWEN3)
