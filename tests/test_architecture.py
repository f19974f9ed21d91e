"""The rules the code's structure keeps, checked on its source: the packages form layers (nothing imports upwards, no
import cycle), only the scheduler writes a Sequence's state, only the config and CLI layers read the environment, and
the production kernels carry no experiment switches."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tinyvllm"
# each top-level part of the package and its layer: a module may import from its own part and from lower layers only
# (moe_config, a leaf, sits below config, which reads it; model_config, the model's shape, above config, whose
# ConfigError it raises)
LAYERS = {"moe_config": -1, "sampling_params": 0, "outputs": 0, "config": 0, "model_config": 1, "engine_args": 1, "core": 1,
          "tokenizer": 1,
          "beam_search": 1, "platform": 2,
          "backend": 3, "layers": 4, "kernels": 5, "model": 6, "worker": 7, "engine": 8, "bench": 9, "entrypoints": 9, "cli": 10,
          "__init__": 11}
SEQUENCE_STATE = {"status", "num_computed_tokens", "num_pending", "pending_row", "output_token_ids", "stop_reason",
                  "num_cached_tokens", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
                  "spec_token_ids", "num_draft_tokens", "num_accepted_tokens"}
SCHEDULER_FILES = {"core/scheduler.py", "core/async_scheduling.py"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "__setitem__", "__delitem__"}
EXPERIMENT_SWITCHES = ("TV_PHASES", "TV_GRID_SYNCS", "TV_WARM", "TV_KV_TOGETHER", "TV_TIMING", "TV_STAMP", "clock64")


def modules() -> dict[str, ast.Module]:
  """Every module of the package by its path relative to the package (e.g. "core/scheduler.py")."""
  return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def part(rel: str) -> str:
  return rel.split("/")[0].removesuffix(".py") if "/" in rel or rel != "__init__.py" else "__init__"


def imported(tree: ast.Module) -> list[str]:
  """The tinyvllm modules a module imports anywhere (top level, functions, TYPE_CHECKING blocks), dotted."""
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import): names += [a.name for a in node.names if a.name.startswith("tinyvllm")]
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tinyvllm"):
      names += [f"{node.module}.{a.name}" if (PACKAGE.parent / node.module.replace(".", "/") / f"{a.name}.py").exists()
                else node.module for a in node.names]
  return names


def module_path(dotted: str) -> str:
  rel = dotted.removeprefix("tinyvllm").removeprefix(".").replace(".", "/")
  if not rel: return "__init__.py"
  return f"{rel}/__init__.py" if (PACKAGE / rel).is_dir() else f"{rel}.py"


def test_every_part_has_a_layer():
  assert {part(rel) for rel in modules()} == set(LAYERS)


def test_imports_go_down_the_layers_only():
  wrong = []
  for rel, tree in modules().items():
    for name in imported(tree):
      target = part(module_path(name))
      if target != part(rel) and LAYERS[target] >= LAYERS[part(rel)]: wrong.append(f"{rel} imports {name}")
  assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_kernels_import_no_model_engine_or_worker():
  for rel, tree in modules().items():
    if part(rel) == "kernels":
      assert not [n for n in imported(tree) if part(module_path(n)) in ("model", "engine", "worker")], rel


def test_no_import_cycle_between_modules():
  graph = {rel: {module_path(n) for n in imported(tree)} - {rel} for rel, tree in modules().items()}
  state: dict[str, int] = {}

  def visit(node: str, path: list[str]) -> None:
    state[node] = 1
    for nxt in graph.get(node, ()):
      if state.get(nxt) == 1: pytest.fail("import cycle: " + " -> ".join([*path, node, nxt]))
      if nxt not in state: visit(nxt, [*path, node])
    state[node] = 2
  for rel in graph:
    if rel not in state: visit(rel, [])


def sequence_state_writes(tree: ast.Module) -> list[int]:
  """Line numbers that assign to, or mutate in place, an attribute named like a Sequence state field (of another
  object: `self.status` is a class's own attribute; Sequence itself has no methods that write)."""
  lines = []
  foreign = lambda a: isinstance(a, ast.Attribute) and a.attr in SEQUENCE_STATE and not (isinstance(a.value, ast.Name)
                                                                                         and a.value.id == "self")
  for node in ast.walk(tree):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    for target in targets:
      for t in ast.walk(target):
        if foreign(t) and isinstance(t.ctx, ast.Store): lines.append(t.lineno)
        if isinstance(t, ast.Subscript) and foreign(t.value): lines.append(t.lineno)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and foreign(node.func.value):
      lines.append(node.lineno)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr": lines.append(node.lineno)
  return sorted(lines)


def test_only_the_scheduler_writes_sequence_state():
  writers = {rel: lines for rel, tree in modules().items() if rel not in SCHEDULER_FILES and (lines := sequence_state_writes(tree))}
  assert not writers, f"Sequence state written outside the scheduler: {writers}"


def test_the_state_rule_finds_each_kind_of_write():
  snippet = ("seq.status = done\nitem.seq.num_pending += 1\nseq.output_token_ids.append(t)\nseq.output_token_ids[0] = t\n"
             "seq.num_computed_tokens, other.status = 0, 1\nsetattr(seq, 'stop_reason', 2)\nx = seq.status\n")
  assert sequence_state_writes(ast.parse(snippet)) == [1, 2, 3, 4, 5, 5, 6]
  assert sequence_state_writes(ast.parse((PACKAGE / "core" / "scheduler.py").read_text()))


def test_environment_is_read_only_by_the_config_and_cli_layers():
  readers = []
  for rel, tree in modules().items():
    if rel == "config.py" or part(rel) == "cli": continue
    for node in ast.walk(tree):
      name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
      if name in ("environ", "getenv", "putenv"): readers.append(f"{rel}:{node.lineno}")
  assert not readers, f"environment read outside config.py and cli/: {readers}"


def test_production_kernels_carry_no_experiment_switches():
  sources = sorted((PACKAGE / "kernels" / "csrc").rglob("*.[ih]*"))
  assert len(sources) >= 15
  found = [f"{p.name}: {m}" for p in sources for m in EXPERIMENT_SWITCHES if re.search(rf"\b{m}\b", p.read_text())]
  assert not found, found
