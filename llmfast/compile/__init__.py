"""torch.compile for llmfast: the piecewise backend (split at attention, Inductor for
the pieces), the compile cache, and `CompiledModel`, the runner's entry point."""

from llmfast.compile.compiled_model import CompiledModel
from llmfast.compile.stats import CompileStats

__all__ = ["CompileStats", "CompiledModel"]
