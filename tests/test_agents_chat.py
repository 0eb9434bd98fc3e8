"""``edgemoe chat``: the terminal client against a real server (recorded Qwen3 outputs replayed)."""

from __future__ import annotations

import io

from test_agents_openai import MODEL, TURN3

from edgemoe.cli import main
from edgemoe.server.chat_client import ChatSession, Output, main_loop

ANSWER = "In Paris it is 18 °C and the local time is 14:05."


def _lines(*lines):
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_chat_session_streams_reasoning_dimmed_and_resets(qwen_agent_server):
    srv = qwen_agent_server
    srv.scripts.push(TURN3, TURN3)
    buf = io.StringIO()
    session = ChatSession(srv.openai(), MODEL, system="Be brief.", temperature=0)
    lines = _lines("Weather?", "", "/reset", "Again?", "/exit", "never read")
    assert main_loop(session, lines, Output(buf, use_rich=False)) == 0
    text = buf.getvalue()
    assert text.count("I have both answers.") == 2 and text.count(ANSWER) == 2
    assert text.index("I have both answers.") < text.index(ANSWER)
    assert "[conversation reset]" in text
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]  # reset kept only the system prompt
    assert session.messages[-1]["content"] == ANSWER

    # On a terminal the reasoning is dimmed (ANSI), the answer is not.
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    srv.scripts.push(TURN3)
    ChatSession(srv.openai(), MODEL).ask("hi", Output(tty, use_rich=False))
    dimmed, answer = tty.getvalue().split("\n\n", 1)
    assert dimmed.replace("\033[0m\033[2m", "") == "\033[2mI have both answers.\033[0m"  # one dim span per delta
    assert answer == ANSWER + "\n"
    srv.wait_idle()


def test_edgemoe_chat_command(qwen_agent_server, monkeypatch, capsys):
    srv = qwen_agent_server
    srv.scripts.push(TURN3)
    monkeypatch.setattr("builtins.input", _lines("hello", "/exit"))
    assert main(["chat", "--base-url", srv.base + "/v1", "--temperature", "0"]) == 0  # model: the server's first
    out = capsys.readouterr().out
    assert f"edgemoe chat with {MODEL}" in out and ANSWER in out
    assert main(["chat", "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert "no server at http://127.0.0.1:9/v1" in capsys.readouterr().err
    srv.wait_idle()
