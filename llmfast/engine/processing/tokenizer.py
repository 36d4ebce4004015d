"""The tokenizer a frontend works with (`FrontendTokenizer`: picklable, and importing it
imports no torch: the server's API processes receive it from the launcher) and how it is
loaded from a model source."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmfast.config import ConfigError
from llmfast.tokenizer import Tokenizer, TokenizerError, has_tokenizer_files

if TYPE_CHECKING:
    from llmfast.config import EngineConfig
    from llmfast.models.sources.model_source import ModelSource

logger = logging.getLogger(__name__)


@dataclass
class FrontendTokenizer:
    """The tokenizer a frontend uses, or why there is none."""

    tokenizer: Tokenizer | None
    error: str | None  # why there is no tokenizer although the model ships one
    eos_token_ids: tuple[int, ...]  # the model config's and the tokenizer's

    def no_tokenizer_reason(self, model_name: str) -> str:
        if self.error is not None:
            return self.error
        return f"model {model_name} has no tokenizer files"


def load_frontend_tokenizer(config: EngineConfig, source: ModelSource) -> FrontendTokenizer:
    """Load the tokenizer when the model has one (with --chat-template applied); the
    end-of-sequence ids of the model's config and of its tokenizer."""
    tokenizer, error = None, None
    # Random presets carry one (models/sources/preset_tokenizer.py); a weights-only
    # directory has none and runs on token ids.
    if source.path is None or has_tokenizer_files(source.path):
        try:
            tokenizer = source.load_tokenizer()
        except TokenizerError as e:
            error = str(e)
            logger.info("%s; only token-id prompts will work", e)
    template = config.chat_template
    if template is not None:
        if tokenizer is None:
            reason = error or f"model {source.name} has no tokenizer files"
            raise ConfigError(f"--chat-template: {reason}")
        tokenizer = tokenizer.with_chat_template(template)
    eos = tuple(source.config.eos_token_ids)
    if tokenizer is not None:
        eos = tuple(dict.fromkeys(eos + tuple(tokenizer.eos_token_ids)))
    return FrontendTokenizer(tokenizer, error, eos)
