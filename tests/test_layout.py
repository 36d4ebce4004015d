"""The package's shape, read from its source: the host side (`llmfast.core`) imports no
torch; imports point down the layers only (no cycles, between modules or between
packages); the chain from `python -m llmfast` to the bottom stays short.

A "unit" is a subpackage (`cli/`, `core/`, ...) or a module at the root (`engine`,
`config`, ...). Every `llmfast` import counts, also one inside a function (a lazy import
is still a dependency), except under `if TYPE_CHECKING:` (annotations only).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmfast"

# "About 8": the longest chain is 10 (__main__ -> cli/ -> bench/ -> llm -> engine ->
# executor/ -> worker/ -> core/ -> sampling_params -> utils/); a new floor must be argued
# for here. executor/ is one: the engine must not know whether its runner is in this
# process or in N worker processes, and the workers' side (worker processes, Ray actors)
# must not import the engine.
MAX_FLOORS = 10
# unit -> units it must never import (directly or through a lazy import).
FORBIDDEN = {
    "core/": {"worker/", "engine", "llm", "engine_args", "cli/", "serve/", "bench/", "models/",
              "kernels/", "compile/", "graphs/", "executor/"},
    "executor/": {"engine", "llm", "engine_args", "cli/", "serve/", "bench/"},
    "worker/": {"engine", "llm", "cli/", "serve/", "bench/", "executor/"},
    **{low: {"engine", "llm", "engine_args", "cli/", "serve/", "core/", "worker/", "bench/",
             "executor/"}
       for low in ("models/", "kernels/", "compile/", "graphs/")},
}
# The shared vocabulary (root modules and the helper packages) imports nothing but itself.
VOCABULARY = {"config", "sampling_params", "outputs", "attention_metadata", "version",
              "utils/", "profiling/"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or \
        getattr(test, "attr", None) == "TYPE_CHECKING"


@functools.cache
def module_graph() -> dict[str, frozenset[str]]:
    """module -> the llmfast modules it imports (`from llmfast.a import b` names the
    module llmfast.a.b when that is one, else the package llmfast.a)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        found: set[str] = set()
        _collect_imports(ast.parse(path.read_text(), str(path)), mods, found)
        graph[name] = frozenset(m for m in found if m in mods and m != name)
    return graph


def _collect_imports(node: ast.AST, mods: dict[str, Path], found: set[str]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                _collect_imports(other, mods, found)
            continue
        if isinstance(child, ast.Import):
            found.update(alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
            for alias in child.names:
                full = f"{child.module}.{alias.name}"
                found.add(full if full in mods else child.module)
        _collect_imports(child, mods, found)


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "llmfast"  # the package's __init__: the public surface
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, deps in module_graph().items():
        graph.setdefault(unit(module), set())
        for dep in deps:
            if unit(dep) != unit(module):
                graph[unit(module)].add(unit(dep))
    return graph


def find_cycle(graph: dict[str, set[str]] | dict[str, frozenset[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first, colouring nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def floors(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """unit -> its longest import chain, itself first (the graph has no cycle)."""

    @functools.cache
    def chain(node: str) -> tuple[str, ...]:
        below = [chain(dep) for dep in graph.get(node, ())]
        return (node,) + max(below, key=len, default=())

    return {node: list(chain(node)) for node in graph}


# ---------------------------------------------------------------------- the checks


def test_graph_checks_catch_what_they_look_for():
    """The helpers themselves, on small graphs with a known answer."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set()})["a"] == ["a", "b", "c"]
    assert unit("llmfast.core.scheduler") == "core/" and unit("llmfast.engine") == "engine"
    # The parser sees a lazy import and skips a TYPE_CHECKING one.
    graph = module_graph()
    assert "llmfast.llm" in graph["llmfast.cli.common"]  # `load_llm` imports it lazily
    metadata = graph["llmfast.worker.sampling.sampling_metadata"]
    assert "llmfast.worker.input_batch" not in metadata


def test_no_import_cycles():
    assert find_cycle(module_graph()) is None
    assert find_cycle(unit_graph()) is None


def test_no_upward_imports():
    graph = unit_graph()
    bad = [f"{u} -> {dep}" for u, banned in FORBIDDEN.items() for dep in graph.get(u, ())
           if dep in banned]
    bad += [f"{u} -> {dep}" for u in VOCABULARY for dep in graph.get(u, ())
            if dep not in VOCABULARY]
    assert not bad, bad
    assert VOCABULARY <= set(graph), "a vocabulary module was renamed: update this test"


def test_import_chain_is_short():
    chain = max(floors(unit_graph()).values(), key=len)
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


@pytest.mark.parametrize("modules", [
    ["llmfast.core." + p.stem for p in sorted((PACKAGE / "core").glob("*.py"))]
    + ["llmfast.config", "llmfast.sampling_params", "llmfast.utils.flag_values"],
])
def test_host_side_imports_no_torch(modules):
    code = ("import sys\n"
            f"for name in {modules!r}:\n"
            "    __import__(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=PACKAGE.parent, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["generate", "--help"]])
def test_cli_help_imports_no_torch(argv):
    """`llmfast --help` answers in a fraction of a second: torch (~1 s to import, more
    with CUDA) waits until a command runs."""
    code = ("import sys\n"
            f"sys.argv = ['llmfast', *{argv!r}]\n"
            "from llmfast.cli.main import main\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=PACKAGE.parent, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
