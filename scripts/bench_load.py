"""Weight loading, measured: random init before/after, and a safetensors load against the
disk's read speed of the same file, in one run.

    python scripts/bench_load.py --preset llama-3.2-1b --dtype bfloat16 --device cpu
    python scripts/bench_load.py --preset llama-3.2-1b --dtype bfloat16 --device cuda --json x.json

0. The process's first-use costs, timed apart and kept out of every later figure: the
   device's first tensor (on CUDA: the context, ~0.5-2 s) and a first `build_model` of
   the tiny preset on the device (the loader's imports, first kernel loads, the
   meta-device check model's first construction). A server pays them once per process,
   whatever it loads; `random_init_new_s` is the init proper.
1. Random init: the former way (a CPU float32 `randn` per parameter, copied into the
   device parameter) against `build_model` now (filled in place on the device).
2. A checkpoint of the same shapes (HF names, the target dtype) is written to --dir; then,
   with the file evicted from the page cache before each (posix_fadvise DONTNEED: "cold"),
   and again with it cached ("warm"): reading the files through one reused buffer (the
   disk's speed for these files), reading them into newly allocated memory (what any
   load must do at least: each new page is faulted in), and `build_model` from the
   directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmfast.bench.hf import hf_state_dict_from_llmfast
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.families import hf_dict_from_model_config
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.weight_bytes import weight_bytes

READ_CHUNK = 64 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def old_random_init(source, dtype, device, max_positions: int, seed: int) -> float:
    """The former path: build, then fill each parameter from a CPU float32 generator."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = DecoderForCausalLM(source.config, max_positions=max_positions)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    sync(device)
    elapsed = time.perf_counter() - t0
    del model
    return elapsed


