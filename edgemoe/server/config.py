"""HTTP-only options of ``edgemoe serve`` (:class:`ServerConfig`); engine options are ``EngineConfig``.

Every field carries ``metadata`` for the command line: ``help`` (always), and where the default
spelling does not fit, ``flag`` (default ``--`` + the field name with dashes; a bool defaulting to
True is given as ``--no-...``), ``choices`` and ``nargs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgemoe.server.parsers import REASONING_PARSERS, TOOL_PARSERS, check_parser_names

__all__ = ["LOG_LEVELS", "ServerConfig"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP server (all but the engine's).

    Raises:
        ValueError: a value out of range, naming its command-line flag.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    api_key: str | None = field(default=None, metadata={
        "help": "require this key on /v1/ and /admin/ routes (Authorization: Bearer KEY or x-api-key: KEY)"})
    served_model_name: tuple[str, ...] = field(default=(), metadata={
        "help": "model name(s) clients may ask for; the first is the id reported (default: the model "
                "directory's name)", "nargs": "+"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "tool-call format: auto (from the checkpoint), " + ", ".join(TOOL_PARSERS),
        "choices": ("auto", *TOOL_PARSERS)})
    reasoning_parser: str = field(default="auto", metadata={
        "help": "reasoning format: auto (from the checkpoint), " + ", ".join(REASONING_PARSERS),
        "choices": ("auto", *REASONING_PARSERS)})
    log_level: str = field(default="info", metadata={"help": "server log level", "choices": LOG_LEVELS})
    default_max_tokens: int | None = field(default=None, metadata={
        "help": "output cap for requests that set none (default: generation_config.json max_new_tokens, "
                "else 8192)"})
    max_request_bytes: int = field(default=8 * MiB, metadata={
        "help": "largest request body in bytes (413 above it; the text of a 256k-token prompt is ~1 MB, "
                "images and PDFs are omitted for text-only models but travel in the body)"})
    max_messages: int = field(default=10_000, metadata={
        "help": "most messages (or Responses input items) in one request (400 above it)"})
    header_timeout_s: float = field(default=10.0, metadata={
        "help": "seconds a connection has to send a request's headers before it is closed"})
    body_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds a client has to send a request's body once its headers arrived (408 after)"})


    def __post_init__(self):
        check_parser_names(self.tool_call_parser, self.reasoning_parser)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port: must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level: choose one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not isinstance(self.served_model_name, tuple) or not all(
                isinstance(n, str) and n for n in self.served_model_name):
            raise ValueError(f"--served-model-name: non-empty names expected, got {self.served_model_name!r}")
        if self.api_key is not None and not self.api_key.strip():  # `--api-key "$UNSET"` would serve without a key
            raise ValueError("--api-key: empty; give the key, or leave the flag out to serve without one")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens: must be >= 1, got {self.default_max_tokens}")
        for name in ("max_request_bytes", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(self, name)}")
