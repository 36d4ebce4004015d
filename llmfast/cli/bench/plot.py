"""`llmfast bench --plot`: a PNG drawn from the same report dict that `--json` writes.

Uses matplotlib's object API with the Agg canvas, never pyplot: no global figure state
and no GUI backend, whatever the machine.
"""

from __future__ import annotations

from pathlib import Path


def _figure(ncols: int):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib (pip install matplotlib): {e}") from None
    fig = Figure(figsize=(6 * ncols, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def plot_report(report: dict, path: Path) -> None:
    mode = report["config"]["mode"]
    runs = report["runs"]
    if mode == "startup":
        fig = _plot_startup(report["startup"])
        fig.suptitle(f"llmfast bench --startup: {report['startup']['model']} on "
                     f"{report['environment'].get('gpu') or report['environment']['device']}")
        fig.savefig(path, dpi=110)
        return
    if mode == "sweep":
        fig = _plot_sweep(runs)
    elif mode == "throughput":
        fig = _plot_throughput(next(iter(runs.values())))
    else:
        fig = _plot_latency(next(iter(runs.values()))["latency"])
    fig.suptitle(f"llmfast bench ({mode}): {next(iter(runs.values()))['model']} on "
                 f"{report['environment'].get('gpu') or report['environment']['device']}")
    fig.savefig(path, dpi=110)


def _plot_sweep(runs: dict):
    fig, (tput, lat) = _figure(2)
    for name, run in runs.items():
        points = run["sweep"]
        sizes = [p["batch_size"] for p in points]
        label = "llmfast" if name == "default" else name
        tput.plot(sizes, [p["decode_tokens_per_s"] for p in points], marker="o", label=label)
        median = [p["step_latency"]["median"] * 1000 for p in points]
        p99 = [p["step_latency"]["p99"] * 1000 for p in points]
        line, = lat.plot(sizes, median, marker="o", label=f"{label} median")
        lat.plot(sizes, p99, linestyle="--", color=line.get_color(), label=f"{label} p99")
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (sequences decoding)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    tput.set_ylabel("output tokens/s")
    tput.set_title("decode throughput")
    lat.set_ylabel("ms per engine step")
    lat.set_title("decode step latency")
    return fig


def _plot_startup(startup: dict):
    fig, (ax,) = _figure(1)
    stages = list(dict.fromkeys([*startup["cold"]["stages"], *startup["warm"]["stages"]]))
    labels = ["imports", *stages, "first token"]
    width = 0.4
    for offset, which in ((-width / 2, "cold"), (width / 2, "warm")):
        run = startup[which]
        values = [run["import_s"], *(run["stages"].get(s, 0.0) for s in stages),
                  run["first_step_s"]]
        ax.bar([i + offset for i in range(len(labels))], values, width, label=which)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds")
    ax.set_title("start-up by stage")
    ax.legend()
    return fig


def _plot_throughput(run: dict):
    fig, (ax,) = _figure(1)
    names = ["llmfast"]
    values = [run["throughput"]["output_tokens_per_s"]]
    if "baseline_hf" in run:
        names.append("HF generate")
        values.append(run["baseline_hf"]["output_tokens_per_s"])
    ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{run['throughput']['num_requests']} requests")
    return fig


def _plot_latency(result: dict):
    fig, (ax,) = _figure(1)
    rows = result["per_request"]
    for key in ("ttft", "e2e"):
        values = sorted(r[key] * 1000 for r in rows)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=key.upper())
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_title("latency CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
