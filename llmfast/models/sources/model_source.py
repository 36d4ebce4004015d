"""`--model` resolution: a `ModelSource` names a local HF-style directory (the default
model and GGUF files are converted into one, once) or a `random:<preset>`, with its
config read and checked. llmfast never downloads from a hub."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmfast.config import ConfigError, ModelConfig
from llmfast.models.families import model_config_from_json
from llmfast.models.loading.load_error import PICKLE_SUFFIXES, LoadError, pickle_refusal
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from llmfast.models.loading.validate import check_hf_config, check_model_size
from llmfast.tokenizer import Tokenizer, load_tokenizer
from llmfast.utils.paths import expand_user
from llmfast.utils.progress import Progress


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model` argument: a local HF-style directory, or a random preset."""

    spec: str
    path: Path | None  # None for random presets
    config: ModelConfig
    # The GGUF file `path` was converted from (its blocks can be kept packed), if any.
    gguf_path: Path | None = None

    @property
    def is_random(self) -> bool:
        return self.path is None

    @property
    def name(self) -> str:
        return self.spec if self.path is None else self.path.name

    def load_tokenizer(self) -> Tokenizer:
        """The directory's tokenizer, or the one a random preset carries (see
        models/sources/preset_tokenizer.py); raises TokenizerError for a weights-only directory."""
        if self.path is None:
            from llmfast.models.sources.preset_tokenizer import preset_tokenizer

            return preset_tokenizer(self.config.vocab_size)
        return load_tokenizer(self.path)


def resolve_model(spec: str | None, progress: Progress | None = None) -> ModelSource:
    """Turn a `--model` argument into a local directory (downloading or converting the
    default model and GGUF files once) and read its config."""
    if spec is None or spec in ("", "default"):
        from llmfast.models.sources.default_model import default_model_gguf, ensure_default_model

        path = ensure_default_model(progress=progress)
        return ModelSource(str(path), path, _read_config(path), default_model_gguf(path))
    if spec.startswith("random:"):
        preset = spec.removeprefix("random:")
        if preset not in RANDOM_PRESETS:
            raise LoadError(
                f"unknown random preset {preset!r}; choose one of {', '.join(RANDOM_PRESETS)}"
            )
        check_model_size(RANDOM_PRESETS[preset])
        return ModelSource(spec, None, RANDOM_PRESETS[preset])
    path = expand_user(spec, "model path")
    if not path.exists():
        hint = (
            " (llmfast never downloads from a hub: pass a local directory or .gguf file)"
            if spec.count("/") == 1 and not spec.startswith((".", "/"))
            else ""
        )
        raise LoadError(f"model path {spec} does not exist{hint}")
    if path.is_file():
        if path.suffix == ".gguf":
            from llmfast.models.sources.default_model import convert_gguf_cached

            converted = convert_gguf_cached(path, progress=progress)
            return ModelSource(spec, converted, _read_config(converted), path)
        if path.suffix in PICKLE_SUFFIXES:
            raise pickle_refusal(path)
        raise LoadError(f"{path} is not a model directory or a .gguf file")
    return ModelSource(spec, path, _read_config(path))


def _read_config(model_dir: Path) -> ModelConfig:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise LoadError(f"{model_dir} has no config.json; it is not an HF model directory")
    try:
        config = model_config_from_json(config_path)
        check_hf_config(json.loads(config_path.read_text()))
        check_model_size(config)  # before anything is built from it
    except ConfigError as e:
        raise LoadError(f"{model_dir}: {e}") from None
    return config
