"""The executor flags from the command line: `llmfast generate -tp 2
--distributed-executor-backend mp` end to end in its own process (the tokens of the
one-process run; no worker left once it exits), and bad values or a rank that cannot
start as one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.helpers.cli import TINY, assert_one_line_error, invoke
from tests.helpers.processes import children, wait_until_gone, with_marker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = ["--json", "-", "--temperature", "0", "--max-tokens", "6", "--ignore-eos",
          "--max-model-len", "64", "--num-gpu-blocks-override", "64"]


@pytest.mark.slow  # ~45 s; TP=2 through worker processes is covered by test_executor_mp
def test_generate_tp2_mp_from_the_command_line():
    want = invoke("generate", "hello there", "The capital of France", *TINY, *GREEDY)
    assert want.exit_code == 0, want.output
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": ROOT, "LLMFAST_TEST_MARKER": marker}
    result = subprocess.run(
        [sys.executable, "-m", "llmfast", "generate", "hello there", "The capital of France",
         *TINY, *GREEDY, "-tp", "2", "--distributed-executor-backend", "mp"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    got, expected = json.loads(result.stdout), json.loads(want.stdout)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert not with_marker("LLMFAST_TEST_MARKER", marker)  # its workers exited with it


@pytest.mark.parametrize(("args", "fragment"), [
    (["--distributed-executor-backend", "threads"], "unknown executor backend 'threads'"),
    (["-tp", "2", "--distributed-executor-backend", "uni"], "uni executor runs one rank"),
    (["-tp", "0"], "positive integer"),
    (["--tensor-parallel-size", "two"], "tensor-parallel-size"),
])
def test_bad_executor_flags_are_one_line_errors(args, fragment):
    assert_one_line_error(invoke("generate", "hi", *TINY, *args), fragment)


def test_rank_start_up_failure_is_one_line_and_leaves_no_worker():
    before = children()
    # One usable block of 16 tokens for max-model-len 64: every rank refuses at start-up.
    result = invoke("generate", "hi", *TINY, "-tp", "2", "--distributed-executor-backend",
                    "mp", "--max-model-len", "64", "--num-gpu-blocks-override", "2")
    line = assert_one_line_error(result, "failed during start-up: KV cache holds 16 tokens")
    assert line.startswith(("error: worker rank 0 ", "error: worker rank 1 "))
    assert not wait_until_gone(children() - before, 10)


def test_importing_llmfast_does_not_import_ray():
    code = ("import sys\n"
            "import llmfast.cli.main, llmfast.llm, llmfast.executor.mp.multiproc\n"
            "from llmfast import LLM\n"
            "assert 'ray' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
