"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """Engines freeze the garbage collector's view of everything alive at start-up (see
    `LLMEngine.__init__`); a test process builds hundreds of engines, so hand their
    objects back to the collector after each test or cyclic garbage would pile up."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template."""
    from tests.conftest_cli import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="session")
def server(serve_model_dir, tmp_path_factory):
    """One `llmfast serve` subprocess shared by the server tests (start-up is the cost)."""
    from tests.serve_server import start_server

    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    proc = start_server(serve_model_dir, log, "--max-model-len", "2048", "--max-num-seqs", "48")
    yield proc
    proc.stop()
