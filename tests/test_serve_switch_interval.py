"""The GIL switch interval while the server runs (serve/switch_interval.py): set for the
server's life, restored after, overridable, and a bad override is a one-line error."""

from __future__ import annotations

import socket
import sys

import pytest

from llmfast.serve import server as server_module
from llmfast.serve.switch_interval import (
    ENV,
    serving_switch_interval,
    switch_interval,
)
from tests.helpers.cli import assert_one_line_error, invoke


def test_python_s_own_unless_overridden(monkeypatch):
    # (0.5 ms on GPUs was the default until the H100 served 13.3k tok/s at 5 ms and
    # 11.6k at 0.5: the module docstring.)
    monkeypatch.delenv(ENV, raising=False)
    assert serving_switch_interval() is None
    monkeypatch.setenv(ENV, " 2 ")
    assert serving_switch_interval() == pytest.approx(0.002)
    monkeypatch.setenv(ENV, "")
    assert serving_switch_interval() is None


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", "5000"])
def test_a_bad_override_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ValueError, match=ENV):
        serving_switch_interval()


def test_the_previous_interval_comes_back_even_after_an_error():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), switch_interval(0.001):
        assert sys.getswitchinterval() == pytest.approx(0.001)
        raise RuntimeError
    assert sys.getswitchinterval() == before
    with switch_interval(None):
        assert sys.getswitchinterval() == before


def test_overlapping_holds_restore_the_first_value_whatever_order_they_end():
    # Two servers on two threads: the first to start saw Python's value; the last to
    # end puts it back, even when the first ends first.
    before = sys.getswitchinterval()
    first, second = switch_interval(0.001), switch_interval(0.0005)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(0.0005)  # the second still serves
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("api_servers", [0, 1])
def test_serve_runs_under_the_interval_and_restores_it(monkeypatch, api_servers):
    # The frontends are replaced by a recorder of the interval they run under; no engine
    # is needed for that (nor built).
    from llmfast.serve import launcher
    from llmfast.serve.api.app import ServeConfig

    seen = []
    monkeypatch.setattr(server_module, "frontend_spec", lambda *a: object())
    for name in ("serve_in_process", "serve_with_api_processes"):
        monkeypatch.setattr(launcher, name, lambda *a, **k: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    monkeypatch.delenv(ENV, raising=False)
    with socket.socket() as sock:
        server_module.serve(None, None, None, sock, ServeConfig("x"), api_servers=api_servers)
        monkeypatch.setenv(ENV, "0.25")
        server_module.serve(None, None, None, sock, ServeConfig("x"), api_servers=api_servers)
    assert seen == [before, pytest.approx(0.00025)]
    assert sys.getswitchinterval() == before


def test_the_cli_refuses_a_bad_override_before_loading(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    result = invoke("serve", "--model", "/nonexistent/model", "--device", "cpu",
                    "--port", "0")
    assert_one_line_error(result, ENV)

