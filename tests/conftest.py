"""Suite-wide fixtures."""

from __future__ import annotations

import gc
import os

import pytest

# `-n auto` (the README's test command) runs this many workers at most, fewer on fewer
# CPUs: every worker builds engines and some tests start servers and rank processes
# beside it, so memory grows with workers, while the suite's longest files (~1 min each)
# bound its time long before 4 workers.
MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without the plugin
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0))))


# The files that take longest (seconds summed over their default tests, `--durations=80`
# of the whole suite on the 2-core VM at d321b96), longest first: `-n auto --dist
# loadfile` hands files to the workers in collection order, so these go first and the
# many short files fill the gaps at the end, where a long file handed out last would keep
# one worker busy alone. Order only: a file missing here runs after them; a renamed one
# just loses its place.
LONGEST_FILES = tuple(f"tests/test_{name}.py" for name in (
    "bench_workers", "rope_cache", "serve", "serve_lifecycle", "serve_faults", "compile",
    "serve_api_processes", "cli_bad_input", "executor_failures", "attention_kernels",
    "serve_structured", "generation_config", "fp8", "serve_tokenize", "kv_cache_fp8",
    "serve_errors", "chat", "precompiled", "executor_ray", "profile", "device_views", "cli",
    "chat_template", "async_scheduling"))


def pytest_configure(config):
    """In an xdist worker, torch (and every process a test starts: OMP_NUM_THREADS) gets
    the CPUs divided among the workers, not all of them each: with 2 workers on 2 CPUs
    that took the suite from 11:07 to 9:34 (oversubscribed OpenMP threads spin)."""
    if hasattr(config.option, "loadscopereorder"):
        # xdist's default for loadfile hands out the files with most tests first, which
        # puts the few-test, subprocess-heavy files last (the run's tail); keep
        # `pytest_collection_modifyitems`' order instead.
        config.option.loadscopereorder = False
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture parameters
def pytest_collection_modifyitems(config, items):
    """`LONGEST_FILES` first, in their order; every file's tests keep their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """An engine holds a GC freeze of everything alive at its start-up while it lives
    (`llmfast.utils.gc_freeze`); module-scoped engines live across many tests, and each new
    engine freezes whatever the tests left alive, so hand everything back to the
    collector after each test or cyclic garbage would pile up."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random HF Llama checkpoint (vocabulary 256), one per module; a module that
    needs another model defines its own `ckpt`."""
    from tests.helpers.checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", vocab_size=256)


@pytest.fixture(scope="module")
def oracle(ckpt):
    """(prompt, n) -> HF's greedy continuation on the module's `ckpt`."""
    from tests.helpers.checkpoints import load_hf_model
    from tests.helpers.hf_oracle import greedy_oracle

    return greedy_oracle(load_hf_model(ckpt))


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template."""
    from tests.helpers.chat_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("serve") / "tiny")


# The shared servers' flags beside --api-servers.
SHARED_SERVER_FLAGS = ("--max-model-len", "2048", "--max-num-seqs", "48")


@pytest.fixture(scope="session")
def shared_servers(serve_model_dir, tmp_path_factory):
    """`api_servers -> ServerProcess`: one `llmfast serve` subprocess per --api-servers
    value, started on first use and kept until the worker ends, so every file on the worker
    shares it (a start costs 15-50 s on the 2-core CI machine: three processes each import
    torch). A session-scoped parametrized fixture would be torn down and restarted at
    every switch between its values, twice per file."""
    from tests.serve_server import start_server

    servers = {}

    def get(api_servers: int):
        if api_servers not in servers:
            log = tmp_path_factory.mktemp(f"serve-log-{api_servers}") / "server.log"
            servers[api_servers] = start_server(serve_model_dir, log, *SHARED_SERVER_FLAGS,
                                                "--api-servers", str(api_servers))
        server = servers[api_servers]
        if server.proc.poll() is not None:
            pytest.fail(f"the shared server (--api-servers {api_servers}) exited with "
                        f"{server.proc.returncode}:\n{server.log()[-3000:]}")
        return server

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module", params=[0, 1], ids=lambda n: f"api-servers-{n}")
def server(request, shared_servers):
    """The shared `llmfast serve` (`shared_servers`) with the frontend in the main process
    (--api-servers 0) and in a process of its own (1), the engine core in its own process
    either way."""
    return shared_servers(request.param)


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client on the module's `server` (this file's, or a module's own)."""
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    """The served model's id, as /v1/models lists it."""
    return client.models.list().data[0].id
