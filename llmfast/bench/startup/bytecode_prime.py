"""Fill the bytecode cache llmfast keeps where Python keeps none (utils/bytecode.py) with
what a start-up imports, before the start-up benchmark's cold start.

    python -m llmfast.bench.startup.bytecode_prime

Why: a cold start is meant to find llmfast's caches empty (compile, Inductor, Triton,
autotuning), not Python's. Where packages are installed without bytecode and Python may
write none beside them (the H100 machine: 6.5 s of `compile()` per start), llmfast's own
bytecode cache stands in for the `__pycache__` directories a usual pip install has. A
process that imports the modules first fills it, so that the cold start measures on
such a machine what it measures on any other; the benchmark reports the seconds the
imports took apart.
"""

from __future__ import annotations

import importlib
import logging
import sys

logger = logging.getLogger(__name__)

# (module, attribute or None): the heavy imports of a start-up, the lazy ones included
# (Dynamo and Inductor come with the compiler's set-up, Inductor's code generation with
# a cold compile, transformers with the tokenizer). A module a start does not import is
# only compiled once for nothing; one left out is compiled by the cold start itself.
PRIME_IMPORTS: tuple[tuple[str, str | None], ...] = (
    ("llmfast.llm", None),
    ("llmfast.worker.model_runner", None),
    ("llmfast.compile.compiled_model", None),
    ("llmfast.attention.triton.launch", None),
    ("llmfast.kernels.layers.triton_kernels", None),
    ("torch._dynamo", None),
    ("torch._inductor.compile_fx", None),
    ("torch._inductor.standalone_compile", None),
    ("torch._inductor.codegen.triton", None),
    ("torch._inductor.codegen.cpp", None),
    ("torch._inductor.runtime.triton_heuristics", None),
    ("triton.compiler", None),
    ("transformers", "PreTrainedTokenizerFast"),
    ("tokenizers", None),
)


def prime(imports: tuple[tuple[str, str | None], ...] = PRIME_IMPORTS) -> int:
    """Import each; returns how many failed (a missing optional package is no error)."""
    failed = 0
    for module, attribute in imports:
        try:
            loaded = importlib.import_module(module)
            if attribute is not None:
                getattr(loaded, attribute)  # a lazy package imports it here
        except Exception as e:  # noqa: BLE001 - the cold start meets it, if it matters
            failed += 1
            logger.debug("priming %s: %s", module, e)
    return failed


def main(argv: list[str]) -> int:
    """Exit status: 0, or with modules named on the command line (tests), 1 when any of
    them failed to import."""
    if len(argv) > 1:
        return 1 if prime(tuple((name, None) for name in argv[1:])) else 0
    prime()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
