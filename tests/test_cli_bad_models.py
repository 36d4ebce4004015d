"""Bad model inputs through the real CLI: one `error:` line, non-zero exit, no traceback."""

from __future__ import annotations

import json

import pytest

from tests.helpers.chat_model import make_chat_model
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.cli import assert_one_line_error, invoke


def _gen(model, *extra):
    return invoke("generate", "hello", "--model", str(model), "--device", "cpu", *extra)


def test_dir_without_config(tmp_path):
    assert_one_line_error(_gen(tmp_path), "config.json")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"],
                                                      "model_type": "gemma"}))
    line = assert_one_line_error(_gen(tmp_path), "GemmaForCausalLM")
    assert "Qwen3ForCausalLM" in line  # the supported ones are named


def test_truncated_safetensors(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(_gen(path), "corrupt or truncated")


def test_bin_checkpoint(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
    assert_one_line_error(_gen(path), "pickle")
    assert_one_line_error(_gen(path / "pytorch_model.bin"), "pickle")


@pytest.mark.parametrize("suffix", [".gguf"])
def test_corrupt_gguf(tmp_path, suffix):
    bad = tmp_path / f"model{suffix}"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    result = _gen(bad)
    # Piped (stderr is not a terminal), the conversion's first stage is a plain line
    # before the error; nothing else is printed.
    lines = result.stderr.strip().splitlines()
    assert lines[:-1] == [f"reading {bad.name}"], result.stderr
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert lines[-1].startswith("error: ") and "not a readable GGUF file" in lines[-1]


def test_prompt_longer_than_max_model_len(tmp_path):
    path = make_chat_model(tmp_path / "chat")
    result = invoke("generate", "hello there " * 40, "--model", str(path), "--device", "cpu",
                    "--max-model-len", "32", "--no-chat")
    assert_one_line_error(result, "max-model-len")


def test_dir_with_a_config_and_no_weights(tmp_path):
    """Named as missing weights, not as a pickle checkpoint (a glob generator is always
    truthy: every weightless directory was called one)."""
    path = make_hf_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    line = assert_one_line_error(_gen(path), "no *.safetensors weights")
    assert "pickle" not in line


NO_SUCH_HOME = "~llmfast_no_such_user_here"


@pytest.mark.parametrize("flag", ["--model", "--chat-template", "--generation-config"])
def test_home_of_an_unknown_user_in_a_path_flag(flag):
    """`~user/...` of no such user: the flag named in one line, not pathlib's RuntimeError
    reported as an internal error."""
    extra = [] if flag == "--model" else ["--model", "random:tiny"]
    result = invoke("generate", "hello", "--device", "cpu", *extra, flag, f"{NO_SUCH_HOME}/x")
    line = assert_one_line_error(result, "cannot expand '~'")
    assert flag in line or "model path" in line
    assert "internal error" not in line
