"""The ``edgemoe`` command line: ``serve``, ``chat``, ``generate``, ``make-model``, ``profile`` and more.

Engine options shared by ``serve``, ``generate`` and ``profile`` are generated from the fields of
:class:`edgemoe.config.EngineConfig` (see :func:`add_config_args`), so they map 1:1 by construction.
User errors (a missing model directory, a bad option value, a device this machine lacks) end with one
``edgemoe: error: ...`` line and exit status 2; a model that fails to load, with one line and status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import typing
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["add_engine_args", "build_parser", "engine_config_from_args", "main"]

DEFAULT_CHAT_MAX_TOKENS = 1024


class CLIError(Exception):
    """A user error reported as one line (no traceback)."""


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as a single line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of the options dataclass ``cls`` (``EngineConfig``, ``ServerConfig``), from
    the field's metadata (see :func:`edgemoe.config.option`); every default is ``None`` on the command
    line, so the dataclass's own default applies to an omitted flag."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or meta.get("cli") is False:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kw: dict[str, Any] = {"dest": f.name, "default": None}
        base = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        if "nargs" in meta:  # a tuple option: each value's type
            base = next(iter(typing.get_args(base)), str)
        help_ = meta["help"]
        if base is bool:
            off = flag.startswith("--no-")
            kw["action"] = "store_false" if off else "store_true"
            help_ = f"turn off {help_}" if off else help_
        else:
            kw["type"] = meta.get("type", base)
            for key in ("choices", "metavar", "nargs"):
                if key in meta:
                    kw[key] = meta[key]
            if f.default is not None and f.default is not MISSING and "choices" not in meta:
                help_ += f" (default: {f.default})"
            elif "choices" in meta and f.default is not MISSING:
                help_ += f" (default: {f.default})"
        group.add_argument(flag, help=help_, **kw)


def config_from_args(args: argparse.Namespace, cls: type):
    """Build ``cls`` (an options dataclass) from the flags :func:`add_config_args` added.

    Raises:
        CLIError: a value the options reject.
    """
    kw = {f.name: vars(args)[f.name] for f in fields(cls) if vars(args).get(f.name) is not None}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}  # nargs options
    try:
        return cls(**kw)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace, model_dir: str | None = None):
    """The :class:`~edgemoe.config.EngineConfig` of the parsed engine flags, its device checked, and, given
    ``model_dir``, the checkpoint's tokenizer checked against ``--trust-remote-code`` (before any loading).

    Raises:
        CLIError: an option value ``EngineConfig`` rejects, a ``--device`` this machine lacks, or a
            tokenizer that is custom code without ``--trust-remote-code``.
    """
    from edgemoe.config import EngineConfig
    from edgemoe.engine.tokenizer import RemoteCodeError, check_remote_code

    config = config_from_args(args, EngineConfig)
    try:
        config.resolved_device()
    except (RuntimeError, ValueError) as exc:  # torch.device() rejects a malformed name with RuntimeError
        raise CLIError(f"--device {config.device}: {exc}") from None
    if model_dir is not None:
        try:
            check_remote_code(model_dir, config.trust_remote_code)
        except RemoteCodeError as exc:
            raise CLIError(str(exc)) from None
    return config


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options: one flag per :class:`~edgemoe.config.EngineConfig` field."""
    from edgemoe.config import EngineConfig

    add_config_args(parser, EngineConfig, "engine options")


def _hub_snapshot_hint(p: Path) -> str:
    """Where the model directory is when ``p`` is a Hugging Face hub cache entry (``models--ORG--NAME``,
    whose files are in ``snapshots/<hash>/``) or the hub cache itself; ``""`` otherwise."""
    snapshots = p / "snapshots"
    if snapshots.is_dir():
        found = sorted(s for s in snapshots.iterdir() if (s / "config.json").is_file())
        ref = p / "refs" / "main"
        main = snapshots / ref.read_text().strip() if ref.is_file() else None
        if main is not None and main in found:
            found = [main]
        if found:
            return f"; it is a Hugging Face cache entry: pass its snapshot directory, {str(found[0])!r}"
        return "; it is a Hugging Face cache entry without a downloaded snapshot (snapshots/<hash>/config.json)"
    if any(c.is_dir() and c.name.startswith("models--") for c in p.iterdir()):
        return ("; it is a Hugging Face hub cache: pass one model's snapshot directory, "
                "models--ORG--NAME/snapshots/<hash>/")
    return ""


