"""The two start-up steps before anything loads, for tests that check a config."""

from __future__ import annotations

from llmfast.config import EngineConfig
from llmfast.engine.args import EngineArgs
from llmfast.engine.model_resolution import resolve_model
from llmfast.models.sources.model_source import ModelSource


def engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource]:
    """Resolve the model `args` names, then build the config from it (as
    `LLMEngine.from_engine_args` does): the config and the model's source."""
    resolved = resolve_model(args)
    return args.create_engine_config(resolved), resolved.source
