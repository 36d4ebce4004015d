"""torch's CPU weight-only kernels against float32 and bfloat16 F.linear, one weight
shape at a time (SmolLM2's gate/up projection and its tied head), by token count: what
chose `kernels/cpu/int4_linear.py`'s kernel and activation dtype. The weight stays hot
in the caches for the small shape, so its figures favour float32; the head's do not.

    python scripts/bench_cpu_weight_kernels.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def quartile_us(fn, repeats: int = 40) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    aten = torch.ops.aten
    for n, k in [(1536, 576), (49152, 576)]:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        int4 = aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        int8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
        weight = torch.randn(n, k)
        for m in (1, 4, 32):
            x32 = torch.randn(m, k)
            row = {}
            for dtype in (torch.bfloat16, torch.float32):
                x = x32.to(dtype)
                sz = torch.randn(k // 32, n, 2, dtype=dtype)
                scales = torch.randn(n, dtype=dtype)
                name = "bf16" if dtype == torch.bfloat16 else "f32"
                row[f"int4 {name}"] = quartile_us(
                    lambda: aten._weight_int4pack_mm_for_cpu(x, int4, 32, sz))
                row[f"int8 {name}"] = quartile_us(lambda: aten._weight_int8pack_mm(x, int8, scales))
            wb, xb = weight.bfloat16(), x32.bfloat16()
            row["linear bf16"] = quartile_us(lambda: torch.nn.functional.linear(xb, wb))
            row["linear f32"] = quartile_us(lambda: torch.nn.functional.linear(x32, weight))
            print(f"[{n}, {k}] M={m}: " + "  ".join(f"{key} {us:.0f} us" for key, us in row.items()),
                  flush=True)


if __name__ == "__main__":
    main()
