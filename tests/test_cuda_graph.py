"""Programmatic dependent launch (tinyvllm/platform/cuda_graph.py): which CUDA graph edges may let a kernel start while
the one before it finishes, and the kernels' side of the contract (each begins with TV_WAIT_PRIOR_GRIDS, before it
touches memory). The graph itself runs on the GPU only (bench/check_kernels.py and the engine's GPU checks)."""
from __future__ import annotations

import re

import pytest

from tinyvllm.kernels import sources
from tinyvllm.platform import cuda_graph

# a kernel's body: TV_KERNEL_END, then only preprocessor lines and blanks, then its opening brace
BODY = re.compile(r"TV_KERNEL_END[ \t]*\n?(?:[ \t]*#[^\n]*\n|[ \t]*\n)*[ \t]*\{")
KERNEL = re.compile(r"^TV_(?:GEMM_)?KERNEL\((\w+)\)", re.M)


def test_only_edges_into_waiting_kernels_on_one_device_become_programmatic():
  kernels = {1: ("CUDA", False), 2: ("CUDA", True), 3: ("CUDA", True), 4: ("CUDA:1", True), 5: ("CUDA", False)}
  edges = [(1, 2), (2, 3), (3, 5), (3, 4), (9, 2), (2, 9)]   # 9: a copy node (not a kernel)
  assert cuda_graph.programmatic_edges(edges, kernels) == [(1, 2), (2, 3)]
  assert cuda_graph.programmatic_edges([], kernels) == []


def test_every_kernel_waits_for_its_prior_grids_first():
  """A programmatic edge lets a kernel's blocks run before the kernel it depends on has finished: every hand-written
  kernel's first statement is the wait (the CUDA graph marks every one of them as waiting)."""
  bodies, names = 0, []
  for name, file in sources.source_files().items():
    if not name.endswith(".inc"): continue
    text = file.read_text()
    names += KERNEL.findall(text)
    for body in BODY.finditer(text):
      bodies += 1
      first = text[body.end():].lstrip().split("\n", 1)[0]
      assert first == "TV_WAIT_PRIOR_GRIDS();", f"{name}: a kernel body begins with {first!r}"
  # tv_paged_decode and tv_paged_decode_split share one body (paged_decode.inc picks one signature)
  assert len(names) >= 20 and bodies == len(names) - 1, (bodies, names)


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_the_wait_is_defined_in_both_dialects(dialect):
  prelude = sources.read(f"prelude_{dialect}.h")
  assert "#define TV_WAIT_PRIOR_GRIDS()" in prelude
  assert ("griddepcontrol.wait" in prelude) == (dialect == "cuda")


def test_a_device_without_the_feature_keeps_tinygrads_graph():
  from tinygrad import Device
  before = Device["CPU"].graph
  assert not cuda_graph.use_programmatic_graphs("CPU")
  assert Device["CPU"].graph is before


def test_tinygrads_graph_keeps_what_the_subclass_reads():
  assert cuda_graph.internals_present()
  assert cuda_graph.programmatic_graph_class().__mro__[1].__name__ == "CUDAGraph"
