"""``edgemoe chat``: a terminal chat client for a running edgemoe (or any OpenAI-compatible) server.

Streams each answer as it is generated, showing the model's reasoning dimmed before the answer;
every request carries an output cap (``max_tokens``; ``edgemoe chat --max-tokens``, default 1024),
and a reply cut by it says so. Lines starting with ``/`` are commands, handled here and never sent
to the model (:data:`COMMANDS`: ``/help``, ``/reset``, ``/exit``; an unknown one is reported; a
line starting with ``//`` is sent with one ``/`` removed). A turn the server refuses or does not
answer is reported in one line and left out of the conversation; the chat goes on. Ctrl-C stops the
current answer, Ctrl-D quits. Uses the ``openai`` SDK, and ``rich`` for output when it is installed (plain
ANSI otherwise).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["COMMANDS", "ChatSession", "Output", "main_loop"]

COMMANDS = {
    "/help": "show these commands",
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "quit (also /quit, Ctrl-D)",
}

_DIM, _RESET = "\033[2m", "\033[0m"


class Output:
    """Where the chat writes: reasoning dimmed, answer text plain (``rich`` when available)."""

    def __init__(self, stream: TextIO | None = None, use_rich: bool | None = None):
        self.stream = stream or sys.stdout
        self.console = None
        if use_rich is not False:
            try:
                from rich.console import Console

                self.console = Console(file=self.stream, highlight=False, soft_wrap=True)
            except ImportError:
                self.console = None
        self.color = self.console is not None or self.stream.isatty()

    def _write(self, text: str, style: str | None = None) -> None:
        if self.console is not None:
            self.console.print(text, end="", style=style, markup=False)
        elif style and self.color:
            self.stream.write(f"{_DIM}{text}{_RESET}")
        else:
            self.stream.write(text)
        self.stream.flush()

    def reasoning(self, text: str) -> None:
        self._write(text, "dim italic")

    def content(self, text: str) -> None:
        self._write(text)

    def info(self, text: str) -> None:
        self._write(text + "\n", "dim")


class ChatSession:
    """One conversation with a server through the ``openai`` SDK.

    Args:
        client: an ``openai.OpenAI`` client pointed at the server's ``/v1``.
        model: the served model id.
        system: optional system prompt.
        sampling: extra ``chat.completions.create`` arguments (``temperature``, ``max_tokens`` ...).
    """

    def __init__(self, client: Any, model: str, system: str | None = None, **sampling: Any):
        self.client, self.model, self.system, self.sampling = client, model, system, sampling
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, out: Output) -> str:
        """Send ``text``, stream the reply to ``out``; returns the answer (kept in the history).

        Raises:
            openai.APIError, or a :func:`transport_errors` class: the server refused the request or the
                connection failed (the turn is not kept in the history).
        """
        self.messages.append({"role": "user", "content": text})
        answer, in_reasoning, finish = [], False, None
        try:
            stream = self.client.chat.completions.create(model=self.model, messages=self.messages, stream=True,
                                                         **self.sampling)
        except BaseException:
            self.messages.pop()
            raise
        try:
            for chunk in stream:
                if not chunk.choices:
                    continue
                finish = chunk.choices[0].finish_reason or finish
                delta = chunk.choices[0].delta
                extra = delta.model_extra or {}
                reasoning = extra.get("reasoning_content") or extra.get("reasoning")
                if reasoning:
                    in_reasoning = True
                    out.reasoning(reasoning)
                if delta.content:
                    if in_reasoning:
                        out.content("\n\n")
                        in_reasoning = False
                    answer.append(delta.content)
                    out.content(delta.content)
                for call in delta.tool_calls or []:
                    if call.function and call.function.name:
                        out.info(f"\n[tool call: {call.function.name}]")
        except KeyboardInterrupt:
            out.info("\n[stopped]")
        except BaseException:  # the connection failed mid-answer: the turn is not kept
            self.messages.pop()
            out.content("\n")
            raise
        finally:
            stream.close()
        out.content("\n")
        if finish == "length":
            out.info(f"[reply cut at max_tokens={self.sampling.get('max_tokens', 'the server limit')}: "
                     "`edgemoe chat --max-tokens N` allows more]")
        reply = "".join(answer)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP library's base error class(es) the ``openai`` SDK's client is built on: it wraps a failed
    request in ``openai.APIConnectionError``, but a connection lost while a stream is read reaches the caller
    as the library's own error. ``httpx`` (``openai`` 1.x and 2.x) or ``httpx2`` (later releases); whichever
    of them is installed."""
    import importlib

    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).HTTPError)
        except ImportError:
            continue
    return tuple(found)


def main_loop(session: ChatSession, read: Callable[[str], str], out: Output) -> int:
    """Read lines with ``read(prompt)`` until ``/exit`` or EOF; returns the exit status.

    A line starting with ``/`` is a command (:data:`COMMANDS`), handled here and never sent to the
    model; ``//text`` sends ``/text``. A turn that fails (the server's error, a lost connection) is
    reported as ``[error: ...]`` and the loop goes on.
    """
    import openai

    failures = (openai.APIError, *transport_errors())
    out.info(f"edgemoe chat with {session.model} — /help for commands, /exit to quit")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.content("\n")
            return 0
        except KeyboardInterrupt:
            out.content("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("//"):
            text = text[1:]
        elif text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                session.reset()
                out.info("[conversation reset]")
            elif command == "/help":
                out.info("\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items())
                         + "\n  //text  send a line that starts with /")
            else:
                out.info(f"[unknown command {command}: /help lists the commands; //text sends /text]")
            continue
        try:
            session.ask(text, out)
        except failures as exc:
            out.info(f"[error: {getattr(exc, 'message', None) or exc}]")


def run(base_url: str, model: str | None, api_key: str, system: str | None, **sampling: Any) -> int:
    """Connect to ``base_url`` and chat on the terminal (the model defaults to the server's first)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=1)
    if model is None:
        model = client.models.list().data[0].id
    session = ChatSession(client, model, system, **{k: v for k, v in sampling.items() if v is not None})
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    return main_loop(session, input, Output())