def _model_dir(path: str) -> str:
    p = Path(path)
    if p.is_file():
        parent = p.parent if (p.parent / "config.json").is_file() else None
        hint = f"; pass the model directory holding it, {str(parent)!r}" if parent is not None else ""
        raise CLIError(f"{path!r} is a file, not a model directory{hint}")
    if not p.is_dir():
        raise CLIError(f"model directory {path!r} does not exist")
    if not (p / "config.json").is_file():
        raise CLIError(f"{path!r} is not a model directory (no config.json){_hub_snapshot_hint(p)}")
    return str(p)


# ---------------------------------------------------------------- subcommands


def _add_record_routing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-routing", metavar="FILE", default=None,
                   help="append every step's routing (phase, position, layer, experts, weights) as JSONL "
                        "(format: edgemoe/bench/trace.py); replay with `edgemoe replay-routing`")


def _recorder(path: str | None):
    """The ``--record-routing`` recorder (``None`` without the flag), opened before the model loads so that a
    path it cannot append to fails at once.

    Raises:
        CLIError: the file cannot be opened for appending (naming the flag and the reason).
    """
    from edgemoe.bench.trace import RoutingRecorder

    if path is None:
        return None
    try:
        return RoutingRecorder(path)
    except OSError as exc:
        raise CLIError(f"--record-routing {path}: {exc.strerror or exc}") from None


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
    config = engine_config_from_args(args, model)
    server_config = config_from_args(args, ServerConfig)
    if server_config.api_key is None and os.environ.get("EDGEMOE_API_KEY"):
        server_config = replace(server_config, api_key=os.environ["EDGEMOE_API_KEY"])
    _check_port(server_config.host, server_config.port)  # before loading weights, which can take minutes
    recorder = _recorder(args.record_routing)  # likewise

    def on_ready(engine) -> None:
        if recorder is not None:
            engine.attach_routing_recorder(recorder)
        print(engine.runner.summary(), flush=True)
        print(f"edgemoe: serving on http://{server_config.host}:{server_config.port}/v1", flush=True)

    from edgemoe.engine.async_engine import EngineNotReadyError

    try:
        serve(model, config, server_config, on_ready=on_ready)
    except EngineNotReadyError as exc:  # the server has stopped: say why in one line
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_chat(args) -> int:
    import openai

    from edgemoe.server.chat_client import run

    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature is not None and not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise CLIError(f"--temperature must be a finite number >= 0, got {args.temperature}")  # as the server says
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
    except openai.APIStatusError as exc:  # e.g. a wrong --api-key (401), a model still loading (503)
        raise CLIError(f"{args.base_url}: {exc.message}") from None


