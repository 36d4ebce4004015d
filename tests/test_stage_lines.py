"""Piped (stderr not a terminal, no bar drawn), a model's one-time preparation still says
what it does: one plain line per stage of the conversion; the engine's own start-up
stages stay quiet, and a second run, on the cache, prints none."""

from __future__ import annotations

import io

from rich.console import Console

from llmfast.cli.common import stage_progress
from llmfast.utils.progress import OnceStage
from tests.helpers.cli import invoke
from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import train_byte_level_bpe


def test_once_stages_are_plain_lines_where_no_bar_is_drawn():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=False)) as report:
        report(OnceStage("dequantising tensors"), 0.1)
        report(OnceStage("dequantising tensors"), 0.9)  # the same stage: no new line
        report("loading weights", None)  # an every-run stage: no line
        report(OnceStage("conversion done"), 1.0)
    assert out.getvalue() == "dequantising tensors\nconversion done\n"


def test_a_terminal_gets_the_bar_only():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=True, width=80)) as report:
        report(OnceStage("dequantising tensors"), 0.5)
    assert "dequantising tensors\n" not in out.getvalue().replace("\r", "\n").split("\x1b")[0]


def test_gguf_conversion_prints_its_stages_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path / "cache"))
    bpe = train_byte_level_bpe()
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(bpe.get_vocab_size(), True), bpe)
    args = ("generate", "hi", "--model", str(gguf), "--device", "cpu", "--max-tokens", "2")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    # generate's own summary line comes last.
    lines = [line for line in first.stderr.splitlines() if "prompt(s)" not in line]
    assert lines == ["reading tiny.gguf", "dequantising tensors", "writing model.safetensors",
                     "converting the tokenizer", "conversion done"], first.stderr
    second = invoke(*args)
    assert second.exit_code == 0, second.output
    assert [line for line in second.stderr.splitlines() if "prompt(s)" not in line] == []
