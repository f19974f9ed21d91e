"""The compile cache (`--compile-cache`): tinygrad's two in-memory caches of a step's build, the schedule cache (a
normalized tensor graph -> its kernels, `tinygrad.schedule.schedule_cache`) and the program cache (a kernel AST -> its
rendered and compiled PROGRAM, `to_program_cache`), backed by tinygrad's disk cache, so that a second process skips
scheduling and codegen for every step it built before (see `DiskBackedCache`). It uses tinygrad internals, as
tinygrad_compat.py does (whose `check()` touches these too).
"""
from __future__ import annotations

import functools
import hashlib
import io
import pathlib
import pickle
import zlib
from dataclasses import dataclass

import tinygrad.codegen
import tinygrad.engine.realize
import tinygrad.helpers
import tinygrad.schedule
from tinygrad import Device
from tinygrad.helpers import ContextVar, diskcache_get, diskcache_put
from tinygrad.uop.ops import Ops, ParamArg, UOp


def tinygrad_version() -> str:
  from importlib.metadata import version
  try: return version("tinygrad")
  except Exception: return "(unknown version)"


CACHE_FORMAT = 1   # of the entries below: bump when what is stored changes
# tinygrad settings that change no schedule and no program: what is printed or profiled, where and whether things are
# cached, how many worker processes compile, and flags tinygrad sets for the span of one call
_NEUTRAL_SETTINGS = frozenset({"DEBUG", "VIZ", "PROFILE", "PARALLEL", "TRACK_MATCH_STATS", "NO_COLOR", "CAPTURE_PROCESS_REPLAY",
                               "CACHELEVEL", "CCACHE", "IGNORE_BEAM_CACHE", "CAPTURING", "ALLOW_DEVICE_USAGE"})
_SCHEDULE_TABLE, _PROGRAM_TABLE = "tinyvllm_schedule", "tinyvllm_program"


@dataclass
class DiskCacheStats:
  hits: int = 0      # entries read from disk (their scheduling / codegen skipped)
  misses: int = 0    # looked up on disk, not found or not usable
  stores: int = 0    # new entries written


disk_cache_stats = {"schedule": DiskCacheStats(), "program": DiskCacheStats()}
_disk_caches_on = False


@functools.cache
def _tinygrad_digest() -> str:
  """The installed tinygrad, by version and the content of its source files (~50 ms, once): an entry written by any
  other tinygrad is never read."""
  root = pathlib.Path(tinygrad.helpers.__file__).parent
  h = hashlib.sha256(tinygrad_version().encode())
  for p in sorted(root.rglob("*.py")):
    h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
  return h.hexdigest()


def _settings() -> str:
  """tinygrad's settings (its ContextVars, from the environment or a Context) that may change what is built."""
  return repr(sorted((k, repr(v.value)) for k, v in ContextVar._cache.items() if k not in _NEUTRAL_SETTINGS))


def _qualname(cls: type) -> str: return f"{cls.__module__}.{cls.__qualname__}"


def _renderer_identity(renderer) -> str:
  """What decides a renderer's output: its class, its target (device, renderer, arch) and its compiler."""
  compiler = getattr(renderer, "compiler", None)
  return f"{_qualname(type(renderer))}|{renderer.target!r}|{_qualname(type(compiler))}|{getattr(compiler, 'cachekey', None)}"


def _device_identity(device: str) -> str | None:
  """The identity of the renderer of an open compute device (None: not open here, or not one that renders kernels)."""
  if device not in Device._opened_devices or device.split(":")[0] in ("DISK", "NPY", "PYTHON", "TINYFS"): return None
  try: return _renderer_identity(Device[device].renderer)
  except Exception: return None


def _digest(*parts: object) -> str:
  return hashlib.sha256(repr((CACHE_FORMAT, _tinygrad_digest(), _settings(), *parts)).encode()).hexdigest()


class DiskBackedCache(dict):
  """One of tinygrad's in-memory caches, backed by tinygrad's disk cache (the sqlite `cache.db` its compiled binaries
  live in): a key missing in memory is looked up on disk, and a new entry is written there too.

  The key on disk is a digest of the in-memory key (tinygrad's own content hash of the UOp graph, `UOp.key`), the
  tinygrad it came from (version and sources), tinygrad's settings and the cache format; an entry also records the
  renderer of every device it uses, compared at load. tinygrad fills and reads the cache as it always does, so what a
  process builds from an entry is what it would have built itself: the same kernels, the same outputs. An entry that
  cannot be read, or whose devices render differently here, is a miss (and is rebuilt and rewritten)."""

  def __init__(self, kind: str, table: str, initial: dict):
    super().__init__(initial)
    self.kind, self.table, self.stats = kind, table, disk_cache_stats[kind]

  # subclasses: the disk key of an in-memory key (None: not cached on disk), and an entry to store / its value
  def disk_key(self, key) -> str | None: raise NotImplementedError

  def pack(self, value) -> object | None: raise NotImplementedError

  def unpack(self, entry) -> object | None: raise NotImplementedError

  def _load(self, key):
    if not _disk_caches_on: return None
    try:
      if (disk_key := self.disk_key(key)) is None: return None
      stored = diskcache_get(self.table, disk_key)
      value = self.unpack(pickle.loads(zlib.decompress(stored))) if stored is not None else None
    except Exception: value = None   # unreadable: a miss
    if value is None:
      self.stats.misses += 1
      return None
    self.stats.hits += 1
    dict.__setitem__(self, key, value)
    return value

  def __missing__(self, key):
    if (value := self._load(key)) is None: raise KeyError(key)
    return value

  def __contains__(self, key) -> bool: return dict.__contains__(self, key) or self._load(key) is not None

  def get(self, key, default=None):
    if dict.__contains__(self, key): return dict.__getitem__(self, key)
    value = self._load(key)
    return default if value is None else value

  def __setitem__(self, key, value) -> None:
    known = dict.get(self, key) is value
    dict.__setitem__(self, key, value)
    if known or not _disk_caches_on: return
    try:
      if (disk_key := self.disk_key(key)) is None or (entry := self.pack(value)) is None: return
      diskcache_put(self.table, disk_key, _dumps(entry))
      self.stats.stores += 1
    except Exception: pass   # the disk cache is only ever a shortcut


