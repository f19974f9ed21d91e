"""A HuggingFace hub cache written as huggingface_hub lays it out, for hub tests with no network."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_commit(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> Path:
  """One commit of `repo_id` in HF's cache layout: content-addressed blobs, the snapshot's symlinks to them, refs."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / commit
  for name, data in files.items():
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
  for ref in refs:
    (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
  return snapshot
