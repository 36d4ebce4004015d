"""`llmfast serve`: the OpenAI-compatible HTTP server (see llmfast/serve/)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from llmfast.cli.common import EngineOptions, stage_progress, stderr_console
from llmfast.utils.flag_values import FlagValueError, parse_bytes

MAX_API_SERVERS = 64
# Measured on the 2-core CPU VM (profiles/serving.md): one frontend process of its own
# beat the frontend in the launcher (0) and two (2) at 256 streams; a machine with cores
# to spare may want more.
DEFAULT_API_SERVERS = 1

SERVE_EXAMPLES = """\
**Examples**

* `llmfast serve`  (the default model on http://127.0.0.1:8000/v1)

* `llmfast serve ./my-llama --port 9000 --api-key secret`

* `curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hi", "max_tokens": 8}'`

* `python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x");
  print(c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}]))'`
"""


def serve(
    *,
    opts: EngineOptions,
    model_arg: Annotated[str | None, typer.Argument(
        metavar="MODEL", help="The model (same as --model).", show_default=False)] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LLMFAST_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health and "
             "/metrics.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model id in the API.  [default: the model's name]",
        show_default=False)] = None,
    max_body_size: Annotated[str, typer.Option(
        "--max-body-size", help="Largest request body (413 above), e.g. 8MiB.")] = "8MiB",
    api_servers: Annotated[int, typer.Option(
        "--api-servers", help="Frontend processes (HTTP, tokenizing, detokenizing), each "
        "connected to the engine core's process and sharing the port: 0 runs the one "
        "frontend in this process.")] = DEFAULT_API_SERVERS,
    tool_call_parser: Annotated[str | None, typer.Option(
        "--tool-call-parser", help="How chat's tool_choice 'auto' reads tool calls from the "
        "model's output: hermes (<tool_call>, Qwen), llama3_json, mistral ([TOOL_CALLS]).  "
        "[default: from the model's chat template and family]", show_default=False)] = None,
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log", help="Log a line per HTTP request (method, path, "
        "status) on stderr.")] = True,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming)."""
    from llmfast.serve.api.app import ServeConfig
    from llmfast.engine.args import EngineArgs
    from llmfast.engine.model_resolution import resolve_model
    from llmfast.serve.server import bind, start_core
    from llmfast.serve.server import serve as run_server
    from llmfast.serve.switch_interval import serving_switch_interval

    if model_arg is not None:
        if opts.model is not None and opts.model != model_arg:
            raise typer.BadParameter(f"{model_arg!r} and --model {opts.model!r} disagree",
                                     param_hint="'MODEL'")
        opts = dataclasses.replace(opts, model=None if model_arg == "default" else model_arg)
    if not 0 <= api_servers <= MAX_API_SERVERS:
        raise typer.BadParameter(f"must be in [0, {MAX_API_SERVERS}], got {api_servers}",
                                 param_hint="'--api-servers'")
    if not host.strip():  # e.g. an unset shell variable: it would listen everywhere
        raise typer.BadParameter("must not be empty (0.0.0.0 listens on every interface)",
                                 param_hint="'--host'")
    if api_key is not None and not api_key.strip():  # the banner would say "no key" and
        # every request without one would be refused
        raise typer.BadParameter("must not be empty (leave it out to serve without a key)",
                                 param_hint="'--api-key'")
    from llmfast.serve.api.tool_parsers import PARSERS

    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise typer.BadParameter(f"must be one of {', '.join(PARSERS)}, got "
                                 f"{tool_call_parser!r}", param_hint="'--tool-call-parser'")
    if not 0 <= port <= 65535:
        raise typer.BadParameter(f"must be in [0, 65535], got {port}", param_hint="'--port'")
    try:
        max_body = parse_bytes(max_body_size)
    except FlagValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--max-body-size'") from None
    try:  # a bad variable fails before the slow start
        serving_switch_interval()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="environment") from None
    sock = bind(host, port)  # before the slow start: a taken port fails at once
    err = stderr_console()
    with stage_progress(err) as report:
        # The model resolved (fetched, converted) here; the core's process loads it.
        args = EngineArgs.from_kwargs(model=opts.model, **opts.with_overrides())
        resolved = resolve_model(args, report)
        config, source = args.create_engine_config(resolved), resolved.source
        report("starting the engine core process", None)
        core = start_core(config, source)
    name = served_model_name or source.name
    aliases = tuple(a for a in (opts.model, source.spec) if a and a != name)
    config_ = ServeConfig(model_name=name, model_aliases=aliases, api_key=api_key,
                          max_body_bytes=max_body, tool_call_parser=tool_call_parser)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    defaults = config.sampling_defaults

    def say_serving() -> None:  # once the server accepts: a request sent now is answered
        err.print(f"serving {name} at {url}/v1 (OpenAI API; /health, /metrics)"
                  + ("; API key required" if api_key else ""), style="dim")
        if defaults:  # they change what requests get: say so, as vLLM does
            err.print("default sampling parameters from the model's generation_config.json: "
                      + ", ".join(f"{k}={v}" for k, v in defaults)
                      + " (--generation-config vllm to ignore them)", style="dim",
                      markup=False, soft_wrap=True)

    run_server(core, config, source, sock, config_, access_log=access_log or opts.debug,
               api_servers=api_servers, on_ready=say_serving)
