"""Which projections of a loaded model call the skinny-linear op (kernels/gemv/), decided
once at start-up from `--gemv` and `--gemv-fuse` (config.SkinnyLinearConfig), before
anything is traced or captured: each `Linear` / `Fp8Linear` gets its `gemv_backend`,
the decoder its `gemv_fused` (plain str attributes: constants to torch.compile, and part
of a saved trace's fingerprint, compile/graph_inputs.py).

- cublas, or no GPU: nothing changes (the CPU's own paths); only the fused layers run
  under Triton's interpreter when asked (how the CPU tests them);
- triton: every projection takes the op (the GEMV up to 16 rows, cuBLAS past them);
- auto: a projection takes the op where the launch table (the shipped one, else the
  start-up's measurement: worker/startup/gemv_tuning.py) has the GEMV win at some
  decode size; elsewhere it keeps its plain `F.linear`. A measurement that fails is
  logged and leaves cuBLAS: it never stops a start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmfast.config import CompileConfig, SkinnyLinearConfig
from llmfast.kernels.cpu.linear import Linear
from llmfast.kernels.gemv import launch_config, ops
from llmfast.worker.startup import gemv_tuning
from llmfast.kernels.gemv.launch_config import MAX_GEMV_ROWS, m_bucket
from llmfast.worker.startup.gemv_tuning import Launch, Measure
from llmfast.kernels.triton_mode import triton_interpret_enabled
from llmfast.models.fused_layer import RESIDUAL_KINDS, fused_projections, projection_weights
from llmfast.models.quantization.fp8 import Fp8Linear
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuFacts:
    """What routing reads of the GPU: its name (the tables'), SMs (the heuristic's), and
    whether Triton converts float8_e4m3fn there (sm_89 on)."""

    name: str
    num_sms: int
    converts_fp8: bool

    @staticmethod
    def of(device: torch.device) -> GpuFacts:
        index = ops.cuda_index(device)
        return GpuFacts(*ops.cuda_device(index), ops.converts_fp8(index))


@dataclass(frozen=True)
class GemvRouting:
    routed: int  # projections whose launches take the op
    fused: bool  # the decoder layers' fused form
    measured: tuple[str, ...]  # shape keys the start-up timed or read from its file
    seconds: float  # spent timing


# Every row count the GEMV takes: a step without full graphs may have any of them, and so
# may a draft model's forwards (--speculative-method draft: eager, as many rows as
# requests draft or catch up).
EVERY_GEMV_ROWS = tuple(range(1, MAX_GEMV_ROWS + 1))


def decode_rows(compile_config: CompileConfig) -> tuple[int, ...]:
    """The token counts of the decode steps the GEMV can take: the full CUDA graphs'
    sizes up to 16 where they run (a step pads to one), else every count up to 16."""
    if compile_config.use_cuda_graphs and compile_config.cuda_graph_mode.has_full:
        return tuple(s for s in compile_config.cuda_graph_sizes if s <= MAX_GEMV_ROWS)
    return EVERY_GEMV_ROWS


def m_buckets(rows: Sequence[int]) -> list[int]:
    """The M buckets (launch_config.m_bucket) of the row counts the GEMV takes."""
    return sorted({m_bucket(r) for r in rows if r <= MAX_GEMV_ROWS})


def route_gemv(model: nn.Module, settings: SkinnyLinearConfig, rows: Sequence[int],
               progress: Progress | None = None, measure: Measure | None = None,
               cache: Path | None = None, gpu: GpuFacts | None = None) -> GemvRouting:
    """Set the routing of `model` (a DecoderForCausalLM) for decode steps of `rows` token
    rows; under auto on CUDA, time first what no table knows (`measure`: the timer,
    default `gemv_tuning.time_on_cuda`; `cache`: the directory of the timings' files,
    default `<cache dir>/gemv`). `gpu`: the GPU's facts, read from the model's device
    when None (a CPU test passes them, and a fake `measure`, to route as on a GPU)."""
    decoder = model.model
    # (The embedding's: a packed GGUF lm_head, Int4Linear, has no `weight`.)
    device = decoder.embed_tokens.weight.device
    for module in model.modules():  # (as loaded: a second routing starts afresh)
        if isinstance(module, (Linear, Fp8Linear)):
            module.gemv_backend = ""
    on_triton = device.type == "cuda" or gpu is not None or triton_interpret_enabled()
    fused = (settings.fused_layers and settings.backend != "cublas" and decoder.fusable
             and on_triton)
    if settings.fused_layers and not fused and on_triton:
        logger.info("--gemv-fuse: this model's layers have no fused form; plain layers")
    decoder.gemv_fused = settings.backend if fused else ""
    if settings.backend == "cublas" or (gpu is None and device.type != "cuda"):
        return GemvRouting(0, fused, (), 0.0)
    gpu = gpu or GpuFacts.of(device)
    launches = model_launches(model, fused)
    measured, seconds = (), 0.0
    if settings.backend == "auto":
        t0 = time.perf_counter()
        # The real timer's candidates compile in threads first (a fake one launches none).
        measured = _measure([launch for _, launch in launches], rows, gpu,
                            measure or gemv_tuning.time_on_cuda, cache, progress,
                            compile_ahead=measure is None)
        seconds = time.perf_counter() - t0
    routed = 0
    for layer, launch in launches:
        if layer is None or (launch.fp8 and not gpu.converts_fp8):
            continue  # (a fused launch: the decoder's; an fp8 weight Triton cannot read)
        if settings.backend == "triton" or launch_config.takes_triton(gpu.name, launch.key):
            layer.gemv_backend = settings.backend
            routed += 1
    logger.info("GEMV (--gemv %s%s): %d projections take the op%s", settings.backend,
                ", fused layers" if fused else "", routed,
                f"; {len(measured)} shapes timed or read in {seconds:.1f} s" if measured
                else "")
    return GemvRouting(routed, fused, measured, seconds)


def model_launches(model: nn.Module, fused: bool) -> list[tuple[nn.Module | None, Launch]]:
    """(layer, launch) of every projection the forward calls: the `Linear` and
    `Fp8Linear` layers, except with `fused` the decoder layers' four, which become the
    fused launches (layer None: the decoder routes them)."""
    dtype = model.model.embed_tokens.weight.dtype  # the rows'
    inside: set[int] = set()
    out: list[tuple[nn.Module | None, Launch]] = []
    if fused:
        for decoder_layer in model.model.layers:
            for kind, (proj, fusions) in fused_projections(decoder_layer).items():
                inside.add(id(proj))
                out.append((None, Launch(dtype=dtype, residual=kind in RESIDUAL_KINDS,
                                         **fusions, **projection_weights(proj))))
    for module in model.modules():
        if isinstance(module, (Linear, Fp8Linear)) and id(module) not in inside:
            out.append((module, Launch(dtype=dtype, **projection_weights(module))))
    return out


def _measure(launches: list[Launch], rows: Sequence[int], gpu: GpuFacts, measure: Measure,
             cache: Path | None, progress: Progress | None,
             compile_ahead: bool = False) -> tuple[str, ...]:
    """Time the shapes no shipped table names (gemv_tuning.py) and add the winners to
    this GPU's launch table; the keys timed or read. Any error: logged, nothing added."""
    shipped = launch_config.shipped_table(gpu.name)
    groups: dict[str, list[Launch]] = {}
    for launch in launches:
        if launch.key not in shipped and not (launch.fp8 and not gpu.converts_fp8):
            groups.setdefault(launch.key, []).append(launch)
    buckets = m_buckets(rows)
    if not groups or not buckets:
        return ()
    try:
        table = gemv_tuning.measure_missing(groups, buckets, gpu.name, gpu.num_sms,
                                               measure, cache, progress, compile_ahead)
    except Exception as exc:  # noqa: BLE001 - an optimisation: cuBLAS serves meanwhile
        logger.warning("timing the GEMV against cuBLAS failed (%s: %s); the projections "
                       "keep cuBLAS", type(exc).__name__, exc,
                       exc_info=logger.isEnabledFor(logging.DEBUG))
        return ()
    finally:
        torch.cuda.empty_cache()  # the timing graphs' pools, before memory is profiled
    launch_config.add_measured(gpu.name, table)
    ops.forget_choices()
    return tuple(table)


