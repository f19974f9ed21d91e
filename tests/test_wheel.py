"""The package as users install it: a wheel built from the repo, installed into a fresh virtualenv, run from another
directory. Every kernel source and tuning table ships inside it, found through importlib.resources, and so does the
default model: it generates stories260K's reference story with and without --model."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tinyvllm" / "assets"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
  """A fresh venv holding only the built wheel (its dependencies come from this environment's site-packages, added as a
  plain path: an editable checkout of tinyvllm there is not visible); returns its python."""
  root = tmp_path_factory.mktemp("wheel")
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
                          str(REPO)], capture_output=True, text=True, timeout=600)
  assert build.returncode == 0, build.stderr[-3000:]
  (wheel,) = (root / "dist").glob("tinyvllm-*.whl")
  venv.EnvBuilder(with_pip=False).create(root / "venv")
  python = root / "venv" / "bin" / "python"
  site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
  (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                           capture_output=True, text=True, timeout=600)
  assert install.returncode == 0, install.stderr[-3000:]
  return python


def run_elsewhere(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
  return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_every_kernel_source_and_table_ships_in_the_wheel(installed, tmp_path):
  code = ("import json, tinyvllm; from importlib import resources; from tinyvllm.kernels.sources import source_files; "
          "root = resources.files('tinyvllm.kernels'); "
          "print(json.dumps({'where': tinyvllm.__file__, 'sources': sorted(source_files()), "
          "'tables': sorted(p.name for p in (root / 'tuning').iterdir())}))")
  run = run_elsewhere(installed, "-c", code, cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  found = json.loads(run.stdout)
  assert not Path(found["where"]).is_relative_to(REPO)   # the installed copy, not the checkout
  repo_sources = sorted(p.name for p in (REPO / "tinyvllm" / "kernels" / "csrc").rglob("*") if p.is_file())
  assert found["sources"] == repo_sources and len(repo_sources) >= 17
  assert found["tables"] == sorted(p.name for p in (REPO / "tinyvllm" / "kernels" / "tuning").glob("*.json"))


def test_the_installed_cli_generates_the_reference_story(installed, tmp_path, stories_dir):
  reference = json.loads((stories_dir / "reference_greedy.json").read_text())
  cli = installed.parent / "tinyvllm"
  run = subprocess.run([str(cli), "generate", "--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "40",
                        "--temperature", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert reference["greedy_text"].startswith("Once upon a time" + run.stdout.rstrip("\n"))
  assert len(run.stdout) > 100


def test_the_default_model_ships_in_the_wheel(installed, tmp_path):
  from tests.test_embedded_model import DOCUMENTED_START
  cli = installed.parent / "tinyvllm"
  run = subprocess.run([str(cli), "generate", "--prompt", "Once upon a time", "--max-tokens", "40", "--temperature", "0"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert DOCUMENTED_START.startswith("Once upon a time" + run.stdout.rstrip("\n")) and len(run.stdout) > 100
  where = Path(run.stderr.split("no model given: running the embedded stories260K")[1].split(" at ")[1].splitlines()[0])
  assert not where.is_relative_to(REPO) and where.is_relative_to(installed.parents[1])   # the installed copy
  assert sorted(p.name for p in where.iterdir()) == sorted(p.name for p in (ASSETS / "stories260K").iterdir())
