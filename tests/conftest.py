"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """An engine holds a GC freeze of everything alive at its start-up while it lives
    (`llmfast.utils.gc_freeze`); module-scoped engines live across many tests, and each new
    engine freezes whatever the tests left alive, so hand everything back to the
    collector after each test or cyclic garbage would pile up."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template."""
    from tests.helpers.chat_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="session", params=[0, 1], ids=lambda n: f"api-servers-{n}")
def server(request, serve_model_dir, tmp_path_factory):
    """One `llmfast serve` subprocess shared by the server tests (start-up is the cost),
    with HTTP on the engine's process (--api-servers 0) and in a process of its own (1)."""
    from tests.serve_server import start_server

    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    proc = start_server(serve_model_dir, log, "--max-model-len", "2048", "--max-num-seqs", "48",
                        "--api-servers", str(request.param))
    yield proc
    proc.stop()
