"""Speculative decoding through the commands: flags on every engine command (bad
combinations are one-line errors before anything loads), `chat` with n-gram drafts
answers as without them and reports acceptance in /stats, `/metrics` exports the
acceptance, and `bench --mode throughput` reports it."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmfast.bench.throughput import run_throughput
from llmfast.bench.workload import BenchRequest
from llmfast.cli.bench.tables import throughput_table
from llmfast.config import ConfigError
from llmfast.engine.args import EngineArgs
from llmfast.engine.messages import StepStats
from llmfast.serve.api.metrics import _EngineStats
from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import TINY, assert_one_line_error, invoke


@pytest.mark.parametrize("args, fragment", [
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative-method"),
    (["--speculative-method", "medusa"], "unknown speculative method 'medusa'"),
    (["--speculative-method", "draft"], "--speculative-model goes with --speculative-method draft"),
    (["--speculative-method", "ngram", "--speculative-model", "x"], "--speculative-model goes"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
     "num-speculative-tokens must be a positive integer"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "17"], "at most 16"),
    (["--speculative-method", "ngram", "--ngram-prompt-lookup-min", "5"],
     "--ngram-prompt-lookup-min <= --ngram-prompt-lookup-max, got 5 and 4"),
    (["--speculative-method", "ngram", "--async-scheduling"],
     "--async-scheduling does not run with speculative decoding"),
    (["--speculative-model", "m", "--ngram-prompt-lookup-max", "3"],
     "--ngram-prompt-lookup-max is for --speculative-method ngram"),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_flags_are_one_line_errors(command, args, fragment):
    argv = [command, "hi", *TINY, *args] if command == "generate" else [command, *TINY, *args]
    assert_one_line_error(invoke(*argv), fragment)


@pytest.mark.parametrize("model, fragment", [
    ("/nonexistent/draft", "--speculative-model /nonexistent/draft: model path"),
    ("random:llama-3.2-1b", "a draft model must share the target's tokenizer"),
])
def test_bad_draft_models_are_one_line_errors(model, fragment):
    result = invoke("generate", "hi", *TINY, "--speculative-model", model, "--max-tokens", "2")
    assert_one_line_error(result, fragment)


def test_llm_keywords_check_the_same():
    with pytest.raises(ConfigError, match="--num-speculative-tokens needs"):
        EngineArgs(num_speculative_tokens=2)
    config = EngineArgs(speculative_method="ngram", num_speculative_tokens=5,
                        ngram_prompt_lookup_max=3).speculative_config()
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max, config.num_lookahead_slots) == ("ngram", 5, 2, 3, 0)
    # A draft model is implied by --speculative-model, and gets lookahead slots.
    config = EngineArgs(speculative_model="some/model").speculative_config()
    assert config.method == "draft" and config.num_lookahead_slots == 3
    assert EngineArgs().speculative_config() is None


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat-model"))


def _chat(model, *args):
    script = b"repeat after me: one two three one two three one two three\n/stats\n"
    # The model's generation config asks for a repetition penalty: no drafts with one.
    return invoke("chat", "--model", str(model), "--device", "cpu", "--temperature", "0",
                  "--repetition-penalty", "1", "--max-tokens", "24", *args, input=script)


def test_chat_same_reply_and_stats(chat_model):
    plain = _chat(chat_model)
    spec = _chat(chat_model, "--speculative-method", "ngram", "--num-speculative-tokens", "4")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    line = re.search(r"speculative decoding \(ngram\): acceptance .* \((\d+) of (\d+) drafts "
                     r"in (\d+) steps\)", spec.stderr)
    assert line and int(line[2]) > 0 and int(line[3]) > 0, spec.stderr
    assert "speculative decoding" not in plain.stderr
    assert "Traceback" not in spec.output


class _Front:
    def __init__(self, stats: StepStats) -> None:
        self.stats, self.num_steps = stats, stats.num_steps


def _scrape(stats: StepStats) -> str:
    registry = CollectorRegistry()
    registry.register(_EngineStats(_Front(stats)))
    return generate_latest(registry).decode()


def test_metrics_export_acceptance():
    text = _scrape(StepStats(1, 0, 0, 10, 0, 0.0, 0.1, 20, 40, 30, 10))
    assert "llmfast_spec_decode_num_draft_tokens_total 40.0" in text
    assert "llmfast_spec_decode_num_accepted_tokens_total 30.0" in text
    assert "llmfast_spec_decode_acceptance_rate 0.75" in text
    assert "llmfast_spec_decode_mean_accepted_length 4.0" in text  # (30 + 10) / 10
    assert "spec_decode" not in _scrape(StepStats(1, 0, 0, 10, 0, 0.0, 0.1, 20))


def test_bench_throughput_reports_acceptance():
    from llmfast import LLM

    llm = LLM("random:tiny", device="cpu", speculative_method="ngram",
              num_speculative_tokens=3, max_model_len=256)
    pattern = [5, 9, 13, 17, 21, 25]
    requests = [BenchRequest(prompt_token_ids=pattern * 8, output_len=24) for _ in range(2)]
    result = run_throughput(llm.engine, requests)
    spec = result.spec_decode
    assert spec["num_verify_steps"] > 0 and spec["num_draft_tokens"] > 0
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    run = {"model": "tiny", "throughput": result.__dict__}
    assert "speculative decoding: acceptance" in str(throughput_table(run).caption)


def test_structured_rows_get_no_drafts_beside_drafting_ones(chat_model):
    """A constrained request shares its steps with drafting ones: its output matches
    its regex, the others' tokens are what they are without speculation."""
    from llmfast import LLM, SamplingParams
    from llmfast.structured_params import StructuredOutputs

    prompts = ["one two three one two three one two three one two", "a b c a b c a b c a b",
               "hello there"]
    regex = r"[a-f]{2,6}-[0-9]{1,3}"
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.0) for _ in prompts]
    params[2] = SamplingParams(temperature=0.0, max_tokens=20,
                               structured=StructuredOutputs(regex=regex))
    plain = LLM(str(chat_model), device="cpu", block_size=8).generate(prompts, params)
    llm = LLM(str(chat_model), device="cpu", block_size=8, speculative_method="ngram")
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert re.fullmatch(regex, spec[2].outputs[0].text)
    assert llm.engine.stats().spec_num_verify_steps > 0
