"""Engine arguments: one frozen dataclass whose fields are the engine flags of every
`llmfast` command and the keywords of `LLM(...)`, made into an `EngineConfig` in two
steps: `resolve_model(args)` (engine/model_resolution.py) finds, fetches or converts the
model and reads its defaults, the one step that touches disk or network; then
`args.create_engine_config(resolved)` builds the config from the two, reading nothing.

To add an engine flag, add one field with `engine_flag` metadata, e.g.

    async_scheduling: bool = engine_flag(False, "Schedule step N+1 while step N runs.")

and read it in `create_engine_config`. Nothing else changes: every command that builds an
engine gets `--async-scheduling/--no-async-scheduling` in its Engine panel (a bool field
gets an on/off pair; `flags=` names them otherwise; engine/flags.py reads the fields),
`LLM(async_scheduling=True)` works, and `--help` shows the help text with the field's default. A field whose value is not a
plain str/int/float/bool gives `parse=`, a function from the typed text to the value
(e.g. `parse_bytes` for `--kv-cache-memory 2GiB`); `LLM(...)` applies it to strings too.
Values are checked against the field's type (and `minimum=` / `maximum=` for an int) when
EngineArgs is made (engine/arg_checks.py), so `LLM(seed=-1)` fails like `--seed -1`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from llmfast.config import (
    DEFAULT_CUDA_GRAPH_SIZES,
    CacheConfig,
    CompileConfig,
    ConfigError,
    CudaGraphMode,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SkinnyLinearConfig,
    SpeculativeConfig,
    parse_gemv_backend,
    parse_quantization,
    dtype_name,
    parse_cuda_graph_mode,
    parse_dtype,
    parse_kv_cache_dtype,
)
from llmfast.engine.arg_checks import check_engine_args
from llmfast.utils.flag_values import SIZES_HELP, parse_bytes, parse_sizes, read_chat_template

if TYPE_CHECKING:
    import torch

    from llmfast.models.sources.model_source import ModelSource

DEFAULT_MAX_MODEL_LEN = 8192

# Step limits when the user sets none: (max_num_seqs, max_num_batched_tokens) by device.
# CPU: what a 2-core machine gets through in one step without stalling interactive use.
# CUDA: room for a large decode batch *and* its prefill in one budget. On the H100 a
# 2048-token budget forced chunked prefill into the decode steps at batch >= 256
# (7.1 ms vs 6.1 ms per step with a 64k budget, GPU-RESULTS.md); 8192 tokens / 512
# sequences keeps a 1B-8B model's steps large enough to fill the GPU while the profiled
# activation peak stays small (~1 GiB for 8B). To be confirmed by measurement on the
# H100 (2026-11-27: profiles/throughput.md).
DEFAULT_STEP_LIMITS = {"cpu": (256, 2048), "cuda": (512, 8192)}


def default_step_limits(device: torch.device) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device kind, when the user sets none."""
    return DEFAULT_STEP_LIMITS.get(device.type, DEFAULT_STEP_LIMITS["cpu"])


def engine_flag(default: Any, help: str, *, flags: tuple[str, ...] = (),
                parse: Callable[[str], Any] | None = None, minimum: int | None = None,
                maximum: int | None = None) -> Any:
    """A dataclass field that is also an engine flag. `flags`: the option's names
    (default `--field-name`, or `--field-name/--no-field-name` for a bool); `parse`: reads
    the flag's text into the field's value; `minimum` / `maximum`: the int range allowed.
    A help text without `[default: ...]` gets the field's default appended."""
    return field(default=default, metadata={"help": help, "flags": flags, "parse": parse,
                                            "minimum": minimum, "maximum": maximum})


# Drafts per request and step: past 16 a verify step costs like a prefill chunk.
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_NUM_SPECULATIVE_TOKENS = 3

