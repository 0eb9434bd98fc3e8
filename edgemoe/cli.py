"""The ``edgemoe`` command line: ``serve``, ``chat``, ``generate``, ``make-model``, ``profile`` and more.

Engine options shared by ``serve``, ``generate`` and ``profile`` map 1:1 onto
:class:`edgemoe.config.EngineConfig` fields (see :func:`add_engine_args`). User errors (a missing
model directory, a bad option value) end with one ``edgemoe: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_engine_args", "build_parser", "engine_config_from_args", "main"]


class CLIError(Exception):
    """A user error reported as one line (no traceback)."""


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as a single line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# (flag, EngineConfig field, type, help)
_ENGINE_ARGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--device", "device", str, "cpu, cuda, cuda:N or auto (default: auto)"),
    ("--dtype", "dtype", str, "weight/compute dtype: auto, bfloat16, float16, float32"),
    ("--expert-cache-slots", "expert_cache_slots", int, "(layer, expert) slots in the device expert cache"),
    ("--expert-cache-gb", "expert_cache_gb", float, "expert-cache budget in GB (1e9 bytes)"),
    ("--cpu-threads", "cpu_threads", int, "threads of the CPU expert executor"),
    ("--bandwidth-pcie-gbps", "bandwidth_pcie_gbps", float, "B_P override, GB/s (host->device expert copies)"),
    ("--bandwidth-cpu-gbps", "bandwidth_cpu_gbps", float, "B_H override, GB/s (CPU expert execution)"),
    ("--profile", "profile_path", str, "bandwidth profile JSON written by `edgemoe profile`"),
    ("--max-num-seqs", "max_num_seqs", int, "requests decoded together (default 8)"),
    ("--max-model-len", "max_model_len", int, "longest prompt + output in tokens"),
    ("--kv-cache-tokens", "kv_cache_tokens", int, "KV cache capacity in tokens (all requests)"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--seed", "seed", int, "seed for dummy weights"),
    ("--state-checkpoints", "state_checkpoints", int,
     "recurrent-state checkpoint slots of hybrid models (default 32; 0 = none)"),
    ("--state-checkpoint-interval", "state_checkpoint_interval", int,
     "also checkpoint the recurrent state every N tokens (default 2048; 0 = only at anchor tokens)"),
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options (defaults ``None``: :class:`EngineConfig`'s defaults apply)."""
    from edgemoe.config import CPU_EXECUTORS, EXPERT_POLICIES

    g = parser.add_argument_group("engine options")
    for flag, dest, typ, help_ in _ENGINE_ARGS:
        g.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    g.add_argument("--expert-policy", choices=EXPERT_POLICIES, default=None, help="how decode-step expert misses are served")
    g.add_argument("--load-format", choices=("auto", "dummy"), default=None, help="dummy = random weights from config.json")
    g.add_argument("--cpu-executor", choices=CPU_EXECUTORS, default=None,
                   help="CPU expert executor: auto (native C++ kernels when they build), native, torch")
    g.add_argument("--no-verify-weights", dest="verify_weights", action="store_false", default=None,
                   help="skip FTW bank checksums while loading")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="do not reuse cached KV pages of earlier requests' common prompt prefixes")
    g.add_argument("--prefill-chunk-tokens", type=int, default=None, help="most prompt tokens per prefill step (default 8192)")
    g.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                   help="never capture CUDA graphs for decode")
    g.add_argument("--no-anchor-checkpoints", dest="anchor_checkpoints", action="store_false", default=None,
                   help="checkpoint the recurrent state only every --state-checkpoint-interval tokens, "
                        "not after </think>, </tool_call>, </tool_response>, <|im_end|>")