def first_use_costs(dtype, device: torch.device, max_positions: int) -> dict[str, float]:
    """Seconds of the process's one-time costs, each timed on its own: the first tensor
    on `device` (CUDA: context creation) and a first `build_model` of the tiny preset
    there (imports, first kernel loads, the first meta-device construction)."""
    t0 = time.perf_counter()
    torch.empty(1, device=device)
    sync(device)
    t1 = time.perf_counter()
    model = build_model(resolve_model("random:tiny"), dtype, device,
                        max_positions=min(max_positions, 64))
    sync(device)
    t2 = time.perf_counter()
    del model
    return {"first_use_device_s": t1 - t0, "first_use_build_s": t2 - t1,
            "first_use_s": t2 - t0}


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def evict(files: list[Path]) -> None:
    """Out of the page cache: posix_fadvise per file, and as root (the GPU machine) the
    kernel's whole page cache too, where fadvise alone may not reach (a VM's disk)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.geteuid() == 0:
        try:
            DROP_CACHES.write_text("1\n")
        except OSError:  # a container without that right: fadvise alone
            pass


def filesystem_of(path: Path) -> str:
    """The type of the mount holding `path` (e.g. ext4, xfs, tmpfs), from /proc/mounts."""
    path, best, kind = path.resolve(), -1, "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and path.is_relative_to(fields[1]) and len(fields[1]) > best:
            best, kind = len(fields[1]), fields[2]
    return kind


def read_files(files: list[Path]) -> float:
    """Seconds to read every byte of `files` into one reused buffer."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def read_files_fresh(files: list[Path]) -> float:
    """Seconds to read `files` into newly allocated memory, as a load must (the kernel
    faults each new page in: on some VMs that costs as much as the read itself)."""
    t0 = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            buf = torch.empty(file.stat().st_size, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    break
                done += n
            del view, buf
    return time.perf_counter() - t0


def timed_load(path: Path, dtype, device, max_positions: int) -> float:
    source = resolve_model(str(path))
    t0 = time.perf_counter()
    model = build_model(source, dtype, device, max_positions=max_positions)
    sync(device)
    elapsed = time.perf_counter() - t0
    del model
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-positions", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None,
                    help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--skip-old", action="store_true", help="skip the former random init")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    source = resolve_model(f"random:{args.preset}")
    result: dict = {"preset": args.preset, "dtype": args.dtype, "device": str(device),
                    "torch": torch.__version__, "platform": platform.platform(),
                    "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    # 0. What any first use in a fresh process costs, apart from the init proper.
    result.update(first_use_costs(dtype, device, args.max_positions))

    # 1. Random init, former and current, same process.
    if not args.skip_old:
        result["random_init_old_s"] = old_random_init(source, dtype, device,
                                                      args.max_positions, seed=0)
    t0 = time.perf_counter()
    model = build_model(source, dtype, device, max_positions=args.max_positions)
    sync(device)
    result["random_init_new_s"] = time.perf_counter() - t0
    result["weight_bytes"] = weight_bytes(model)

    # 2. A checkpoint of the same weights, unfused HF names, in the target dtype.
    tmp = args.dir or Path(tempfile.mkdtemp(prefix="llmfast_load_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        state = {k: v.detach().to("cpu").contiguous()
                 for k, v in hf_state_dict_from_llmfast(model, source.config).items()}
        if source.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        del model
        file = tmp / "model.safetensors"
        save_file(state, file, metadata={"format": "pt"})
        del state
        (tmp / "config.json").write_text(json.dumps(hf_dict_from_model_config(source.config)))
        files = [file]
        result["file_bytes"] = sum(f.stat().st_size for f in files)
        result["filesystem"] = filesystem_of(tmp)
        for cache in ("cold", "warm"):
            reads, fresh_reads, loads = [], [], []
            for _ in range(args.repeats):
                if cache == "cold":
                    evict(files)
                else:
                    read_files(files)
                reads.append(read_files(files) if cache == "warm" else _cold_read(files))
                if cache == "cold":
                    evict(files)
                fresh_reads.append(read_files_fresh(files))
                if cache == "cold":
                    evict(files)
                loads.append(timed_load(tmp, dtype, device, args.max_positions))
            read_s, load_s = statistics.median(reads), statistics.median(loads)
            fresh_s = statistics.median(fresh_reads)
            result[f"{cache}_read_s"] = read_s
            result[f"{cache}_read_fresh_s"] = fresh_s
            result[f"{cache}_load_s"] = load_s
            result[f"{cache}_read_gbps"] = result["file_bytes"] / read_s / 1e9
            result[f"{cache}_read_fresh_gbps"] = result["file_bytes"] / fresh_s / 1e9
            result[f"{cache}_load_gbps"] = result["file_bytes"] / load_s / 1e9
            result[f"{cache}_load_vs_read"] = read_s / load_s
            result[f"{cache}_load_vs_read_fresh"] = fresh_s / load_s
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)

    gb = result["weight_bytes"] / 1e9
    print(f"{args.preset} {args.dtype} on {device}: {gb:.2f} GB of weights")
    print(f"process first-use costs (not in the figures below): first tensor on {device} "
          f"{result['first_use_device_s']:.2f} s, first build_model (tiny preset) "
          f"{result['first_use_build_s']:.2f} s")
    if "random_init_old_s" in result:
        print(f"random init: before {result['random_init_old_s']:.2f} s, "
              f"now {result['random_init_new_s']:.2f} s "
              f"({result['random_init_old_s'] / result['random_init_new_s']:.1f}x)")
    else:
        print(f"random init: now {result['random_init_new_s']:.2f} s")
    print(f"checkpoint on {result['filesystem']}")
    # A "cold" read as fast as a warm one came from memory: tmpfs, or a cache the
    # eviction did not reach. Then the disk's speed was not measured.
    if result["cold_read_gbps"] >= 0.8 * result["warm_read_gbps"]:
        result["cold_note"] = ("cold reads ran at >= 0.8x the warm ones: served from memory "
                               f"({result['filesystem']}), not the disk")
        print(f"note: {result['cold_note']}")
    for cache in ("cold", "warm"):
        r = {k.removeprefix(f"{cache}_"): v for k, v in result.items() if k.startswith(cache)}
        print(f"safetensors, {cache} page cache (median of {args.repeats}): "
              f"read {r['read_s']:.2f} s ({r['read_gbps']:.2f} GB/s), read into new memory "
              f"{r['read_fresh_s']:.2f} s ({r['read_fresh_gbps']:.2f} GB/s), load "
              f"{r['load_s']:.2f} s ({r['load_gbps']:.2f} GB/s) = "
              f"{100 * r['load_vs_read']:.0f}% / {100 * r['load_vs_read_fresh']:.0f}% of them")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _cold_read(files: list[Path]) -> float:
    evict(files)
    return read_files(files)


if __name__ == "__main__":
    main()