class _Pickler(pickle.Pickler):
  """A BUFFER node without the device Buffer it may stand for in this process (UOp's own pickling takes it along): a
  schedule's buffers are numbered placeholders, which can be the very node of a live buffer with that number."""

  def reducer_override(self, obj):
    if type(obj) is UOp and obj.op is Ops.BUFFER: return UOp, (obj.op, obj.dtype, obj.src, obj.arg, obj.tag, obj.metadata)
    return NotImplemented


def _dumps(entry: object) -> bytes:
  """Pickled and compressed (hand-written kernels' binaries ride along in a step's schedule)."""
  out = io.BytesIO()
  _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(entry)
  return zlib.compress(out.getbuffer(), 1)


def _uop_devices(u: UOp) -> set[str]:
  return {d for x in u.toposort() if x.op in (Ops.PARAM, Ops.BUFFER) and x.device is not None
          for d in ((x.device,) if isinstance(x.device, str) else x.device)}


class ScheduleDiskCache(DiskBackedCache):
  """tinygrad.schedule.schedule_cache: a tensor graph, its buffers made numbered parameters (`UOp.key` of the
  normalized SINK) -> the LINEAR of its kernels (their ASTs), intermediate buffers as numbered placeholders."""

  def disk_key(self, key: bytes) -> str: return _digest("schedule", key.hex())

  def pack(self, linear: UOp) -> object | None:
    # self-contained: every buffer a placeholder, which each use of the schedule replaces by a fresh buffer
    if any(u.op is Ops.BUFFER and not isinstance(u.arg, ParamArg) for u in linear.toposort()): return None
    devices = {d: _device_identity(d) for d in _uop_devices(linear)}
    if any(v is None for v in devices.values()): return None
    return devices, linear

  def unpack(self, entry) -> UOp | None:
    devices, linear = entry
    return linear if all(_device_identity(d) == identity for d, identity in devices.items()) else None


class ProgramDiskCache(DiskBackedCache):
  """tinygrad.codegen.to_program_cache: (kernel AST's `UOp.key`, renderer class, renderer target, codegen settings)
  -> the PROGRAM (its lowered SINK, LINEAR, SOURCE, compiled BINARY and ProgramInfo)."""

  def disk_key(self, key: tuple) -> str | None:
    ast_key, renderer_class, target, *settings = key
    identity = next((i for d in sorted(Device._opened_devices) if (i := _device_identity(d)) is not None
                     and i.startswith(f"{_qualname(renderer_class)}|{target!r}|")), None)
    return None if identity is None else _digest("program", ast_key.hex(), identity, repr(settings))

  def pack(self, program: UOp) -> object | None: return program if program.op is Ops.PROGRAM and program.src[-1].op is Ops.BINARY else None

  def unpack(self, program) -> UOp | None: return program if isinstance(program, UOp) and program.op is Ops.PROGRAM else None


def caches_present() -> bool:
  return (isinstance(tinygrad.schedule.schedule_cache, dict) and callable(tinygrad.schedule.lower_sink_to_linear)
          and tinygrad.codegen.to_program_cache is tinygrad.engine.realize.to_program_cache
          and callable(tinygrad.codegen.to_program_key) and callable(tinygrad.engine.realize.lower_and_compile))


def install_disk_caches(enabled: bool = True) -> None:
  """Back tinygrad's schedule and program caches with its disk cache (process-wide; tinygrad's CACHELEVEL=0 turns every
  disk cache off, this one too), or with `enabled` False stop reading and writing it. What the caches held stays."""
  global _disk_caches_on
  if not isinstance(tinygrad.schedule.schedule_cache, ScheduleDiskCache):
    tinygrad.schedule.schedule_cache = ScheduleDiskCache("schedule", _SCHEDULE_TABLE, tinygrad.schedule.schedule_cache)
  if not isinstance(tinygrad.codegen.to_program_cache, ProgramDiskCache):
    programs = ProgramDiskCache("program", _PROGRAM_TABLE, tinygrad.codegen.to_program_cache)
    tinygrad.codegen.to_program_cache = tinygrad.engine.realize.to_program_cache = programs
  _disk_caches_on = enabled