def _cmd_generate(args) -> int:
    from edgemoe.engine.llm import LLM
    from edgemoe.engine.sampling import SamplingParams, SamplingParamsError

    model = _model_dir(args.model)
    config = engine_config_from_args(args, model)
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
    if args.chat_template_kwargs is not None and not args.chat:  # a plain prompt goes through no template
        raise CLIError("--chat-template-kwargs: applies to the chat template, which only --chat uses")
    if args.chat_template_kwargs:
        try:
            template_kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise CLIError(f"--chat-template-kwargs: not valid JSON ({exc})") from None
        if not isinstance(template_kwargs, dict):
            raise CLIError("--chat-template-kwargs: must be a JSON object")
    recorder = _recorder(args.record_routing)  # before loading weights, which can take minutes
    llm = LLM(model, progress=not args.json, **{f.name: getattr(config, f.name) for f in fields(config)})
    if recorder is not None:
        llm.engine.attach_routing_recorder(recorder)
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
    from edgemoe.synth import PRESETS, make_model, write_config_only

    arch = args.arch or next(a for a, presets in PRESETS.items() if args.preset in presets)
    try:
        if args.config_only:
            path = write_config_only(args.out, arch, args.preset, tokenizer=args.tokenizer, dtype=args.dtype,
                                     overwrite=args.overwrite, quant=args.quant)
        else:
            path = make_model(args.out, arch, args.preset, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype,
                              overwrite=args.overwrite, quant=args.quant)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        raise CLIError(str(exc)) from None
    print(path if path is not None else args.out)
    return 0


def _cmd_profile(args) -> int:
    from edgemoe.bench.profile import run_profile
    from edgemoe.experts.bandwidth import format_profile

    model = _model_dir(args.model)
    config = engine_config_from_args(args, model)
    if args.out is not None and Path(args.out).is_dir():  # before measuring, which takes a while
        raise CLIError(f"--out {args.out}: is a directory; give the path of the profile JSON to write")
    result = run_profile(model, config, args.out)
    print(format_profile(result))
    return 0


# ---------------------------------------------------------------- convert, replay-routing


def _cmd_convert(args) -> int:
    from edgemoe.weights.ftw import FORMAT_VERSION, convert, read_manifest

    try:
        path = convert(args.hf_dir, args.out_dir, progress=not args.no_progress, dtype=args.dtype,
                       overwrite=args.overwrite)
    except FileExistsError as e:
        print(f"edgemoe: error: {e}", file=sys.stderr)
        return 2
    man = read_manifest(path)
    print(f"{path}: FTW v{FORMAT_VERSION}, {man.experts.num_rows} {man.layout['format']} experts, "
          f"{man.bank.nbytes / 1e9:.2f} GB of expert rows ({man.bank.row_bytes / 1e6:.2f} MB each) + "
          f"{man.non_expert.nbytes / 1e9:.2f} GB non-expert")
    return 0


def _register_convert(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``edgemoe convert HF_DIR OUT_DIR [--dtype D] [--overwrite] [--no-progress]`` to ``subparsers``
    (``func`` = the handler, returning the exit status)."""
    p = subparsers.add_parser("convert", help="convert a Hugging Face checkpoint to FTW (fast bootstrap)",
                              description="Write expert banks + manifest for direct-I/O bootstrap "
                                          "(edgemoe.weights.ftw).")
    p.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    p.add_argument("out_dir", help="FTW directory to create")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="store float weights in this dtype (default: the checkpoint's; quantized experts keep their "
                        "format, quantized non-expert weights are dequantized into it)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)
    return p


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``replay-routing``."""
    from edgemoe.bench.replay import ALL_POLICIES, DEFAULT_CAPACITIES

    p.add_argument("traces", nargs="+", metavar="TRACE", help="routing trace(s), JSONL (edgemoe or Mixtral format)")
    p.add_argument("--capacity", type=_floats, default=list(DEFAULT_CAPACITIES),
                   help="cache sizes as fractions of all (layer, expert) ids (default 0.05,0.1,0.2,0.37,0.5)")
    p.add_argument("--capacity-slots", type=_ints, default=None, help="cache sizes in slots (overrides --capacity)")
    p.add_argument("--policy", type=_names, default=None,
                   help=f"comma-separated, from {','.join(ALL_POLICIES)} (default: all; static-calib only "
                        "with --calibration, prefill-updated only when the trace has prefill)")
    p.add_argument("--calibration", action="append", default=None, metavar="TRACE",
                   help="trace(s) that static-calib computes its placement from (repeatable)")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="treat the first N tokens of each request of a trace without prefill records as its prompt")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--expert-bytes", type=int, default=None, help="bytes of one expert (for PCIe bytes per token)")
    g.add_argument("--model", default=None, help="model directory whose config.json gives 3*H*I*dtype bytes")
    p.add_argument("--plot", default="routing_replay.png", help="PNG to write (default routing_replay.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--title", default=None, help="plot title")
    p.add_argument("--layer-table-slots", type=int, default=None,
                   help="capacity (slots) of the per-layer hit-rate table (default: the middle capacity)")
    p.add_argument("--json", default=None, help="write every result (per-layer too) as JSON here")
    from edgemoe.bench.steptime import COST_PRESETS

    p.add_argument("--prefetch", action="store_true",
                   help="also replay with next-layer prefetch (traces recorded with predicted experts)")
    p.add_argument("--step-time", choices=sorted(COST_PRESETS), default=None,
                   help="also simulate decode tokens/s of every miss policy (fill-all, cpu-all, static, qstar, "
                        "adaptive, auto) on this machine model")
    p.add_argument("--eviction", default=None, help="eviction rule of the --step-time simulation (a --policy "
                   "name that fills on a miss; default layer-lru, the engine's)")


