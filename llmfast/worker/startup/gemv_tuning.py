"""`--gemv auto` on a GPU model without a shipped table entry: at start-up, before any
CUDA graph is captured, time cuBLAS against a few Triton configurations
(launch_config.startup_candidates) for each of the model's projection shapes and each M
bucket its decode steps run, keep the faster per (shape, bucket), and remember it on disk
so that later starts time nothing.

The file: `<cache dir>/gemv/<gpu slug>-<digest>.json`, the digest over the GPU's name,
the torch and Triton versions and the GEMV's own sources (a new kernel times afresh),
holding per shape key and bucket the winner and every candidate's µs, in the shipped
tables' format (launch_config.table_json): copied to `tables/<gpu slug>.json` it ships.

The timing is injectable (`Measure`): CPU tests drive the choice with a fake timer; the
default (`time_on_cuda`) replays the launches from a CUDA graph, as the engine runs them.
Nothing here decides which layers take the op: worker/startup/gemv_routing.py does, from what
this returns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from llmfast.attention.tuning.prefill_measure import median_device_us_interleaved
from llmfast.cuda_graphs.capture_context import CaptureStream
from llmfast.cuda_graphs.capturers import CudaGraphCapturer
from llmfast.kernels.gemv import launch_config
from llmfast.kernels.gemv import ops as ops_module
from llmfast.kernels.gemv.launch_config import GemvConfig
from llmfast.kernels.gemv.ops import (
    fusion_name,
    gemv_triton,
    out_features,
    skinny_linear_torch,
    weight_key,
)
from llmfast.kernels.launch.device_tables import device_slug
from llmfast.kernels.launch.precompile import KernelPrecompiler, kernel_precompile_enabled
from llmfast.utils.paths import cache_dir
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)

_SOURCES = ("triton_kernels.py", "ops.py")  # what a timing measured: the kernel, its launch
_SOURCE_DIR = Path(ops_module.__file__).parent  # llmfast/kernels/gemv/
TIMING_REPS = 5
# A Triton result further than this from the torch form's (relative to its largest
# value) is garbage (wrong tiles, NaN), not rounding: the candidate is dropped. The
# kernels' exactness is tested elsewhere (tests/test_gemv_kernels.py, test_gemv_gpu.py);
# fp8 is loose because the torch form quantizes the rows too.
SANITY_TOLERANCE = 0.1


@dataclass(frozen=True, eq=False)
class Launch:
    """One projection launch: a layer's weight [N (2N with silu_mul), K] and what is
    fused around it; `dtype`: the rows' (the model's)."""

    weight: torch.Tensor
    dtype: torch.dtype
    weight_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    silu_mul: bool = False
    residual: bool = False
    mm_out_dtype: torch.dtype | None = None

    @property
    def n(self) -> int:
        return out_features(self.weight, self.silu_mul)

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    @property
    def fp8(self) -> bool:
        return self.weight.dtype == torch.float8_e4m3fn

    @property
    def key(self) -> str:
        """The launch table's key: "n3072-k2048-bfloat16-norm" for a fused qkv."""
        return weight_key(self.weight, self.n, fusion_name(
            self.norm_weight is not None, self.silu_mul, self.residual))


# µs per launch of `launches` (the layers of one shape, in turn) at `rows` rows by the
# Triton GEMV with this config, or by the torch form (cuBLAS) for None.
Measure = Callable[[list[Launch], int, GemvConfig | None], float]
# Per shape key, per M bucket: the winner (None: cuBLAS) and every candidate's µs.
Measured = dict[str, dict[int, tuple[GemvConfig | None, dict[str, float]]]]


def candidate_name(config: GemvConfig | None) -> str:
    if config is None:
        return "cublas"
    return (f"n{config.block_n}-k{config.block_k}-s{config.split_k}-w{config.num_warps}"
            + ("-dot" if config.dot else ""))


def pick_winner(launches: list[Launch], rows: int, num_sms: int, measure: Measure
                ) -> tuple[GemvConfig | None, dict[str, float]]:
    """(the fastest of cuBLAS and the Triton candidates, µs of each) at `rows` rows.
    A candidate that fails (out of resources, a wrong result) is left out; cuBLAS
    failing raises (nothing to compare against)."""
    first = launches[0]
    timings = {"cublas": float(measure(launches, rows, None))}
    best, best_us = None, timings["cublas"]
    for config in launch_config.startup_candidates(rows, first.n, first.k, num_sms, first.fp8):
        try:
            us = float(measure(launches, rows, config))
        except Exception as exc:  # noqa: BLE001 - Triton's OutOfResources, compile errors
            logger.info("GEMV candidate %s for %s at %d rows failed: %s",
                        candidate_name(config), first.key, rows, exc)
            continue
        timings[candidate_name(config)] = us
        if us < best_us:
            best, best_us = config, us
    return best, timings