def engine_config_from_args(args: argparse.Namespace):
    """Build an :class:`EngineConfig` from parsed engine options.

    Raises:
        CLIError: an option value ``EngineConfig`` rejects.
    """
    from edgemoe.config import EngineConfig

    kw = {dest: getattr(args, dest) for _, dest, _, _ in _ENGINE_ARGS}
    kw["expert_policy"] = args.expert_policy
    kw["load_format"] = args.load_format
    kw["verify_weights"] = args.verify_weights
    kw["cpu_executor"] = args.cpu_executor
    kw["enforce_eager"] = args.enforce_eager
    kw["enable_prefix_caching"] = args.enable_prefix_caching
    kw["anchor_checkpoints"] = args.anchor_checkpoints
    try:
        return EngineConfig.from_kwargs(**kw)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def _model_dir(path: str) -> str:
    p = Path(path)
    if not p.is_dir():
        raise CLIError(f"model directory {path!r} does not exist")
    if not (p / "config.json").is_file():
        raise CLIError(f"{path!r} is not a model directory (no config.json)")
    return str(p)


def _prefill_chunk(args) -> dict:
    if args.prefill_chunk_tokens is None:
        return {}
    if args.prefill_chunk_tokens < 1:
        raise CLIError("--prefill-chunk-tokens must be >= 1")
    return {"prefill_chunk_tokens": args.prefill_chunk_tokens}


# ---------------------------------------------------------------- subcommands


def _add_record_routing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-routing", metavar="FILE", default=None,
                   help="append every step's routing (phase, position, layer, experts, weights) as JSONL "
                        "(format: edgemoe/bench/trace.py); replay with `edgemoe replay-routing`")


def _recorder(path: str):
    from edgemoe.bench.trace import RoutingRecorder

    return RoutingRecorder(path)


