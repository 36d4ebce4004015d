"""The `llmfast` commands driven through Typer's CliRunner (in process, CPU, tiny models):
help texts, generate, bench output files, pull, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import TINY, assert_one_line_error, invoke

NO_MODEL = ["--model", "/nonexistent/model", "--device", "cpu"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat-model"))


# ---------------------------------------------------------------------- help


@pytest.mark.parametrize("command", ["chat", "generate", "bench", "profile"])
def test_help_has_examples_and_engine_flags(command):
    result = invoke(command, "--help-all")
    assert result.exit_code == 0
    text = result.stdout
    assert "Examples" in text and f"llmfast {command}" in text
    for flag in ("--model", "--dtype", "--device", "--debug", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--block-size",
                 "--enforce-eager", "--kv-cache-memory", "--gpu-memory-utilization",
                 "--compile", "--no-cuda-graphs", "--cuda-graph-mode", "--cuda-graph-sizes",
                 "--seed"):
        assert flag in text, flag


def test_bad_cuda_graph_mode_is_one_line_error():
    result = invoke("generate", *TINY, "--cuda-graph-mode", "full", "hi")
    assert_one_line_error(result, "unknown cuda graph mode 'full'; use one of none, piecewise")


def test_top_level_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("chat", "generate", "bench", "profile", "pull"):
        assert command in result.stdout
    assert "llmfast pull" in invoke("pull", "--help").stdout


# ---------------------------------------------------------------------- generate


def test_generate_json_batched_matches_single(chat_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nTell me a story\n")
    common = ["--model", str(chat_model), "--device", "cpu", "--max-tokens", "6",
              "--temperature", "0", "--ignore-eos"]
    batched = invoke("generate", "--file", str(prompts), "The capital of France", "--json", "-",
                     *common)
    assert batched.exit_code == 0, batched.output
    rows = json.loads(batched.stdout)
    assert [r["prompt"] for r in rows] == ["The capital of France", "hello there",
                                          "Tell me a story"]
    for row in rows:
        assert set(row) == {"prompt", "text", "token_ids", "finish_reason", "metrics"}
        assert len(row["token_ids"]) == 6 and row["finish_reason"] == "length"
        assert {"ttft_s", "tpot_s", "e2e_s", "num_prompt_tokens", "num_cached_tokens",
                "num_output_tokens"} <= set(row["metrics"])
        assert row["metrics"]["ttft_s"] > 0
    single = invoke("generate", "hello there", "--json", "-", *common)
    assert json.loads(single.stdout)[0]["token_ids"] == rows[1]["token_ids"]
    plain = invoke("generate", "hello there", *common)
    assert plain.exit_code == 0
    assert plain.stdout.rstrip("\n") == rows[1]["text"].rstrip("\n")


def test_generate_chat_template_toggle(chat_model):
    common = ["--model", str(chat_model), "--device", "cpu", "--max-tokens", "2", "--json", "-"]
    chat = json.loads(invoke("generate", "hi", *common).stdout)[0]
    raw = json.loads(invoke("generate", "hi", "--no-chat", *common).stdout)[0]
    # The template wraps the message: many more prompt tokens than the bare text.
    assert chat["metrics"]["num_prompt_tokens"] > raw["metrics"]["num_prompt_tokens"] + 5


# ---------------------------------------------------------------------- bench


def test_bench_sweep_writes_json_and_png(tmp_path):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    result = invoke("bench", *TINY, "--sizes", "1..8", "--context", "16", "--steps", "4",
                    "--json", str(out_json), "--plot", str(out_png))
    assert result.exit_code == 0, result.output
    assert "decode sweep" in result.stdout and "skipped" not in result.stdout
    report = json.loads(out_json.read_text())
    assert set(report) == {"llmfast_bench_version", "timestamp", "config", "environment", "runs"}
    assert report["config"]["sizes"] == [1, 2, 4, 8]
    assert report["config"]["context"] == 16 and report["config"]["steps"] == 4
    env = report["environment"]
    for key in ("torch", "transformers", "llmfast", "device", "cpu", "python"):
        assert env[key], key
    run = report["runs"]["default"]
    assert run["device_facts"] == {"device": "cpu"}  # rank 0's, in this process here
    assert env["device"] == "cpu" and "gpu" not in env
    assert {"load", "kv_cache"} <= set(run["startup"])
    assert run["engine_config"]["device"] == "cpu"
    assert [p["batch_size"] for p in run["sweep"]] == [1, 2, 4, 8]
    assert run["sweep_skipped"] == [] and run["bandwidth"] is None  # CPU: no HBM limit
    for p in run["sweep"]:
        assert set(p) == {"batch_size", "context_len", "steps", "step_latency",
                          "decode_tokens_per_s", "prefill_tokens", "prefill_time_s",
                          "prefill_steps", "prefill_tokens_per_s", "all_decode",
                          "step_latencies_s", "weight_bytes", "weight_stream_bytes_per_s",
                          "hbm_fraction", "triton_compiles", "triton_compile_s"}
        assert p["weight_bytes"] > 0 and p["hbm_fraction"] is None
        assert p["triton_compiles"] == 0  # start-up and the warm-up compiled everything
        assert set(p["step_latency"]) == {"count", "mean", "median", "p90", "p99", "min", "max"}
        assert len(p["step_latencies_s"]) == 4 and p["all_decode"]
    from matplotlib.image import imread

    image = imread(out_png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


STARTUP_RUN_KEYS = {"stages", "import_s", "engine_s", "first_step_s", "time_to_first_token_s",
                    "process_s", "compile_cache_hits", "compile_cache_misses", "cache_files",
                    "device", "device_facts", "compile_summary", "engine_config",
                    "triton_variants"}


def _check_startup_report(result, out_json) -> dict:
    assert result.exit_code == 0, result.output
    assert "start-up" in result.stdout and "time to first token" in result.stdout
    report = json.loads(out_json.read_text())
    assert set(report) == {"llmfast_bench_version", "timestamp", "config", "environment",
                           "runs", "startup"}
    assert report["config"]["mode"] == "startup" and report["runs"] == {}
    assert report["environment"]["device"] == "cpu" and "gpu" not in report["environment"]
    startup = report["startup"]
    assert set(startup) == {"model", "engine_args", "cache_root", "cold", "warm",
                            "bytecode_prime_s", "bytecode_primed_modules"}
    # Bytecode beside the installed packages here: nothing to prime.
    assert startup["bytecode_prime_s"] is None and startup["bytecode_primed_modules"] is None
    for which in ("cold", "warm"):
        run = startup[which]
        assert set(run) == STARTUP_RUN_KEYS, which
        assert run["triton_variants"] is None  # the CPU precompiles nothing
        # The runner's stages and the engine's (tokenizer, scheduler): what "other" is not.
        # (uni: the tokenizer loads in a thread beside the runner; its wait is a stage.)
        assert {"load", "setup", "tokenizer_wait", "kv_cache", "scheduler"} <= set(run["stages"])
        assert run["device"] == "cpu" and run["device_facts"] == {"device": "cpu"}
        # Spawn -> first token covers the imports, the engine and the first step.
        assert run["time_to_first_token_s"] >= run["import_s"] + run["engine_s"]
        assert run["process_s"] >= run["time_to_first_token_s"]
        assert run["engine_s"] >= sum(run["stages"].values())
    return startup


def test_bench_startup_cold_and_warm_eager(tmp_path):
    out_json, out_png = tmp_path / "startup.json", tmp_path / "startup.png"
    result = invoke("bench", *TINY, "--enforce-eager", "--startup", "--json", str(out_json),
                    "--plot", str(out_png))
    startup = _check_startup_report(result, out_json)
    assert startup["engine_args"]["enforce_eager"] is True
    for which in ("cold", "warm"):  # eager: nothing compiled, nothing cached
        assert "compile" not in startup[which]["stages"]
        assert startup[which]["compile_cache_hits"] == startup[which]["compile_cache_misses"] == 0
        assert startup[which]["compile_summary"] == ""
    assert out_png.stat().st_size > 0
    # Where llmfast primes its own bytecode cache, the table says what that took.
    from rich.console import Console

    from llmfast.cli.bench.tables import startup_table

    for modules, says in ((2400, "2400 modules of a start compiled into it before the cold "
                                 "start in 7.50 s"),
                          (0, "held a start's imports already (7.50 s to import them")):
        console = Console(width=400, record=True)
        console.print(startup_table(dict(startup, bytecode_prime_s=7.5,
                                         bytecode_primed_modules=modules)))
        assert says in " ".join(console.export_text().split())  # (the caption wraps)
    # A CUDA start's Triton variants (none on the CPU): compiled ahead, or the failure.
    for variants, says in (({"precompiled": 6, "compiled_at_launch": 0},
                            "cold: Triton variants 6 compiled in threads ahead, 0 at their "
                            "launch"),
                           ({"precompiled": 0, "compiled_at_launch": 6, "precompile_failed": 1},
                            "cold: Triton variants: compiling them ahead failed (see the log), "
                            "6 compiled at their launch")):
        console = Console(width=400, record=True)
        console.print(startup_table(dict(startup, cold=dict(startup["cold"],
                                                            triton_variants=variants))))
        assert says in " ".join(console.export_text().split())


@pytest.mark.slow
def test_bench_startup_warm_start_reuses_the_compile_cache(tmp_path):
    out_json = tmp_path / "startup.json"
    result = invoke("bench", *TINY, "--compile", "--startup", "--json", str(out_json))
    startup = _check_startup_report(result, out_json)
    cold, warm = startup["cold"], startup["warm"]
    assert cold["compile_cache_misses"] > 0 and cold["compile_cache_hits"] == 0
    assert warm["compile_cache_misses"] == 0 and warm["compile_cache_hits"] > 0
    assert cold["cache_files"] > 0 and warm["cache_files"] >= cold["cache_files"]
    assert "compile" in cold["stages"] and "compile" in warm["stages"]
    # What was compiled, in the JSON and under the table (graphs too, on CUDA).
    assert "pieces around" in cold["compile_summary"] and "pieces around" in result.stdout


def test_bench_throughput_with_hf_baseline(tmp_path):
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    result = invoke("bench", *TINY, "--mode", "throughput", "--num-prompts", "4",
                    "--input-len", "12", "--output-len", "4", "--random-range-ratio", "0.5",
                    "--baseline", "hf", "--hf-batch-size", "2", "--json", str(out_json),
                    "--plot", str(out_png))
    assert result.exit_code == 0, result.output
    assert "HF generate (batch 2)" in result.stdout and "llmfast / HF" in result.stdout
    assert "total tokens/s" in result.stdout
    run = json.loads(out_json.read_text())["runs"]["default"]
    assert run["hf_batch_size"] == 2 and "hf_batch_probes" not in run  # given, not probed
    assert run["device_facts"] == run["baseline_hf_device_facts"] == {"device": "cpu"}
    assert run["total_speedup_vs_hf"] == pytest.approx(
        run["throughput"]["total_tokens_per_s"] / run["baseline_hf"]["total_tokens_per_s"])
    assert run["throughput"]["output_tokens"] == run["baseline_hf"]["output_tokens"]
    assert run["speedup_vs_hf"] > 0
    assert out_png.stat().st_size > 0


def test_bench_latency_mode(tmp_path):
    out_json = tmp_path / "lat.json"
    result = invoke("bench", *TINY, "--mode", "latency", "--num-prompts", "5",
                    "--input-len", "8", "--output-len", "4", "--request-rate", "100",
                    "--json", str(out_json))
    assert result.exit_code == 0, result.output
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        assert metric in result.stdout
    lat = json.loads(out_json.read_text())["runs"]["default"]["latency"]
    assert lat["num_requests"] == 5 and lat["request_rate"] == 100.0
    assert set(lat["ttft"]) == {"count", "mean", "median", "p90", "p99", "min", "max"}
    burst = invoke("bench", *TINY, "--mode", "latency", "--num-prompts", "2", "--input-len",
                   "4", "--output-len", "2", "--json", str(out_json))
    assert burst.exit_code == 0
    assert json.loads(out_json.read_text())["config"]["request_rate"] == "inf"


# ---------------------------------------------------------------------- pull


def test_pull_prints_path(monkeypatch, tmp_path):
    import llmfast.models.sources.default_model as dm

    def fake(progress=None, **_):
        progress("downloading", None)
        progress("converting", 0.5)
        return tmp_path / "SmolLM2"

    monkeypatch.setattr(dm, "ensure_default_model", fake)
    result = invoke("pull")
    assert result.exit_code == 0
    assert result.stdout.strip() == str(tmp_path / "SmolLM2")


def test_pull_offline_is_one_line(monkeypatch):
    import llmfast.models.sources.default_model as dm

    def offline(progress=None, **_):
        raise dm.DefaultModelError("the default model could not be downloaded; are you offline?")

    monkeypatch.setattr(dm, "ensure_default_model", offline)
    assert_one_line_error(invoke("pull"), "offline")


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, fragment", [
    (["bench", *TINY, "--sizes", "0..8"], ">= 1"),
    (["bench", *TINY, "--sizes", "8..1"], "backwards"),
    (["bench", *TINY, "--sizes", "a..b"], "cannot parse"),
    (["bench", *TINY, "--sizes", "1..100000"], "limit"),
    (["bench", *TINY, "--sizes", "1..512", "--max-num-seqs", "256"], "max-num-seqs"),
    (["bench", *TINY, "--modes", "graphs"], "cuda"),
    (["bench", *TINY, "--modes", "turbo"], "unknown mode"),
    (["bench", *TINY, "--modes", "eager,compiled", "--enforce-eager"], "drop --enforce-eager"),
    (["bench", *TINY, "--modes", "eager", "--compile"], "drop --compile/--no-compile"),
    (["bench", *TINY, "--modes", "compiled", "--no-cuda-graphs"], "drop --no-cuda-graphs"),
    (["generate", "hi", *TINY, "--enforce-eager", "--compile"], "drop one of the two"),
    (["bench", *TINY, "--mode", "fastest"], "invalid value"),
    (["bench", *TINY, "--json", "/nonexistent-dir/x.json"], "does not exist"),
    # Checked before the model loads (this one does not exist): nothing runs in vain.
    (["bench", *NO_MODEL, "--plot", "out.txt"], "--plot out.txt has extension '.txt'; use .png"),
    (["bench", *NO_MODEL, "--plot", "sweep"], "--plot sweep has no extension"),
    (["bench", *NO_MODEL, "--json", "out.png"], "use .json"),
    (["bench", *NO_MODEL, "--mode", "latency", "--request-rate", "1e-9"], "at most 3600 s"),
    (["bench", *NO_MODEL, "--mode", "latency", "--num-prompts", "5000", "--request-rate", "1"],
     "5000 requests over ~5e+03 s"),
    (["bench", *NO_MODEL, "--mode", "latency", "--request-rate", "0"], "must be > 0"),
    (["bench", *TINY, "--kv-cache-memory", "lots"], "512mib"),
    (["generate", "hi", *TINY, "--temperature", "-1"], "temperature"),
    (["generate", "hi", *TINY, "--top-p", "0"], "top_p"),
    (["generate", "hi", *TINY, "--top-p", "1.5"], "top_p"),
    (["generate", "hi", *TINY, "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", *TINY, "--max-tokens", "many"], "max-tokens"),
    (["generate", "hi", "--model", "random:tiny", "--device", "tpu"], "unknown device"),
    (["generate", "hi", "--model", "random:tiny", "--device", "cuda"], "no cuda gpu"),
    (["generate", "hi", "--model", "random:nope", "--device", "cpu"], "unknown random preset"),
    (["generate", "hi", "--model", "/nonexistent/model", "--device", "cpu"], "does not exist"),
    (["generate", *TINY], "no prompts"),
    (["generate", "hi", *TINY, "--dtype", "int3"], "dtype"),
    (["generate", "hi", *TINY, "--block-size", "7"], "block size"),
    (["generate", "hi", *TINY, "--kv-cache-memory", "1KiB"], "kv cache"),
    (["chat", *TINY, "--temperature", "-2"], "temperature"),
    (["bench", *TINY, "--no-such-flag"], "no such option"),
    (["frobnicate"], "no such command"),
])
def test_bad_input_is_one_line_error(args, fragment):
    assert_one_line_error(invoke(*args), fragment)


def test_generate_file_not_utf8(tmp_path, chat_model):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"hello \xff\xfe there\n")
    assert_one_line_error(invoke("generate", "--file", str(bad), "--model", str(chat_model),
                                 "--device", "cpu"), "not valid utf-8")
    assert_one_line_error(invoke("generate", "--file", str(tmp_path / "missing.txt"),
                                 "--model", str(chat_model), "--device", "cpu"), "missing.txt")


def test_kv_cache_too_small_for_one_request():
    line = assert_one_line_error(invoke("generate", "hi", *TINY, "--kv-cache-memory", "64KiB",
                                        "--max-model-len", "4096"))
    assert "kv cache" in line.lower() and "max-model-len" in line


def test_debug_shows_traceback():
    result = invoke("generate", "hi", "--model", "random:tiny", "--device", "tpu", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "error: unknown device" in result.stderr


def test_sweep_overrides_raise_unset_limits_only():
    from llmfast.bench import BenchError
    from llmfast.cli.bench.command import parse_exec_modes
    from llmfast.cli.common import EngineOptions, sweep_overrides

    unset = EngineOptions(model=None, debug=False)
    assert sweep_overrides([1, 512], unset) == {"max_num_seqs": 512,
                                                "max_num_batched_tokens": 2048}
    assert sweep_overrides([1, 8], unset) == {"max_num_seqs": 256,
                                              "max_num_batched_tokens": 2048}
    given = EngineOptions(model=None, debug=False, engine_kwargs={"max_num_seqs": 16})
    assert sweep_overrides([1, 16], given) == {"max_num_batched_tokens": 2048}
    with pytest.raises(BenchError, match="--max-num-seqs 16"):
        sweep_overrides([32], given)
    cpu = EngineOptions(model=None, debug=False, engine_kwargs={"device": "cpu"})
    assert parse_exec_modes("eager,compiled,eager", cpu) == ["eager", "compiled"]
    assert parse_exec_modes(None, cpu) == ["default"]