def measure_missing(groups: dict[str, list[Launch]], buckets: Iterable[int],
                    device_name: str, num_sms: int, measure: Measure,
                    directory: Path | None = None, progress: Progress | None = None,
                    compile_ahead: bool = False) -> dict[str, dict[int, GemvConfig | None]]:
    """The launch table of `groups` (shape key -> its launches) at `buckets`: what this
    GPU's file (in `directory`, default `<cache dir>/gemv`) holds, and what it lacked,
    measured now and added to it. Raises what measuring raises (the caller then keeps
    cuBLAS). `compile_ahead`: the candidates to time compiled in threads first
    (`compile_candidates`; what `time_on_cuda` launches)."""
    fields = cache_fields(device_name)
    path = cache_path(fields, directory)
    raw = read_cache(path, fields)
    todo = [(key, b) for key in groups for b in sorted(set(buckets))
            if str(b) not in raw.get(key, {})]
    if todo:
        if progress:
            progress(f"timing the GEMV against cuBLAS: {len(todo)} shape and batch pairs "
                     "(once per GPU model)", None)
        if compile_ahead:
            compile_candidates(groups, todo, num_sms)
        measured: Measured = {}
        for key, bucket in todo:
            measured.setdefault(key, {})[bucket] = pick_winner(groups[key], bucket, num_sms,
                                                               measure)
            winner, timings = measured[key][bucket]
            logger.info("GEMV %s at %d rows: %s (%s)", key, bucket, candidate_name(winner),
                        ", ".join(f"{k} {v:.1f} us" for k, v in timings.items()))
        new = launch_config.table_json(device_name, measured)["shapes"]
        for key, rows in new.items():
            raw.setdefault(key, {}).update(rows)
        try:
            write_cache(path, fields, raw)
        except OSError as exc:  # a read-only cache dir: measured for this process only
            logger.warning("could not save the GEMV timings to %s: %s", path, exc)
    table = launch_config.parse_table({"format": launch_config.FORMAT_VERSION,
                                       "shapes": raw})
    return {key: table[key] for key in groups if key in table}


