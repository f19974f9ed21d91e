"""Shared test fixtures: where ../shared lives, and skipping (or failing, in CI) when it is absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TINYVLLM_SHARED", REPO.parent / "shared"))
SHARED_DATA = SHARED / "data"
STORIES = SHARED_DATA / "models" / "stories260K-hf"


def require_shared(path: Path) -> Path:
  """Return `path`, or skip the test when ../shared is missing (CI sets TINYVLLM_REQUIRE_SHARED=1 to fail instead)."""
  if path.exists(): return path
  if os.environ.get("TINYVLLM_REQUIRE_SHARED") == "1": pytest.fail(f"required test data missing: {path}")
  pytest.skip(f"test data not found at {path} (../shared beside the checkout holds it)")


@pytest.fixture(scope="session")
def stories_dir() -> Path: return require_shared(STORIES)


@pytest.fixture(scope="session")
def shared_data() -> Path: return require_shared(SHARED_DATA)
