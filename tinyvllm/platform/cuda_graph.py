"""CUDA graphs whose hand-written kernels launch programmatically (Hopper's programmatic dependent launch).

In a plain CUDA graph a kernel's blocks start only after the kernel before it has finished and its writes have been
flushed: each of a decode step's few hundred small kernels pays a launch, a ramp-up (its first weight loads crossing
HBM's latency) and the previous kernel's tail, with the SMs mostly idle. On sm_90+ an edge between two kernel nodes
can be programmatic: the downstream kernel launches as soon as every block of the upstream one has called
`griddepcontrol.launch_dependents` (or exited), and its `griddepcontrol.wait` holds it until the upstream kernel has
finished with its memory visible. Every hand-written kernel begins with that wait (TV_WAIT_PRIOR_GRIDS in
prelude_cuda.h, before it touches memory), so an edge into one of them can be programmatic; an edge into any other
kernel (tinygrad's own), from a copy, or between two GPUs stays a full dependency. What it saves is the launch and the
flush between two kernels, ~0.3 us a kernel: 1.4% of a Qwen3-8B decode step on an H200, 2.1% at TP=2 (docs/benchmarks.md).

tinygrad builds the graph with plain edges (tinygrad.runtime.graph.cuda.CUDAGraph); its subclass here turns the edges
into our kernels programmatic and instantiates the graph again. `use_programmatic_graphs(device)` installs it on a
device whose GPU and driver have the feature (sm_90+, `cuGraphAddDependencies_v2` of CUDA 12.3).
"""
from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterable

from tinygrad import Device

_lock = threading.Lock()
_waiting: set[tuple[bytes, str]] = set()   # (binary, kernel name) of the kernels that begin with TV_WAIT_PRIOR_GRIDS

PORT_PROGRAMMATIC = 1   # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: fires once every block has triggered or exited
TYPE_PROGRAMMATIC = 1   # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class EdgeData(ctypes.Structure):
  """CUgraphEdgeData (cuda.h, CUDA 12.3)."""
  _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
              ("reserved", ctypes.c_ubyte * 5)]


def programmatic_edges(edges: Iterable[tuple[int, int]], kernels: dict[int, tuple[str, bool]]) -> list[tuple[int, int]]:
  """The edges (upstream node, downstream node) that may be programmatic: both ends kernels (`kernels`: node -> (its
  device, whether it waits for its prior grids)) on one device, the downstream one waiting."""
  out = []
  for a, b in edges:
    if a in kernels and b in kernels and kernels[b][1] and kernels[a][0] == kernels[b][0]: out.append((a, b))
  return out


def mark_waiting(binary: bytes, kernel: str) -> None:
  """`kernel` of `binary` begins with TV_WAIT_PRIOR_GRIDS (compiled for sm_90+), so it may launch programmatically."""
  with _lock: _waiting.add((binary, kernel))


def _driver_has_edge_data() -> bool:
  import tinygrad.runtime.autogen.cuda as cuda
  try: return hasattr(cuda.dll, "cuGraphAddDependencies_v2")
  except AttributeError: return False   # libcuda did not load


def use_programmatic_graphs(device: str) -> bool:
  """Install the programmatic graph on a CUDA device that supports it (returns whether it did or had)."""
  dev = Device[device]
  if dev.graph is programmatic_graph_class(): return True   # (each kernel of a capture asks again)
  arch = str(getattr(dev, "arch", ""))
  if not arch.startswith("sm_") or int(arch[3:5]) < 90 or dev.graph is None or not _driver_has_edge_data(): return False
  dev.graph = programmatic_graph_class()
  return True


def internals_present() -> bool:
  """tinygrad's CUDAGraph keeps what the subclass reads: its nodes, graph and instance, its calls and runtimes."""
  from tinygrad.engine.jit import GraphRunner
  from tinygrad.runtime.graph.cuda import CUDAGraph
  return {"nodes", "graph", "instance"} <= set(CUDAGraph.__init__.__code__.co_names) and \
    {"calls", "runtimes"} <= set(GraphRunner.__init__.__code__.co_names)


def _handle(node) -> int: return ctypes.cast(node, ctypes.c_void_p).value or 0


def _graph_edges(graph) -> list[tuple[int, int]]:
  import tinygrad.runtime.autogen.cuda as cuda
  from tinygrad.runtime.ops_cuda import check
  fn = cuda.dll.cuGraphGetEdges
  fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int
  count = ctypes.c_size_t(0)
  check(fn(_handle(graph), None, None, ctypes.byref(count)))
  if count.value == 0: return []
  src, dst = (ctypes.c_void_p * count.value)(), (ctypes.c_void_p * count.value)()
  check(fn(_handle(graph), src, dst, ctypes.byref(count)))
  return [(a or 0, b or 0) for a, b in zip(src, dst, strict=True)]


def _relink(graph, edges: list[tuple[int, int]]) -> None:
  """Replace each plain edge by a programmatic one."""
  import tinygrad.runtime.autogen.cuda as cuda
  from tinygrad.runtime.ops_cuda import check
  n = len(edges)
  src, dst = (ctypes.c_void_p * n)(*[a for a, _ in edges]), (ctypes.c_void_p * n)(*[b for _, b in edges])
  remove = cuda.dll.cuGraphRemoveDependencies
  remove.argtypes, remove.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
  check(remove(_handle(graph), src, dst, n))
  data = (EdgeData * n)(*[EdgeData(PORT_PROGRAMMATIC, 0, TYPE_PROGRAMMATIC) for _ in range(n)])
  add = cuda.dll.cuGraphAddDependencies_v2
  add.argtypes, add.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
  check(add(_handle(graph), src, dst, data, n))


@functools.cache
def programmatic_graph_class() -> type:
  """tinygrad's CUDA graph with programmatic edges into the kernels that wait for their prior grids (built on first use:
  tinygrad's CUDA modules are imported only where CUDA runs)."""
  import tinygrad.runtime.autogen.cuda as cuda
  from tinygrad.runtime.graph.cuda import CUDAGraph
  from tinygrad.runtime.ops_cuda import check
  from tinygrad.runtime.support.c import init_c_var
  from tinygrad.uop.ops import Ops

  class ProgrammaticCUDAGraph(CUDAGraph):
    def __init__(self, linear, input_uops=()):
      super().__init__(linear, input_uops)
      if not (edges := programmatic_edges(_graph_edges(self.graph), self._kernel_nodes())): return
      _relink(self.graph, edges)
      check(cuda.cuGraphExecDestroy(self.instance))
      self.instance = init_c_var(cuda.CUgraphExec,
                                 lambda x: check(cuda.cuGraphInstantiate_v2(ctypes.byref(x), self.graph, None, None, 0)))

    def _kernel_nodes(self) -> dict[int, tuple[str, bool]]:
      """node -> (device, whether its kernel waits for its prior grids), for the kernel nodes (tinygrad made a node for
      each PROGRAM and COPY call, in order)."""
      calls = [(call, runtime) for call, runtime in zip(self.calls, self.runtimes, strict=True)
               if call[1].op in (Ops.PROGRAM, Ops.COPY)]
      return {_handle(node): (bufs[0].device, (runtime.lib, runtime.name) in _waiting)
              for (node, _params, _args, is_copy), ((_idx, _ast, bufs, _vars), runtime) in zip(self.nodes, calls, strict=True)
              if not is_copy}
  return ProgrammaticCUDAGraph
