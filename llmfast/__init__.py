"""llmfast: a small, fast inference engine for Llama, Mistral and Qwen models."""

from llmfast.llm import LLM
from llmfast.outputs import CompletionOutput, RequestOutput
from llmfast.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
