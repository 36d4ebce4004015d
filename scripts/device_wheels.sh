#!/usr/bin/env bash
# The wheels the GPU machine lacks, for its Python 3.12, into ./.whl/ (run once from the
# repo root, on this machine: the GPU machine cannot download). Name .whl in the device
# call's carry and install them with the preamble in scripts/gpu_check.py's docstring.
#
# ../shared/device/wheels.sh fetches nvtx and gguf (enough for every step but `serve`);
# the server's stack (fastapi, uvicorn with uvloop and httptools, prometheus-client, and
# httpx for the load generator) comes on top, pinned to the versions the server tests pass with here.
# About 4 MB. Checked on 2026-11-23: the same pins for cp311, installed with
# `pip install --no-index --no-deps --target` into a bare venv, import fastapi, uvicorn,
# prometheus_client, httpx and pydantic.
set -euo pipefail
cd "$(dirname "$0")/.."
serve_stack=(
    fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
    pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    typing_extensions==4.16.0
    uvicorn==0.54.0 click==8.5.1 h11==0.16.0 uvloop==0.23.0 httptools==0.9.0
    anyio==4.16.0 sniffio==1.3.1 idna==3.20
    httpx==0.28.1 httpcore==1.0.9 certifi==2026.5.20
    prometheus_client==0.26.0
)
bash ../shared/device/wheels.sh "${serve_stack[@]}"
