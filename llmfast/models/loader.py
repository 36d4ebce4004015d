"""Model loading: HF safetensors directories (single or sharded), GGUF files (converted
once to such a directory), `random:<preset>` dummy weights, and the default model.

Weights go straight into the fused parameters in the target dtype; no transformers
model is built. Pickle checkpoints are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from llmfast.config import ConfigError, ModelConfig, RopeScaling
from llmfast.distributed import TensorParallelGroup
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.families import family_config, model_config_from_json
from llmfast.models.formats.safetensors_reader import (
    SafetensorsFile,
    SafetensorsFormatError,
    TensorEntry,
    TensorReader,
)
from llmfast.models.load_progress import ByteProgress
from llmfast.models.loader_target import target
from llmfast.models.random_weights import init_random_weights
from llmfast.models.sharding import ShardSlice, checkpoint_slice
from llmfast.models.validate import (
    check_checkpoint,
    check_hf_config,
    check_model_size,
    check_weights_fit,
    is_ignorable,
    safetensors_shapes,
)
from llmfast.tokenizer import Tokenizer, load_tokenizer
from llmfast.utils.host_memory import available_host_memory
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class LoadError(ValueError):
    """A model that cannot be loaded; the message is one user-facing line."""


def _llama3(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor, 1.0, 4.0, 8192)


RANDOM_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=4096,
        eos_token_ids=(2,), bos_token_id=1,
    ),
    "smollm2-135m": ModelConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(32.0), tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-3b": ModelConfig(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(32.0), tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(8.0), max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen2.5-0.5b": family_config(
        "Qwen2ForCausalLM",
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        head_dim=64, intermediate_size=4864, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "qwen3-0.6b": family_config(
        "Qwen3ForCausalLM",
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "qwen3-8b": family_config(
        "Qwen3ForCausalLM",
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # Mistral-7B v0.3's shapes: no sliding window since v0.2, 32768 tokens.
    "mistral-7b": family_config(
        "MistralForCausalLM",
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32768, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model` argument: a local HF-style directory, or a random preset."""

    spec: str
    path: Path | None  # None for random presets
    config: ModelConfig

    @property
    def is_random(self) -> bool:
        return self.path is None

    @property
    def name(self) -> str:
        return self.spec if self.path is None else self.path.name

    def load_tokenizer(self) -> Tokenizer:
        """The directory's tokenizer, or the one a random preset carries (see
        models/preset_tokenizer.py); raises TokenizerError for a weights-only directory."""
        if self.path is None:
            from llmfast.models.preset_tokenizer import preset_tokenizer

            return preset_tokenizer(self.config.vocab_size)
        return load_tokenizer(self.path)


def resolve_model(spec: str | None, progress: Progress | None = None) -> ModelSource:
    """Turn a `--model` argument into a local directory (downloading or converting the
    default model and GGUF files once) and read its config."""
    if spec is None or spec in ("", "default"):
        from llmfast.models.default_model import ensure_default_model

        path = ensure_default_model(progress=progress)
        return ModelSource(str(path), path, _read_config(path))
    if spec.startswith("random:"):
        preset = spec.removeprefix("random:")
        if preset not in RANDOM_PRESETS:
            raise LoadError(
                f"unknown random preset {preset!r}; choose one of {', '.join(RANDOM_PRESETS)}"
            )
        check_model_size(RANDOM_PRESETS[preset])
        return ModelSource(spec, None, RANDOM_PRESETS[preset])
    path = Path(spec).expanduser()
    if not path.exists():
        hint = (
            " (llmfast never downloads from a hub: pass a local directory or .gguf file)"
            if spec.count("/") == 1 and not spec.startswith((".", "/"))
            else ""
        )
        raise LoadError(f"model path {spec} does not exist{hint}")
    if path.is_file():
        if path.suffix == ".gguf":
            from llmfast.models.default_model import convert_gguf_cached

            converted = convert_gguf_cached(path, progress=progress)
            return ModelSource(spec, converted, _read_config(converted))
        if path.suffix in PICKLE_SUFFIXES:
            raise _pickle_refusal(path)
        raise LoadError(f"{path} is not a model directory or a .gguf file")
    return ModelSource(spec, path, _read_config(path))


