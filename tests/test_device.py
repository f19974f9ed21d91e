"""Backend selection and tinygrad's compile cache across threads (the async engine steps on its own thread)."""
from __future__ import annotations

import threading

import tinygrad.helpers
from tinygrad.helpers import diskcache_get, diskcache_put

from tinyvllm.platform import tinygrad_compat
from tinyvllm.platform.device import detect_device


def test_compile_cache_usable_from_two_threads():
  tinygrad_compat.install()   # what the engine applies at start
  diskcache_put("tinyvllm_test", "key", 41)
  seen = []
  worker = threading.Thread(target=lambda: seen.append(diskcache_get("tinyvllm_test", "key")))
  worker.start()
  worker.join()
  assert seen == [41] and tinygrad.helpers.db_connection.per_thread


def test_detects_cpu_here():
  assert detect_device() == "CPU"
