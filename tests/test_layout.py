"""The package's shape, read from its source: imports point down a table of floors (no
upward import, no cycle between any two modules), the host side (`llmfast.core`) imports
no torch, and `llmfast --help` imports no torch.

A "room" is a subpackage (`cli/`, `core/`, ...) or a module at the root (`config`,
`llm`, ...). Every `llmfast` import counts: one inside a function (a lazy import is
still a dependency) and one under `if TYPE_CHECKING:` (a type-only import still ties
the two modules: neither can be read, moved or tested without the other).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmfast"

# The floors, bottom first. A room imports rooms on lower floors only, never one on its
# own floor or above; the exception is the bottom floor's shared vocabulary, whose
# modules may import each other (they are words every floor speaks, not layers). A new
# room must be placed here, and a new floor argued for: at most 8 of them, so that the
# longest import chain, from `python -m llmfast` down to the vocabulary, crosses at most
# 8 floors (`test_import_chain_is_short` measures it).
FLOORS: tuple[tuple[str, ...], ...] = (
    # 1. the shared vocabulary (configs, sampling params, outputs, small helpers) and the
    #    rooms that import no other: the layer kernels, tensor parallelism's collectives.
    ("config", "sampling_params", "structured_params", "outputs", "version", "utils/",
     "profiling/", "kernels/", "distributed/"),
    # 2. attention (over the kernels' launcher), CUDA graphs' capture and dispatch, the
    #    host-side scheduler (no torch), the tokenizer (models/sources reads one with a
    #    model: it stays below models/), the grammar engine's side of structured outputs
    #    (compile and cache; the sampler's bitmask is the worker's).
    ("attention/", "cuda_graphs/", "core/", "tokenizer", "structured/"),
    # 3. the model and its compilation.
    ("models/", "compile/"),
    # 4. one device's worker: the model runner and its start-up, the input batch, the
    #    sampler.
    ("worker/",),
    # 5. one worker or many (processes, Ray actors).
    ("executor/",),
    # 6. the engine (llmfast/engine/: core, its client, input and output processing, its
    #    arguments and the model resolution before them), above its executor (and the
    #    worker's start-up, which fits a CPU's max-model-len to the KV cache).
    ("engine/",),
    # 7. what drives an engine: `LLM`, the HTTP server, the benchmarks' library.
    ("llm", "serve/", "bench/"),
    # 8. the `llmfast` command (with `python -m llmfast`) and the package's public
    #    surface (`from llmfast import LLM`).
    ("cli/", "llmfast"),
)
MAX_FLOORS = 8
VOCABULARY = frozenset(FLOORS[0]) - {"kernels/", "distributed/"}
FLOOR = {room: i + 1 for i, rooms in enumerate(FLOORS) for room in rooms}
# Modules that belong to a room other than their path's: `python -m llmfast` is the CLI.
ROOM_OF_MODULE = {"llmfast.__main__": "cli/"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


@functools.cache
def module_graph() -> dict[str, frozenset[str]]:
    """module -> the llmfast modules it imports (`from llmfast.a import b` names the
    module llmfast.a.b when that is one, else the package llmfast.a)."""
    mods = _modules()
    return {name: imports_of(path.read_text(), mods, name) for name, path in mods.items()}


def imports_of(source: str, mods: dict[str, Path] | set[str], name: str = "") -> frozenset[str]:
    """The modules of `mods` that `source` imports anywhere: at the top, inside a
    function, under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in mods else node.module)
    return frozenset(m for m in found if m in mods and m != name)


def room(module: str) -> str:
    if module in ROOM_OF_MODULE:
        return ROOM_OF_MODULE[module]
    parts = module.split(".")
    if len(parts) == 1:
        return "llmfast"  # the package's __init__: the public surface
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, deps in module_graph().items():
        graph.setdefault(room(module), set())
        for dep in deps:
            if room(dep) != room(module):
                graph[room(module)].add(room(dep))
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


def longest_chain(graph: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """The import chain (rooms, top first) that crosses the most floors; a step within
    one floor (the vocabulary's) crosses none. The graph has no cycle."""

    @functools.cache
    def chain(node: str) -> tuple[str, ...]:
        below = [chain(dep) for dep in sorted(graph.get(node, ()))]
        return (node,) + max(below, key=lambda c: num_floors(c, floor), default=())

    return list(max((chain(node) for node in sorted(graph)),
                    key=lambda c: num_floors(c, floor), default=()))


def num_floors(chain: tuple[str, ...] | list[str], floor: dict[str, int]) -> int:
    return len({floor[r] for r in chain})


# ---------------------------------------------------------------------- the checks


def test_graph_checks_catch_what_they_look_for():
    """The helpers themselves, on small graphs and sources with a known answer."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph, floor = {"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": set()}, \
        {"a": 3, "b": 2, "c": 1, "d": 1}
    assert longest_chain(graph, floor) == ["a", "b", "c", "d"]
    assert num_floors(longest_chain(graph, floor), floor) == 3
    assert room("llmfast.core.scheduler") == "core/" and room("llmfast.llm") == "llm"
    assert room("llmfast.__main__") == "cli/" and room("llmfast") == "llmfast"
    # The parser sees a lazy import and a TYPE_CHECKING one.
    mods = {"llmfast.a", "llmfast.b", "llmfast.c", "llmfast.c.d"}
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from llmfast.a import X\n"
              "def f():\n    import llmfast.b\n"
              "from llmfast.c import d\n")
    assert imports_of(source, mods) == {"llmfast.a", "llmfast.b", "llmfast.c.d"}
    assert "llmfast.llm" in module_graph()["llmfast.cli.common"]  # `load_llm`'s lazy import


def test_every_room_has_a_floor():
    rooms = set(room_graph())
    assert not rooms - set(FLOOR), f"rooms on no floor: {sorted(rooms - set(FLOOR))}"
    assert len(FLOORS) <= MAX_FLOORS
    assert sum(map(len, FLOORS)) == len(FLOOR), "a room on two floors"


def test_no_import_cycles():
    """Between any two modules (type-only imports included), and between rooms."""
    assert find_cycle(module_graph()) is None
    assert find_cycle(room_graph()) is None


def test_no_upward_imports():
    graph = room_graph()
    bad = [f"{r} (floor {FLOOR[r]}) -> {dep} (floor {FLOOR[dep]})"
           for r, deps in graph.items() for dep in deps
           if FLOOR[dep] >= FLOOR[r] and not {r, dep} <= VOCABULARY]
    assert not bad, bad


def test_import_chain_is_short():
    chain = longest_chain(room_graph(), FLOOR)
    assert num_floors(chain, FLOOR) <= MAX_FLOORS, " -> ".join(chain)


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
