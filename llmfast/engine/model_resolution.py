"""Resolving the model: the one start-up step before the engine's config that reads disk
or network. `resolve_model(args)` turns `--model` into a local model (fetching the default
model, converting a GGUF file, once), reads its config and its generation_config.json
defaults, and notes the host memory free; `args.create_engine_config(resolved)` then
builds the config from what it found, reading nothing. `LLM`, `llmfast chat`, `serve` and
the benchmarks' start-up call the two in turn (through `LLMEngine.from_engine_args`, or
in `serve`'s own start-up, which hands the config to the core's process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmfast.utils.host_memory import available_host_memory

from llmfast.engine.args import ResolvedModel

if TYPE_CHECKING:
    from llmfast.engine.args import EngineArgs
    from llmfast.utils.progress import Progress


def resolve_model(args: EngineArgs, progress: Progress | None = None) -> ResolvedModel:
    """Find (or fetch, or convert) the model `args` names and read what the engine's
    config takes from it. The checks that need no model run first, so a bad device,
    dtype or chat template fails before a slow download."""
    from llmfast.models.sources.generation_config import resolve_sampling_defaults
    from llmfast.models.sources.model_source import resolve_model as resolve_source

    args.device_and_dtype()
    if args.chat_template is not None:
        from llmfast.tokenizer import check_chat_template

        check_chat_template(args.chat_template)
    source = resolve_source(args.model, progress=progress)
    return ResolvedModel(
        source=source,
        sampling_defaults=resolve_sampling_defaults(args.generation_config, source.path),
        host_memory_available=available_host_memory(),
    )