def compile_candidates(groups: dict[str, list[Launch]], todo: Sequence[tuple[str, int]],
                       num_sms: int) -> int | None:
    """Compile the Triton variants that timing `todo` ((shape key, bucket) pairs) will
    launch, in threads, all at once (kernels/launch/precompile.py's dry launches): the
    timing would otherwise compile them one after another at their first launches, each
    about a second (Llama-3.2-1B's five shapes at five buckets, four candidates each:
    37 variants, 84 with --gemv-fuse; the split counts of a tile share one, and Triton
    dedups the rest across shapes: scripts/bench_gemv.py --compile-cost counts them). Returns
    how many were submitted, or None (a Triton without asynchronous compiles,
    LLMFAST_KERNEL_PRECOMPILE=0 as for the runner's precompile, or a failure: logged;
    the launches then compile what they need, as without this)."""
    if not kernel_precompile_enabled():
        return None
    precompiler = KernelPrecompiler()
    if not precompiler.available:
        return None
    try:
        with precompiler.dry_launches():
            for key, bucket in todo:
                first = groups[key][0]
                x, residual = _rows(first, bucket, torch.empty)
                for config in launch_config.startup_candidates(bucket, first.n, first.k,
                                                               num_sms, first.fp8):
                    _launch(first, x, residual, config)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the launches compile
        logger.warning("compiling the GEMV candidates ahead of their timing failed "
                       "(%s: %s); each compiles at its first launch",
                       type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        return None
    finally:
        precompiler.wait()
    logger.info("compiled %d GEMV variants in threads for the timing",
                precompiler.num_submitted)
    return precompiler.num_submitted


def _rows(first: Launch, rows: int, make: Callable[..., torch.Tensor] = torch.randn
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A launch's inputs at `rows` rows: x [M, K], and the residual [M, N] where one is
    added; `make` (randn, or empty for a dry launch) draws them in float32."""
    device = first.weight.device
    gen = {"generator": torch.Generator(device=device).manual_seed(rows)} \
        if make is torch.randn else {}
    x = make(rows, first.k, device=device, **gen).to(first.dtype)  # [M, K]
    residual = (make(rows, first.n, device=device, **gen).to(first.dtype)
                if first.residual else None)  # [M, N]
    return x, residual


def _launch(launch: Launch, x: torch.Tensor, residual: torch.Tensor | None,
            gemv: GemvConfig | None) -> torch.Tensor:
    """`launch` on the rows x: by the Triton GEMV with config `gemv`, or the torch form
    (cuBLAS) for None."""
    if gemv is None:
        return skinny_linear_torch(x, launch.weight, launch.weight_scale, launch.bias,
                                   launch.norm_weight, residual, launch.eps,
                                   launch.silu_mul, launch.mm_out_dtype)
    return gemv_triton(x, launch.weight, gemv, launch.weight_scale, launch.bias,
                       launch.norm_weight, residual, launch.eps, launch.silu_mul)


# ------------------------------------------------------------------ the file


def cache_fields(device_name: str) -> dict[str, str | int]:
    """What the timings depend on besides the shape: the GPU model, torch (cuBLAS),
    Triton (its compiler) and the GEMV's sources."""
    import triton

    source = hashlib.sha256()
    for name in _SOURCES:
        source.update((_SOURCE_DIR / name).read_bytes())
    return {"format": launch_config.FORMAT_VERSION, "device": device_name,
            "torch": torch.__version__, "triton": triton.__version__,
            "kernels": source.hexdigest()[:16]}


def cache_path(fields: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return (directory or cache_dir() / "gemv") / f"{device_slug(fields['device'])}-{digest}.json"


def read_cache(path: Path, fields: dict) -> dict[str, dict[str, dict]]:
    """The file's shapes as stored ({key: {bucket: row}}); {} when it is missing, made
    under other `fields`, or unreadable (logged: it is measured again, and rewritten)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("key") != fields:
            return {}
        launch_config.parse_table(data)  # every row valid, or none is used
        return data["shapes"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.warning("ignoring the GEMV timings in %s (%s: %s)", path,
                       type(exc).__name__, exc)
        return {}


def write_cache(path: Path, fields: dict, shapes: dict[str, dict[str, dict]]) -> None:
    """The whole file, atomically (another start may read it meanwhile)."""
    data = {"format": launch_config.FORMAT_VERSION, "device": fields["device"],
            "key": fields, "shapes": shapes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------ timing on the GPU


def time_on_cuda(launches: list[Launch], rows: int, config: GemvConfig | None,
                 reps: int = TIMING_REPS) -> float:
    """µs per launch: every launch of `launches` in turn (the model's layers of one
    shape: their weights stream from HBM as in a decode step), captured in one CUDA
    graph whose replays CUDA events time after an L2 flush; the median of `reps`."""
    first = launches[0]
    device = first.weight.device
    x, residual = _rows(first, rows)

    def run(launch: Launch, gemv: GemvConfig | None) -> torch.Tensor:
        return _launch(launch, x, residual, gemv)

    if config is not None:  # (the first call also compiles the variant)
        got, want = run(first, config).float(), run(first, None).float()
        scale = want.abs().max().item() or 1.0
        error = (got - want).abs().max().item() / scale
        if not error <= SANITY_TOLERANCE:
            raise ValueError(f"off by {error:.2g} of the output's scale")

    def step() -> None:
        for launch in launches:
            run(launch, config)

    # Captured as the runner captures (cuda_graphs/capturers.py), not by
    # `torch.cuda.graph`: only this thread's CUDA calls are checked (the engine loads its
    # tokenizer in another meanwhile; a global capture fails on its calls), and no
    # synchronize + empty_cache() per capture (a cold 1B start makes ~125). On one side
    # stream, warmed up first, so cuBLAS makes its per-stream workspace once, outside
    # any capture.
    with _capture_stream(device).current():
        step()
        replay, _ = CudaGraphCapturer(device).capture(step, ())
    torch.cuda.synchronize(device)
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size,
                        dtype=torch.uint8, device=device)
    (replay_us,) = median_device_us_interleaved([replay], reps, warmup=0, before=flush.zero_)
    return replay_us / len(launches)


@functools.cache
def _capture_stream(device: torch.device) -> CaptureStream:
    """The side stream of every timing capture on `device` (one: cuBLAS keeps a
    workspace per stream)."""
    return CaptureStream(device)
