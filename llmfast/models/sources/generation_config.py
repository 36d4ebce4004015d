"""The model's own default sampling parameters, from its `generation_config.json` (vLLM's
`--generation-config auto`): what a request that sets no temperature, top_p, ... gets.

Only the fields vLLM takes are read (temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens); `do_sample` is ignored, as there.
Values that a `SamplingParams` would refuse are dropped with a warning, so a quirky file
never stops a model from loading.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from llmfast.config import ConfigError
from llmfast.sampling_params import SamplingParams, SamplingParamsError
from llmfast.utils.paths import expand_user

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# generation_config.json's name -> SamplingParams' name.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "max_new_tokens": "max_tokens"}


def resolve_sampling_defaults(setting: str, model_dir: Path | None
                              ) -> tuple[tuple[str, Any], ...]:
    """`--generation-config`: "auto" reads the model directory's file (nothing when there
    is none), "vllm" means no model defaults, anything else names a directory holding a
    generation_config.json. The defaults as (SamplingParams field, value) pairs."""
    if setting == "vllm":
        return ()
    if setting == "auto":
        if model_dir is None or not (model_dir / GENERATION_CONFIG).is_file():
            return ()
        return read_sampling_defaults(model_dir / GENERATION_CONFIG)
    path = expand_user(setting, "--generation-config")
    if not (path / GENERATION_CONFIG).is_file():
        raise ConfigError(f"--generation-config: {setting!r} is not 'auto', 'vllm' or a "
                          f"directory holding {GENERATION_CONFIG}")
    # Named on purpose: what is wrong with it is an error, not a warning.
    return read_sampling_defaults(path / GENERATION_CONFIG, strict=True)


def read_sampling_defaults(path: Path, strict: bool = False) -> tuple[tuple[str, Any], ...]:
    """The sampling defaults `path` sets; what cannot be used is skipped with a warning
    (a model's own file: the model still runs), or with `strict` (a file the user named
    with --generation-config) a ConfigError."""
    def skip(message: str) -> None:
        if strict:
            raise ConfigError(f"--generation-config: {message}")
        logger.warning("ignoring %s", message)

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        skip(f"{path}: {e}")
        return ()
    if not isinstance(data, dict):
        skip(f"{path}: not a JSON object")
        return ()
    defaults: list[tuple[str, Any]] = []
    for name, field in _FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{field: value})  # its own range and type checks
        except (SamplingParamsError, TypeError) as e:
            skip(f"{path}'s {name}: {e}")
            continue
        defaults.append((field, value))
    if defaults:
        logger.info("default sampling parameters from %s: %s", path,
                    ", ".join(f"{k}={v}" for k, v in defaults))
    return tuple(defaults)
