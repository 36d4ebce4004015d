#!/usr/bin/env bash
# The GPU machine's software stack, from this (CPU) machine: the wheels it lacks, and the
# default test suite run here against its versions.
#
#   bash scripts/gpu_stack.sh wheels                  # into ./.whl/
#   bash scripts/gpu_stack.sh compat [pytest args]    # default: the default suite, as the
#                                                     # README runs it (-q -n auto --dist loadfile)
#
# wheels: the wheels the GPU machine lacks, for its Python 3.12, into ./.whl/ (run once
# from the repo root, on this machine: the GPU machine cannot download). Name .whl in the
# device call's carry and install them with the preamble in scripts/gpu_check.py's
# docstring. ../shared/device/wheels.sh fetches nvtx and gguf (enough for every step but
# `serve`); the server's stack (fastapi, uvicorn with uvloop and httptools,
# prometheus-client, and httpx for the load generator) comes on top, pinned to the
# versions the server tests pass with here. About 4 MB. Checked on 2026-11-23: the same
# pins for cp311, installed with `pip install --no-index --no-deps --target` into a bare
# venv, import fastapi, uvicorn, prometheus_client, httpx and pydantic.
#
# compat: the default test suite on the CPU against the GPU machine's versions (torch
# 2.11, triton 3.6, transformers 5.17: constraints/gpu-stack.txt) instead of CI's (torch
# 2.13, triton 3.7). llmfast must run on both; CI checks only the second. This needs no
# GPU: it catches API differences (torch, Triton's compiler for sm_90 through the offline
# target, Triton's interpreter, transformers) before device minutes are spent on them.
# The venv (~2.7 GB: PyPI's torch 2.11 is a CUDA build) is made once under COMPAT_VENV
# (default /tmp/llmfast-gpu-stack) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."

wheels() {
    local serve_stack=(
        fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
        pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        typing_extensions==4.16.0
        uvicorn==0.54.0 click==8.5.1 h11==0.16.0 uvloop==0.23.0 httptools==0.9.0
        anyio==4.16.0 sniffio==1.3.1 idna==3.20
        httpx==0.28.1 httpcore==1.0.9 certifi==2026.5.20
        prometheus_client==0.26.0
    )
    bash ../shared/device/wheels.sh "${serve_stack[@]}"
}

compat() {
    local venv=${COMPAT_VENV:-/tmp/llmfast-gpu-stack} args
    if [[ ! -x $venv/bin/python ]]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip
    fi
    # The CPU machines' pip cap (/etc/xdg/pip) is for torch <= 2.14.1 and admits 2.11.
    "$venv/bin/pip" install -q -c constraints/gpu-stack.txt -e ".[test]" > "$venv/install.log" 2>&1 \
        || { tail -n 30 "$venv/install.log"; exit 1; }
    "$venv/bin/python" -c 'import torch, triton, transformers, numpy
print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "numpy", numpy.__version__)'
    if (( $# )); then args=("$@"); else args=(-q -n auto --dist loadfile); fi
    exec "$venv/bin/python" -m pytest -p no:cacheprovider "${args[@]}"
}

case "${1:-}" in
    wheels) shift; wheels "$@" ;;
    compat) shift; compat "$@" ;;
    *) echo "usage: bash scripts/gpu_stack.sh wheels | compat [pytest args]" >&2; exit 2 ;;
esac
