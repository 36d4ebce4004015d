#!/usr/bin/env bash
# The default test suite on the CPU against the GPU machine's versions (torch 2.11,
# triton 3.6, transformers 5.17: constraints/gpu-stack.txt) instead of CI's (torch 2.13,
# triton 3.7). llmfast must run on both; CI checks only the second. This needs no GPU:
# it catches API differences (torch, Triton's compiler for sm_90 through the offline
# target, Triton's interpreter, transformers) before device minutes are spent on them.
#
#   bash scripts/compat_check.sh [pytest args]     # default: the default suite, as the
#                                                  # README runs it (-q -n auto --dist loadfile)
#
# The venv (~2.7 GB: PyPI's torch 2.11 is a CUDA build) is made once under
# COMPAT_VENV (default /tmp/llmfast-gpu-stack) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COMPAT_VENV:-/tmp/llmfast-gpu-stack}
if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
# The CPU machines' pip cap (/etc/xdg/pip) is for torch <= 2.14.1 and admits 2.11.
"$VENV/bin/pip" install -q -c constraints/gpu-stack.txt -e ".[test]" > "$VENV/install.log" 2>&1 \
    || { tail -n 30 "$VENV/install.log"; exit 1; }
"$VENV/bin/python" -c 'import torch, triton, transformers, numpy
print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "numpy", numpy.__version__)'
if (( $# )); then args=("$@"); else args=(-q -n auto --dist loadfile); fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "${args[@]}"
