"""keep_bytecode (llmfast/utils/bytecode.py): where installed packages have no bytecode
and Python may write none beside them, later imports keep theirs under llmfast's cache;
everywhere else nothing changes. Each case runs in a fresh interpreter, on a package
made here (the probe) instead of torch."""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmfast.cli import main as cli_main
from llmfast.utils import bytecode

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
from pathlib import Path
from llmfast.utils.bytecode import keep_bytecode
print(keep_bytecode(Path(sys.argv[1]), probe="probe_pkg"))
import probe_pkg
print(probe_pkg.VALUE)
"""


@pytest.fixture
def probe(tmp_path):
    pkg = tmp_path / "site" / "probe_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 6 * 7\n")
    return pkg


def run(probe: Path, cache: Path, **env_changes: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX",
                        "LLMFAST_BYTECODE_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(probe.parent), str(REPO)])
    env.update({k: v for k, v in env_changes.items() if v is not None})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return proc.stdout.split()


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "pycache").rglob("*.pyc")
                  if "probe_pkg" in p.as_posix())


def test_no_bytecode_allowed_beside_sources_keeps_it_in_the_cache(probe, tmp_path):
    cache = tmp_path / "cache"
    assert run(probe, cache, PYTHONDONTWRITEBYTECODE="1") == ["True", "42"]
    written = cached_files(cache)
    assert len(written) == 1 and written[0].name.startswith("__init__.")
    assert not (probe / "__pycache__").exists()  # nothing beside the installed sources
    # A later start reads that bytecode instead of compiling again.
    stamp = written[0].stat().st_mtime_ns
    assert run(probe, cache, PYTHONDONTWRITEBYTECODE="1") == ["True", "42"]
    assert cached_files(cache) == written and written[0].stat().st_mtime_ns == stamp


def test_read_only_install_keeps_bytecode_in_the_cache(probe, tmp_path, monkeypatch):
    # In this process, with the probe's directory reported read-only (a chmod would not
    # stop root): Python could write nothing beside it even though it may write.
    monkeypatch.syspath_prepend(str(probe.parent))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv("LLMFAST_BYTECODE_CACHE", raising=False)
    assert bytecode.keep_bytecode(tmp_path, probe="probe_pkg") is False  # writable
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False)
    assert bytecode.keep_bytecode(tmp_path, probe="probe_pkg") is True
    assert sys.pycache_prefix == str(tmp_path / "pycache")
    assert os.environ["PYTHONPYCACHEPREFIX"] == sys.pycache_prefix  # its child processes


@pytest.mark.parametrize("case", ["bytecode beside", "python writes it", "turned off",
                                  "user prefix"])
def test_nothing_changes_where_python_keeps_bytecode_itself(probe, tmp_path, case):
    cache = tmp_path / "cache"
    env: dict[str, str | None] = {"PYTHONDONTWRITEBYTECODE": "1"}
    if case == "bytecode beside":
        assert compileall.compile_dir(str(probe), quiet=1)
    elif case == "python writes it":
        env = {}
    elif case == "turned off":
        env["LLMFAST_BYTECODE_CACHE"] = "0"
    else:
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "users_own")
    assert run(probe, cache, **env) == ["False", "42"]
    assert not (cache / "pycache").exists()


def test_the_command_sets_it_up_before_any_command_runs(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    monkeypatch.setattr(cli_main, "keep_bytecode", lambda cache: calls.append(("keep", cache)))
    monkeypatch.setattr(cli_main, "app", lambda: calls.append(("app", None)))
    cli_main.main()
    assert calls == [("keep", tmp_path), ("app", None)]


def test_a_cold_start_benchmark_shares_the_bytecode_and_primes_it(probe, monkeypatch,
                                                                   tmp_path):
    # `llmfast bench --startup` moves llmfast's caches to an empty root for its cold
    # child, not Python's bytecode: a prefix it keeps for llmfast passes on to the
    # children, which may write there, and a first process fills it with a start's
    # imports (here the probe's) before the cold start.
    from llmfast.bench.startup import runs

    users = tmp_path / "users"
    monkeypatch.setenv("LLMFAST_CACHE", str(users))
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(users / "pycache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(probe.parent), str(REPO)]))
    root = tmp_path / "root"
    assert runs.keeps_own_bytecode()
    env = runs.child_env(root)
    assert env["PYTHONPYCACHEPREFIX"] == str(users / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["LLMFAST_CACHE"] == str(root / "llmfast")
    seconds, written = runs.prime_bytecode(env, ("probe_pkg",), timeout_s=120)
    assert seconds > 0 and written >= 1  # the probe (and whatever the process imported)
    assert len(cached_files(users)) == 1 and not root.exists()
    assert runs.prime_bytecode(env, ("probe_pkg",), timeout_s=120)[1] == 0  # primed
    with pytest.raises(runs.BenchError, match="priming the bytecode failed"):
        runs.prime_bytecode(env, ("probe_pkg", "no_such_module_here"), timeout_s=120)

    # A prefix of the user's own passes on as it is, and so does their choice not to
    # write bytecode.
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "users_own"))
    assert not runs.keeps_own_bytecode()
    env = runs.child_env(root)
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "users_own")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_primed_imports_exist():
    """Every module the priming imports is one this installation has (a renamed module
    would leave the cold start compiling it)."""
    import importlib.util

    from llmfast.bench.startup.bytecode_prime import PRIME_IMPORTS

    missing = [name for name, _ in PRIME_IMPORTS if importlib.util.find_spec(name) is None]
    assert missing == []


def test_a_child_of_llmfast_writes_into_the_prefix_it_was_given(probe, tmp_path):
    # A process started by one that set the prefix (serve's API processes, the start-up
    # benchmark's children) inherits PYTHONPYCACHEPREFIX; it writes there too, even
    # under PYTHONDONTWRITEBYTECODE (else a warm child would compile again).
    cache = tmp_path / "cache"
    assert run(probe, cache, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPYCACHEPREFIX=str(cache / "pycache")) == ["True", "42"]
    assert len(cached_files(cache)) == 1
