"""Make this GPU's prefill tile table cover a model, and install it as the shipped one.

    python scripts/ship_prefill_tiles.py --model random:llama-3.2-1b --dtype bfloat16 \
        --copy-to $OUT/prefill_tiles_llama-3.2-1b.json

A first start on a GPU model without a shipped table tunes the model's two prefill shape
classes (kernels/tuning/prefill_tuning.py; ~20-60 s on an H100). The start-up benchmark
should time what a user gets once the table ships, so gpu_check's `startup` step runs
this first: it tunes the model's two classes that no table knows yet (whatever
LLMFAST_ATTENTION_TUNING says: gpu_check turns tuning off for its benchmarks), then
merges the tuned classes into
`llmfast/kernels/tuning/prefill_tables/<gpu>.json` of this working copy, and copies that
file to --copy-to so it can be committed. Without CUDA it says so and does nothing;
with CUDA, a run that leaves nothing to ship exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmfast.attention.triton.launch import (
    model_prefill_classes,
    prefill_tunable,
    tune_prefill_tiles,
)
from llmfast.attention.tuning import prefill_tuning
from llmfast.models.sources.model_source import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--copy-to", help="also write the shipped table here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to tune or ship")
        return
    cfg = resolve_model(args.model).config
    device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if not prefill_tunable(cfg.head_dim, getattr(torch, args.dtype)):
        print(f"{args.model} in {args.dtype}: prefill tiles are not tuned for this shape "
              "(the engine uses its heuristic): nothing to ship")
        return
    classes = model_prefill_classes(cfg.head_dim, group, getattr(torch, args.dtype))
    for cls in classes:  # a class some table already knows is kept, not re-tuned
        if tune_prefill_tiles(device, cls) is None:
            print(f"{cls.key}: no tile candidate ran; the heuristic stays")
    print(f"{args.model}: prefill classes {', '.join(c.key for c in classes)} ready in "
          f"{time.perf_counter() - t0:.1f} s")
    name = torch.cuda.get_device_name(device)
    _, tuned_json = prefill_tuning.read_table(prefill_tuning.tuned_table_path(name))
    shipped_path = prefill_tuning.shipped_table_path(name)
    _, shipped_json = prefill_tuning.read_table(shipped_path)
    merged = dict(tuned_json or shipped_json,
                  tiles={**shipped_json.get("tiles", {}), **tuned_json.get("tiles", {})})
    missing = [c.key for c in classes if c.key not in merged["tiles"]]
    if missing:
        print(f"no tiles for {', '.join(missing)} on {name}: nothing to ship")
        sys.exit(1)
    prefill_tuning.parse_tiles(merged)  # the engine must be able to read what ships
    text = json.dumps(merged, indent=2, sort_keys=True)
    shipped_path.write_text(text)
    print(f"shipped table {shipped_path}: {', '.join(sorted(merged['tiles']))}")
    if args.copy_to:
        with open(args.copy_to, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
