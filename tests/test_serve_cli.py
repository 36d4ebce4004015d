"""`llmfast serve` on the command line: help, and bad flags as one-line errors before
any model is loaded (the server itself is tested in test_serve*.py)."""

from __future__ import annotations

import socket

import pytest

from tests.helpers.cli import TINY, assert_one_line_error, invoke


def test_serve_help():
    result = invoke("serve", "--help")
    assert result.exit_code == 0
    for text in ("llmfast serve", "Examples", "--host", "--port", "--api-key",
                 "--served-model-name", "--max-body-size", "--api-servers", "--model",
                 "--max-num-seqs"):
        assert text in result.stdout, text
    assert "serve" in invoke("--help").stdout


@pytest.mark.parametrize("args, fragment", [
    (["serve", *TINY, "--port", "70000"], "65535"),
    (["serve", *TINY, "--max-body-size", "lots"], "size"),
    (["serve", "random:tiny", "--model", "random:small"], "disagree"),
    (["serve", *TINY, "--host", "no-such-host.invalid"], "cannot listen"),
    (["serve", *TINY, "--host", ""], "every interface"),
    (["serve", *TINY, "--api-key", ""], "without a key"),
    (["serve", *TINY, "--api-servers", "-1"], "[0, 64]"),
    (["serve", *TINY, "--api-servers", "65"], "[0, 64]"),
    (["serve", *TINY, "--api-servers", "two"], "valid integer"),
])
def test_serve_bad_flags(args, fragment):
    assert_one_line_error(invoke(*args), fragment)


def test_serve_port_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(invoke("serve", *TINY, "--port", str(port)), "cannot listen")