def _check_port(host: str, port: int) -> None:
    """Raise :class:`CLIError` when ``host:port`` cannot be listened on (e.g. another server holds it)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CLIError(f"cannot resolve --host {host!r}: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as exc:
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror} (another server running? "
                           f"choose another --port)") from None


def _cmd_serve(args) -> int:
    from edgemoe.server.app import serve
    from edgemoe.server.config import ServerConfig

    model = _model_dir(args.model)
    config = engine_config_from_args(args)
    try:
        server_config = ServerConfig(
            host=args.host, port=args.port, log_level=args.log_level, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, api_key=args.api_key or os.environ.get("EDGEMOE_API_KEY") or None,
            served_model_name=tuple(args.served_model_name or ()), default_max_tokens=args.default_max_tokens,
            max_request_bytes=args.max_request_bytes, max_messages=args.max_messages,
            header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    _check_port(args.host, args.port)  # before loading weights, which can take minutes

    def on_ready(engine) -> None:
        if args.record_routing:
            engine.attach_routing_recorder(_recorder(args.record_routing))
        print(engine.runner.summary(), flush=True)
        print(f"edgemoe: serving on http://{args.host}:{args.port}/v1", flush=True)

    serve(model, config, server_config, on_ready=on_ready, **_prefill_chunk(args))
    return 0


def _cmd_chat(args) -> int:
    import openai

    from edgemoe.server.chat_client import run

    try:
        return run(
            args.base_url,
            args.model,
            args.api_key or os.environ.get("EDGEMOE_API_KEY") or "none",
            args.system,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
        )
    except openai.APIConnectionError:
        raise CLIError(f"no server at {args.base_url} (start one with `edgemoe serve MODEL_DIR`)") from None


def _cmd_generate(args) -> int:
    from dataclasses import fields

    from edgemoe.config import EngineConfig
    from edgemoe.engine.llm import LLM
    from edgemoe.engine.sampling import SamplingParams, SamplingParamsError

    model = _model_dir(args.model)
    config = engine_config_from_args(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except SamplingParamsError as exc:
        raise CLIError(f"--{exc.field.replace('_', '-')}: {exc.reason}") from None
    template_kwargs = None
    if args.chat_template_kwargs:
        try:
            template_kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise CLIError(f"--chat-template-kwargs: not valid JSON ({exc})") from None
        if not isinstance(template_kwargs, dict):
            raise CLIError("--chat-template-kwargs: must be a JSON object")
    options = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    llm = LLM(model, progress=not args.json, **_prefill_chunk(args), **options)
    if args.record_routing:
        llm.engine.attach_routing_recorder(_recorder(args.record_routing))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, chat_template_kwargs=template_kwargs)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    if llm.engine.routing_recorder is not None:
        llm.engine.routing_recorder.close()
    if out.error:
        raise RuntimeError(f"generation failed: {out.error}")
    c, m = out.outputs[0], out.metrics
    if args.json:
        n = len(c.token_ids)
        decode_s = (m.finish_time - m.first_token_time) if m.first_token_time is not None else None
        print(
            json.dumps(
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": n,
                    "ttft_s": m.ttft,
                    "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s else None,
                    "total_s": m.e2e,
                }
            )
        )
    else:
        print(c.text)
    return 0


def _cmd_make_model(args) -> int:
    from edgemoe.weights.make_model import PRESETS, make_model, write_config_only

    arch = args.arch or next(a for a, presets in PRESETS.items() if args.preset in presets)
    try:
        if args.config_only:
            path = write_config_only(args.out, arch, args.preset, tokenizer=args.tokenizer, dtype=args.dtype)
        else:
            path = make_model(args.out, arch, args.preset, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        raise CLIError(str(exc)) from None
    print(path if path is not None else args.out)
    return 0


def _cmd_profile(args) -> int:
    from edgemoe.experts.bandwidth import format_profile, run_profile

    model = _model_dir(args.model)
    result = run_profile(model, engine_config_from_args(args), args.out)
    print(format_profile(result))
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``edgemoe`` argument parser (subcommands ``serve``, ``generate``, ``make-model``, ``profile``)."""
    from edgemoe import __version__

    parser = _Parser(prog="edgemoe", description="Serve Mixture-of-Experts LLMs larger than your GPU.")
    parser.add_argument("--version", action="version", version=f"edgemoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", help="model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--tool-call-parser", default="auto",
                   help="auto (from the checkpoint), qwen3 (hermes), qwen3_coder, deepseek_v3, harmony, none")
    p.add_argument("--reasoning-parser", default="auto", help="auto (from the checkpoint), think, harmony, none")
    p.add_argument("--api-key", default=None,
                   help="require this key on /v1/ routes (Authorization: Bearer / x-api-key; default $EDGEMOE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients may ask for; the first is the id reported (default: directory name)")
    from dataclasses import fields

    from edgemoe.server.config import ServerConfig

    for f in fields(ServerConfig):  # the limits, until the whole serve parser is generated from ServerConfig
        if f.name in ("default_max_tokens", "max_request_bytes", "max_messages", "header_timeout_s", "body_timeout_s"):
            p.add_argument("--" + f.name.replace("_", "-"), type=float if f.type == "float" else int, default=f.default,
                           help=f.metadata["help"])
    add_engine_args(p)
    _add_record_routing(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("chat", help="terminal chat with a running server (streams, shows reasoning dimmed)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="API key (default $EDGEMOE_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation config")
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("generate", help="generate from one prompt and print the text")
    p.add_argument("model", help="model directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--chat-template-kwargs", help='JSON object for the template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print text, token ids and timing as JSON")
    add_engine_args(p)
    _add_record_routing(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("make-model", help="write a random-weight test checkpoint")
    p.add_argument("--arch", default=None, help="HF model_type (default: the one whose preset --preset names)")
    from edgemoe.weights.make_model import PRESETS

    p.add_argument("--preset", default="tiny", choices=[name for presets in PRESETS.values() for name in presets])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="copy this tokenizer directory instead of building one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--config-only", action="store_true", help="config + tokenizer only (use --load-format dummy)")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("profile", help="measure B_P and B_H for this machine and model")
    p.add_argument("model", help="model directory")
    p.add_argument("--out", default=None, help="where to write the profile JSON")
    add_engine_args(p)
    p.set_defaults(func=_cmd_profile)

    from edgemoe.bench.replay import register_cli as register_replay
    from edgemoe.weights.ftw import register_cli as register_convert

    register_replay(sub)
    register_convert(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgemoe`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError, TypeError) as exc:
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