def dry_gemv_launches(model: nn.Module, rows: Sequence[int]) -> int:
    """Launch every routed projection of `model` once per M bucket of `rows`, on empty
    rows of M = the bucket (what the full graphs launch): inside the start-up's dry
    launches (worker/startup/kernel_precompile.py) each GEMV the launch table chose
    submits its variant's compile, so those of the buckets the dry forwards do not run
    (4, 8, 16; the lm_head's, outside the forward) compile in threads rather than one
    after another at the captures' warm-up (a cuBLAS choice just runs, on empty rows).
    Returns how many launches were made."""
    decoder = model.model
    buckets = m_buckets(rows)
    fused = bool(getattr(decoder, "gemv_fused", ""))
    seen: set[str] = set()
    count = 0
    for layer, launch in model_launches(model, fused):
        backend = decoder.gemv_fused if layer is None else layer.gemv_backend
        if not backend or launch.key in seen:
            continue
        seen.add(launch.key)
        for m in buckets:
            x, residual = gemv_tuning._rows(launch, m, torch.empty)  # [M, K], [M, N]?
            ops.skinny_linear(x, launch.weight, launch.weight_scale, launch.bias,
                              launch.norm_weight, residual, launch.eps, launch.silu_mul,
                              launch.mm_out_dtype, backend)
            count += 1
    return count
