"""The engine, in vLLM V1's shape:

- `core` (`EngineCore`): schedule + execute, the one-step-in-flight pipeline; token ids
  out, no text. `core_process` runs it in a process of its own (`llmfast serve`).
- `core_client`: one interface to the core, in this process (`InprocClient`: `LLM`,
  `llmfast chat`) or in another (`MPClient`: the server's frontends).
- `processing/`, the frontend's side: `input_processor` (prompts tokenized and checked,
  requests built for the core), `output_processor` (with `detokenizer`: token ids made
  into text and `RequestOutput`s, stop strings, logprobs, each output routed to its
  request's caller: its queue, or the step's returned list), `tokenizer` (the picklable
  frontend tokenizer).
- `llm_engine` (`LLMEngine`): the three in one process; `startup`: the executor and the
  tokenizer started together.
- `args` (`EngineArgs`, with `arg_checks` and `flags`): the engine flags and `LLM(...)`'s
  keywords; `model_resolution`: the model found, fetched or converted, the one step
  before `args.create_engine_config(resolved)` that reads disk or network.

`LLMEngine` is imported on first use (`from llmfast.engine import LLMEngine`), so that a
frontend process importing the processors does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmfast.engine.processing.input_processor import Prompt, tokenize_prompt
    from llmfast.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine", "Prompt", "tokenize_prompt"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from llmfast.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("Prompt", "tokenize_prompt"):
        from llmfast.engine.processing import input_processor

        return getattr(input_processor, name)
    raise AttributeError(f"module 'llmfast.engine' has no attribute {name!r}")
