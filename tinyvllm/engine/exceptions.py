"""The engine's own failures, as the frontends report them."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
  """The engine stopped (it crashed, its core process died, or it was shut down); no request can be served."""


class EngineLoadError(RuntimeError):
  """The engine core could not load the model (the message says why)."""