def _register_replay(subparsers) -> argparse.ArgumentParser:
    """Add ``replay-routing`` to the ``edgemoe`` subcommands (``func`` = :func:`edgemoe.bench.replay.main_replay`)."""
    from edgemoe.bench.replay import main_replay

    p = subparsers.add_parser("replay-routing", help="simulate expert-cache policies over routing traces",
                              description="Replay routing traces through expert-cache policies (no model run).")
    _add_replay_arguments(p)
    p.set_defaults(func=main_replay)
    return p


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``edgemoe`` argument parser (subcommands ``serve``, ``generate``, ``make-model``, ``profile``)."""
    from edgemoe import __version__

    parser = _Parser(prog="edgemoe", description="Serve Mixture-of-Experts LLMs larger than your GPU.")
    parser.add_argument("--version", action="version", version=f"edgemoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", help="model directory")
    from edgemoe.server.config import ServerConfig

    add_config_args(p, ServerConfig, "server options")
    add_engine_args(p)
    _add_record_routing(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("chat", help="terminal chat with a running server (streams, shows reasoning dimmed)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="API key (default $EDGEMOE_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation config")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_CHAT_MAX_TOKENS,
                   help=f"longest reply in tokens (default {DEFAULT_CHAT_MAX_TOKENS})")
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
    from edgemoe.synth import PRESETS

    p.add_argument("--preset", default="tiny", choices=list(dict.fromkeys(  # "tiny" is every arch's: listed once
        name for presets in PRESETS.values() for name in presets)))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="copy this tokenizer directory instead of building one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--config-only", action="store_true", help="config + tokenizer only (use --load-format dummy)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it already holds a model")

    from edgemoe.synth import QUANT_LAYOUTS

    p.add_argument("--quant", default=None, choices=list(QUANT_LAYOUTS),
                   help="write the weights in a released quantized layout: fp8 (block-128, Qwen3/DeepSeek FP8), "
                        "mxfp4 (gpt-oss's fused experts), nvfp4-modelopt, nvfp4-ct (compressed-tensors); with "
                        "--config-only, only its quantization_config (dummy weights of that format)")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("profile", help="measure B_P and B_H for this machine and model")
    p.add_argument("model", help="model directory")
    p.add_argument("--out", default=None, help="where to write the profile JSON")
    add_engine_args(p)
    p.set_defaults(func=_cmd_profile)

    _register_replay(sub)
    _register_convert(sub)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (as logging's last-resort handler)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("edgemoe: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _configure_logging(level: str) -> None:
    """Print the ``edgemoe`` loggers' lines (start-up progress, warnings) on stderr as ``edgemoe: ...``."""
    logger = logging.getLogger("edgemoe")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgemoe`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging("warning" if getattr(args, "json", False) else getattr(args, "log_level", None) or "info")
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ValueError, TypeError) as exc:
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
