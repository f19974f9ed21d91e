"""The frames between the API process and the engine-core process: [type tag, msgpack payload], msgpack by msgspec
(the messages are plain dataclasses, engine/messages.py). Needs the serve extra (msgspec)."""
from __future__ import annotations

from typing import Any

import msgspec

from tinyvllm.engine.messages import (
  EngineCoreInfo,
  EngineCoreOutputs,
  EngineCoreRequest,
  OutputType,
  RequestType,
  SampleRef,
)

_PAYLOADS_IN: dict[RequestType, Any] = {RequestType.ADD: EngineCoreRequest, RequestType.ABORT: list[str],
                                        RequestType.STOP_SAMPLES: list[SampleRef], RequestType.SHUTDOWN: None}
_PAYLOADS_OUT: dict[OutputType, Any] = {OutputType.READY: EngineCoreInfo, OutputType.OUTPUTS: EngineCoreOutputs, OutputType.FAILED: str}
_ENCODER = msgspec.msgpack.Encoder()
_INPUT_DECODERS = {kind.value: (kind, msgspec.msgpack.Decoder(payload)) for kind, payload in _PAYLOADS_IN.items()}
_OUTPUT_DECODERS = {kind.value: (kind, msgspec.msgpack.Decoder(payload)) for kind, payload in _PAYLOADS_OUT.items()}


def encode(kind: RequestType | OutputType, payload: Any) -> list[bytes]:
  return [kind.value, _ENCODER.encode(payload)]


def decode_input(frames: list[bytes]) -> tuple[RequestType, Any]:
  kind, decoder = _INPUT_DECODERS[bytes(frames[0])]
  return kind, decoder.decode(frames[1])


def decode_output(frames: list[bytes]) -> tuple[OutputType, Any]:
  kind, decoder = _OUTPUT_DECODERS[bytes(frames[0])]
  return kind, decoder.decode(frames[1])