def _pickle_refusal(path: Path) -> LoadError:
    return LoadError(
        f"{path} is a pickle checkpoint, which llmfast refuses to load (it can run code); "
        "convert it to safetensors"
    )


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


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LoadError(f"{index} is not a valid safetensors index") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{model_dir}: shards named in the index are missing: {missing[:3]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob(f"*{s}") for s in PICKLE_SUFFIXES):
            raise _pickle_refusal(model_dir)
        raise LoadError(f"{model_dir} has no *.safetensors weights")
    return files


def load_safetensors_weights(
    model: DecoderForCausalLM, model_dir: Path, progress: Progress | None = None
) -> int:
    """Stream every checkpoint tensor into its (possibly fused) parameter, checking that
    each parameter row is written exactly once.

    Each tensor's bytes are read from the file straight into its parameter (CPU) or
    through two pinned chunks onto the device (CUDA), cast there when the checkpoint's
    dtype differs (`safetensors_reader`); no CPU copy of the model exists at any point.
    A tensor-parallel rank reads only its slice of each tensor (models/sharding.py).
    Returns the bytes read from the files.
    """
    params = dict(model.named_parameters())  # a tied head appears once
    all_params = dict(model.named_parameters(remove_duplicate=False))
    rows_written = {id(p): 0 for p in params.values()}
    device = next(model.parameters()).device
    files = [_open_safetensors(f) for f in _safetensors_files(model_dir)]
    meter = ByteProgress("loading weights", sum(f.data_bytes for f in files), progress, device)
    with TensorReader(device) as reader:
        for file in files:
            done_before = meter.done_bytes
            try:
                fd = os.open(file.path, os.O_RDONLY)
            except OSError as e:
                raise LoadError(f"cannot read {file.path}: {e}") from None
            try:
                for name, entry in file.entries.items():
                    found = (None if is_ignorable(name, model.config)
                             else target(model, name, all_params))
                    if found is None:
                        logger.debug("skipping checkpoint tensor %s", name)
                        continue
                    param, rows = found
                    shard = checkpoint_slice(name, model.config, model.tp)
                    rows = _rows_filled(param, rows, shard, rows_written)
                    dest = param.data if rows is None else param.data[rows]
                    if _shard_shape(entry, shard) != tuple(dest.shape):
                        raise LoadError(
                            f"{file.path.name}: {name} has shape {entry.shape}, the config "
                            f"implies {tuple(dest.shape)}"
                        )
                    reader.read(fd, entry, dest, shard)
                    rows_written[id(param)] += dest.shape[0]
                    meter.add(entry.nbytes)
            except SafetensorsFormatError as e:
                raise LoadError(f"{file.path} is corrupt or truncated: {e}") from None
            except OSError as e:
                raise LoadError(f"cannot read {file.path}: {e}") from None
            finally:
                os.close(fd)
            meter.add(file.data_bytes - (meter.done_bytes - done_before))  # skipped ones
    rate = meter.finish()
    logger.info("loaded %.2f GB of weights at %.2f GB/s", meter.done_bytes / 1e9, rate / 1e9)
    missing = [n for n, p in params.items() if rows_written[id(p)] != p.shape[0]]
    if missing:
        raise LoadError(
            f"{model_dir}: checkpoint lacks weights for {len(missing)} parameters, "
            f"e.g. {missing[0]}"
        )
    return reader.bytes_read


