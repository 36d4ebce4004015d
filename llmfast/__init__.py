"""llmfast: a small, fast inference engine for Llama, Mistral, Qwen and Gemma 3 models.

`LLM` (and with it torch) is imported on first use, so importing a light part of the
package (`llmfast.core`, the CLI's `--help`) does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmfast.outputs import CompletionOutput, GenerationInterrupted, RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.structured_params import StructuredOutputs
from llmfast.version import __version__

if TYPE_CHECKING:
    from llmfast.llm import LLM

__all__ = ["LLM", "CompletionOutput", "GenerationInterrupted", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llmfast.llm import LLM

        return LLM
    raise AttributeError(f"module 'llmfast' has no attribute {name!r}")
