"""torch.compile for llmfast: the piecewise backend (split at attention, Inductor for
the pieces), the compile cache, the warm start's saved trace, and `CompiledModel`, the
runner's entry point. The CUDA graphs around the pieces are llmfast.cuda_graphs'."""

from llmfast.compile.compiled_model import CompiledModel
from llmfast.compile.stats import CompileStats

__all__ = ["CompileStats", "CompiledModel"]