def _rows_filled(param: torch.Tensor, rows: slice | None, shard: ShardSlice | None,
                 rows_written: dict[int, int]) -> slice | None:
    """The rows of `param` a (sliced) tensor fills: a vocabulary slice shorter than the
    rank's rows (the last rank's) fills the first ones; the rest are zero padding,
    zeroed and counted as written here."""
    if rows is not None or shard is None or shard.dim != 0 or shard.size == param.shape[0]:
        return rows
    param.data[shard.size:].zero_()
    rows_written[id(param)] += param.shape[0] - shard.size
    return slice(0, shard.size)


def _shard_shape(entry: TensorEntry, shard: ShardSlice | None) -> tuple[int, ...]:
    if shard is None:
        return entry.shape
    shape = list(entry.shape)
    shape[shard.dim] = shard.size
    return tuple(shape)


def _open_safetensors(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile.open(path)
    except SafetensorsFormatError as e:
        raise LoadError(f"{path} is corrupt or truncated: {e}") from None
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e}") from None


@contextlib.contextmanager
def _allocate_as(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """While constructing the model: parameters are allocated on `device` in `dtype`
    (default device and dtype) and left uninitialised (no `reset_parameters`: we
    overwrite every value). So each parameter is allocated exactly once, where and as it
    will live. Buffers with an explicit dtype, such as the float32 RoPE table, keep it.
    (On the meta device, where the config check builds its model, meta kernels written
    in Python run, and the first imports torch._dynamo: 1.5-6 s of "load".)"""
    classes = (torch.nn.Linear, torch.nn.Embedding)
    saved_init = {cls: cls.__dict__["reset_parameters"] for cls in classes}
    saved_dtype = torch.get_default_dtype()
    for cls in classes:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved_dtype)
        for cls, method in saved_init.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _check_before_allocating(model: DecoderForCausalLM, rank_model: DecoderForCausalLM,
                             source: ModelSource, dtype: torch.dtype,
                             device: torch.device) -> None:
    """`model`: the whole model on meta (what the checkpoint holds); `rank_model`: this
    rank's part of it (what must fit), the same object for one rank."""
    where = source.spec if source.path is None else str(source.path)
    try:
        check_weights_fit(rank_model, dtype, device, _available_memory(device))
        if source.path is not None:
            shapes = safetensors_shapes(_safetensors_files(source.path))
            check_checkpoint(model, shapes, lambda name: target(model, name))
    except ConfigError as e:
        raise LoadError(f"{where}: {e}") from None
    except SafetensorError as e:
        raise LoadError(f"{where}: a safetensors file is corrupt or truncated: {e}") from None
    except OSError as e:
        raise LoadError(f"{where}: cannot read the weights: {e}") from None


def _available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_host_memory()
    return None


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    tp: TensorParallelGroup | None = None,
) -> DecoderForCausalLM:
    """Check the checkpoint against the config on a meta-device model, then allocate
    the model directly on `device` in `dtype` (`_allocate_as`: each parameter once,
    uninitialised) and write its weights in place: seeded random values for a preset,
    the checkpoint's for a directory. `tp`: build and load this rank's shard only."""
    device = torch.device(device)
    tp = tp or TensorParallelGroup.single()
    try:
        source.config.check_tensor_parallel(tp.world_size)
    except ConfigError as e:
        raise LoadError(f"{source.spec}: {e}") from None
    with _allocate_as(torch.device("meta"), dtype):
        shapes = DecoderForCausalLM(source.config, max_positions=max_positions)
        rank_shapes = shapes if tp.world_size == 1 else DecoderForCausalLM(
            source.config, max_positions=max_positions, tp=tp)
    _check_before_allocating(shapes, rank_shapes, source, dtype, device)
    del shapes, rank_shapes
    with _allocate_as(device, dtype):
        model = DecoderForCausalLM(source.config, max_positions=max_positions, tp=tp)
    if source.path is None:
        init_random_weights(model, seed, progress)
    else:
        load_safetensors_weights(model, source.path, progress)
    return model.eval().requires_grad_(False)