# torch's generators take seeds up to 2**64 - 1; a larger one fails deep in model loading.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class ResolvedModel:
    """What `create_engine_config` needs from outside the arguments: `resolve_model(args)`
    (engine/model_resolution.py) finds it."""

    source: ModelSource  # the local model (or random preset) and its config
    # (SamplingParams field, value) pairs from `--generation-config`: the model's
    # generation_config.json, a named one, or none.
    sampling_defaults: tuple[tuple[str, Any], ...]
    # Host bytes free when the model was resolved: a CPU engine fits max-model-len to the
    # KV cache this leaves room for (worker/startup/kv_cache_sizing.py).
    host_memory_available: int


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = engine_flag(
        None, "A local HF directory (Llama, Mistral, Mixtral, Qwen2/2.5/3, Qwen3-MoE, "
              "Gemma 3), a .gguf file, "
              "random:PRESET (tiny, llama-3.2-1b, qwen3-0.6b, ...) or 'default'.  "
              "[default: SmolLM2-135M-Instruct, fetched once]",
        flags=("--model", "-m"))
    dtype: str = engine_flag(
        "auto", "float32, bfloat16 or float16.  [default: float32 on CPU, bfloat16 on CUDA]")
    device: str = engine_flag("auto", "auto, cpu, cuda or cuda:N.")
    quantization: str | None = engine_flag(
        None, "fp8: quantize the decoder's projections to float8 at load (one scale per "
              "output channel, activations per token at run time; the embedding and "
              "lm_head stay in --dtype), as vLLM's --quantization fp8. gguf: keep a GGUF's "
              "quantized blocks packed (CPU only). none: weights as loaded (a GGUF "
              "dequantized).  [default: gguf for a quantized GGUF on the CPU, else none]",
        parse=parse_quantization)
    seed: int = engine_flag(0, "Seed of the engine's random state (random weights, sampling).",
                            minimum=0, maximum=MAX_SEED)
    max_num_seqs: int | None = engine_flag(
        None, "Most requests in one step.  [default: 256 on CPU, 512 on CUDA]", minimum=1)
    max_num_batched_tokens: int | None = engine_flag(
        None, "Token budget of one step.  [default: 2048 on CPU, 8192 on CUDA]", minimum=1)
    max_model_len: int | None = engine_flag(
        None, "Longest sequence (prompt + output).  [default: the model's, at most 8192]",
        minimum=1)
    chat_template: str | None = engine_flag(
        None, "A Jinja chat template, or a file holding one, to use instead of the model's.",
        parse=read_chat_template)
    generation_config: str = engine_flag(
        "auto", "auto: requests that set no temperature, top_p, top_k, min_p, "
                "repetition_penalty or max tokens get the model's generation_config.json "
                "values (server and Python API, as vLLM); vllm: llmfast's own defaults; or a "
                "directory holding a generation_config.json.")
    block_size: int = engine_flag(16, "Tokens per KV-cache block.", minimum=1)
    kv_cache_memory: int | None = engine_flag(
        None, "KV-cache size, e.g. 512MiB, 2GiB or bytes (on CUDA: per GPU, instead of "
              "--gpu-memory-utilization's share).  [default: from the model size and free "
              "memory]", parse=parse_bytes, minimum=1)
    kv_cache_dtype: str = engine_flag(
        "auto", "auto (the model's --dtype) or fp8 (float8_e4m3fn, scale 1.0; alias "
                "fp8_e4m3): fp8 halves the KV cache's bytes, so twice the blocks fit.",
        parse=parse_kv_cache_dtype)
    gpu_memory_utilization: float = engine_flag(
        0.9, "Fraction of GPU memory llmfast may use, in (0, 1].")
    num_gpu_blocks_override: int | None = engine_flag(
        None, "Exactly this many KV-cache blocks (tests, tight-memory experiments).  "
              "[default: from memory]", minimum=2)
    enable_prefix_caching: bool = engine_flag(
        True, "Reuse the KV blocks of shared prompt prefixes.",
        flags=("--prefix-caching/--no-prefix-caching",))
    enforce_eager: bool = engine_flag(False, "Plain PyTorch: no torch.compile, no CUDA graphs.")
    compile: bool | None = engine_flag(None, "torch.compile the model.  [default: on for CUDA]")
    cuda_graphs: bool = engine_flag(True, "Replay CUDA graphs when compiled (CUDA only).")
    cuda_graph_mode: str | None = engine_flag(
        None, "none, piecewise, full_decode or full_and_piecewise: full graphs of the whole "
              "forward for uniform-decode steps, piecewise graphs for the rest.  [default: "
              "full_and_piecewise on CUDA; graphs are off on CPU and when eager]")
    cuda_graph_sizes: tuple[int, ...] | None = engine_flag(
        None, f"Padded token counts to capture graphs for: {SIZES_HELP}.  [default: 1,2,4, "
              "8..256:8, 256..512:16]",
        parse=functools.partial(parse_sizes, flag="--cuda-graph-sizes"))
    piecewise_graph_sizes: tuple[int, ...] | None = engine_flag(
        None, f"Padded token counts of the piecewise graphs (steps with prefill tokens), "
              f"when they should differ from --cuda-graph-sizes (fewer: a faster start): "
              f"{SIZES_HELP}.  [default: --cuda-graph-sizes]",
        parse=functools.partial(parse_sizes, flag="--piecewise-graph-sizes"))
    gemv: str = engine_flag(
        "auto", "Projections of decode-sized steps (up to 16 token rows) on CUDA: auto (the "
                "Triton GEMV where this GPU's shipped table, or a measurement at start-up "
                "kept in the cache directory, found it faster than cuBLAS), triton (always "
                "the GEMV), cublas (never).", parse=parse_gemv_backend)
    gemv_fuse: bool = engine_flag(
        False, "Llama-shaped decoder layers as four fused GEMV launches for decode-sized "
               "steps (the RMSNorm into QKV, SiLU-and-mul into gate/up, the residual adds "
               "into O and down; CUDA).")
    # One step in flight (the host prepares step N+1 while the device runs step N).
    async_scheduling: bool | None = engine_flag(
        None, "Prepare step N+1 on the host while the device runs step N.  [default: on for "
              "CUDA; off for CPU, where nothing overlaps (profiles/host.md); off with "
              "speculative decoding]")
    speculative_method: str | None = engine_flag(
        None, "Speculative decoding: ngram (drafts looked up in the request's own prompt and "
              "output) or draft (a smaller model of the same tokenizer, "
              "--speculative-model). Each decode step verifies the drafts in one forward; "
              "greedy output is unchanged.  [default: off; draft when --speculative-model "
              "is given]")
    speculative_model: str | None = engine_flag(
        None, "The draft model for --speculative-method draft (what --model takes).")
    num_speculative_tokens: int | None = engine_flag(
        None, "Drafts verified per request and step (K).  [default: 3 with speculation]",
        minimum=1, maximum=MAX_SPECULATIVE_TOKENS)
    ngram_prompt_lookup_min: int | None = engine_flag(
        None, "Shortest suffix the n-gram proposer looks up.  [default: 2]", minimum=1)
    ngram_prompt_lookup_max: int | None = engine_flag(
        None, "Longest suffix the n-gram proposer looks up.  [default: 4]", minimum=1)

    tensor_parallel_size: int = engine_flag(
        1, "Split the model over this many devices (tensor parallelism).", minimum=1,
        flags=("--tensor-parallel-size", "-tp"))
    distributed_executor_backend: str | None = engine_flag(
        None, "uni (one device, this process), mp (one process per rank on this node) or "
              "ray (Ray actors).  [default: uni for one rank, mp for more]")
    ray_address: str | None = engine_flag(
        None, "Address of an existing Ray cluster for the ray backend.  [default: start a "
              "local one]")

    def __post_init__(self) -> None:
        check_engine_args(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`LLM(...)`'s keywords: field names; a string for a field with a parser is read
        as its flag would be (`kv_cache_memory="2GiB"`, `cuda_graph_sizes="1..64"`)."""
        parsers = {f.name: f.metadata["parse"] for f in fields(cls)}
        unknown = sorted(set(kwargs) - set(parsers))
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        for name, value in kwargs.items():
            if isinstance(value, str) and parsers[name] is not None:
                kwargs[name] = parsers[name](value)
        return cls(**kwargs)

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        """The device and model dtype these arguments ask for, "auto" resolved; a
        ConfigError for a pair that cannot run (checked again before a model is fetched)."""
        import torch

        device = resolve_device(self.device)
        dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) \
            if self.dtype == "auto" else parse_dtype(self.dtype)
        if device.type == "cpu" and dtype == torch.float16:
            raise ConfigError("float16 is not supported on CPU; use float32 or bfloat16")
        if device.type == "cuda" and self.block_size not in (16, 32, 64):
            raise ConfigError(f"on CUDA the block size must be 16, 32 or 64; got {self.block_size}")
        return device, dtype

    def create_engine_config(self, resolved: ResolvedModel) -> EngineConfig:
        """The engine's config from these arguments and the model `resolve_model(self)`
        found: reads no file and fetches nothing (the model's config, its sampling
        defaults and the host's free memory come with `resolved`)."""
        from llmfast.worker.startup.kv_cache_sizing import fit_cpu_max_model_len

        device, dtype = self.device_and_dtype()
        source = resolved.source
        # Capped by the model's positions and, for a sliding-window model, its window.
        max_model_len = source.config.resolve_max_model_len(
            self.max_model_len, DEFAULT_MAX_MODEL_LEN
        )
        default_seqs, default_tokens = default_step_limits(device)
        max_num_seqs = default_seqs if self.max_num_seqs is None else self.max_num_seqs
        max_num_batched_tokens = (default_tokens if self.max_num_batched_tokens is None
                                  else self.max_num_batched_tokens)
        use_compile = (device.type == "cuda") if self.compile is None else self.compile
        enforce_eager = self.enforce_eager or not use_compile
        graph_mode = parse_cuda_graph_mode(self.cuda_graph_mode or "full_and_piecewise")
        if not self.cuda_graphs or device.type != "cuda" or enforce_eager:
            graph_mode = CudaGraphMode.NONE
        config = EngineConfig(
            model_path=str(source.path) if source.path else source.spec,
            model=source.config,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_dtype=parse_kv_cache_dtype(self.kv_cache_dtype),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                # Off with speculation: the next step's drafts (and the request's length)
                # depend on how many of this step's drafts were accepted, which only the
                # collected outputs tell (arg_checks.py refuses the explicit pair).
                async_scheduling=(device.type == "cuda" and self.speculative_method is None
                                  and self.speculative_model is None)
                if self.async_scheduling is None else self.async_scheduling,
            ),
            compile=CompileConfig(
                enforce_eager=enforce_eager,
                cuda_graph_mode=graph_mode,
                cuda_graph_sizes=tuple(
                    s for s in (self.cuda_graph_sizes or DEFAULT_CUDA_GRAPH_SIZES)
                    if s <= max_num_batched_tokens
                ),
                piecewise_graph_sizes=None if self.piecewise_graph_sizes is None else tuple(
                    s for s in self.piecewise_graph_sizes if s <= max_num_batched_tokens),
            ),
            device=str(device),
            dtype=dtype_name(dtype),
            seed=self.seed,
            parallel=self.parallel_config(),
            chat_template=self.chat_template,
            sampling_defaults=resolved.sampling_defaults,
            quantization=self.quantization,
            speculative=self.speculative_config(),
            gemv=self.gemv_config(),
        )
        if device.type == "cpu" and self.max_model_len is None:
            # To what the KV cache holds in the memory free when the model was resolved.
            config = fit_cpu_max_model_len(config, available=resolved.host_memory_available)
        return config

    def speculative_config(self) -> SpeculativeConfig | None:
        """Speculative decoding's config, None when off; ConfigError for a combination
        that cannot run (arg_checks.py calls it when the arguments are made)."""
        method = self.speculative_method
        if method is None and self.speculative_model is not None:
            method = "draft"
        if method is None:
            for name in ("num_speculative_tokens", "ngram_prompt_lookup_min",
                         "ngram_prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{name.replace('_', '-')} needs "
                                      "--speculative-method ngram or draft")
            return None
        if method == "draft":
            for name in ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{name.replace('_', '-')} is for "
                                      "--speculative-method ngram")
        if self.async_scheduling:
            raise ConfigError("--async-scheduling does not run with speculative decoding "
                              "yet (the next step depends on how many drafts were "
                              "accepted); drop one of the two")
        if self.tensor_parallel_size > 1:
            raise ConfigError("speculative decoding runs on one device; drop "
                              "--tensor-parallel-size or --speculative-method")
        lookup_max = 4 if self.ngram_prompt_lookup_max is None else self.ngram_prompt_lookup_max
        lookup_min = (min(2, lookup_max) if self.ngram_prompt_lookup_min is None
                      else self.ngram_prompt_lookup_min)
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=(DEFAULT_NUM_SPECULATIVE_TOKENS
                                    if self.num_speculative_tokens is None
                                    else self.num_speculative_tokens),
            draft_model=self.speculative_model,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
        )

    def gemv_config(self) -> SkinnyLinearConfig:
        """--gemv and --gemv-fuse; ConfigError for a bad value or the pair that
        contradicts itself (arg_checks.py calls it when the arguments are made)."""
        return SkinnyLinearConfig(backend=parse_gemv_backend(self.gemv),
                                  fused_layers=self.gemv_fuse)

    def parallel_config(self) -> ParallelConfig:
        """The ranks and their executor; the backend defaults to uni for one rank, mp for
        more. Raises ConfigError for an unknown backend or uni with several ranks."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend
            or ("uni" if self.tensor_parallel_size == 1 else "mp"),
            ray_address=self.ray_address,
        )


_DEVICE_RE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _DEVICE_RE.match(name):
        raise ConfigError(f"unknown device {name!r}; use auto, cpu or cuda[:N]")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name} requested but no CUDA GPU is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name} does not exist ({torch.cuda.device_count()} GPUs)")
    return device
