"""Claude Code (``claude -p``, Anthropic Messages API) runs a three-turn session against edgemoe:
the model writes a file with the ``Write`` tool, reads it back with ``Bash``, then answers."""

from __future__ import annotations

import json

import pytest
from harness import MODEL, find_client, model_dir, save_requests, serve, tool_call, tool_results

CONTENT = "hello from edgemoe\n"
FINAL = "Done: hello.txt holds the greeting."
OUTPUT_CAP = 2048


def claude_env(server) -> dict[str, str]:
    """Claude Code pointed at edgemoe (every model tier mapped to the served name), with every
    non-essential connection (telemetry, error reports, auto-update, surveys) off."""
    return server.env(
        ANTHROPIC_BASE_URL=server.base,
        ANTHROPIC_AUTH_TOKEN="edgemoe-test",
        ANTHROPIC_MODEL=MODEL,
        ANTHROPIC_DEFAULT_OPUS_MODEL=MODEL,
        ANTHROPIC_DEFAULT_SONNET_MODEL=MODEL,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL,
        CLAUDE_CODE_SUBAGENT_MODEL=MODEL,
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(OUTPUT_CAP),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
    )


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    claude = find_client("claude")
    with serve(model_dir(tmp_path_factory), tmp_path_factory.mktemp("claude-code")) as server:
        target = server.workdir / "hello.txt"
        turns = [
            "<think>\nThe user wants a file. I will write it.\n</think>\n\n"
            + tool_call("Write", {"file_path": str(target), "content": CONTENT}),
            tool_call("Bash", {"command": "cat hello.txt", "description": "Show hello.txt"}),
            FINAL,
        ]
        server.scripts.rule = lambda prompt: turns[min(tool_results(prompt), 2)] if "<tools>" in prompt else "OK"
        env = claude_env(server)
        # --tools: the built-in tools offered (the default set is ~32 kB of schemas, which the tiny
        # model's tokenizer makes a 60 s prefill on 2 cores; the default set was checked by hand)
        run = server.run([claude, "-p", "Write hello.txt with a greeting, then show it.", "--output-format", "text",
                          "--tools", "Bash,Read,Write", "--permission-mode", "acceptEdits",
                          "--allowedTools", "Bash(cat:*)"], env)
        save_requests(server, "claude-code", claude, env)
        yield server, run


def test_session(session):
    server, run = session
    assert (server.workdir / "hello.txt").read_text() == CONTENT, server.explain(run)
    assert run.returncode == 0 and FINAL in run.stdout, server.explain(run)
    turns = [e for e in server.recorder.api_calls("/v1/messages") if e.status == 200]
    assert len(turns) == 3, server.explain(run)
    # each tool's result went back to the model: the Bash turn carries the file's text
    results = [b for b in turns[2].body["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert CONTENT.strip() in json.dumps(results), server.explain(run)
    assert {e.body["max_tokens"] for e in turns} == {OUTPUT_CAP}
    assert {e.body["model"] for e in turns} == {MODEL}


def test_every_request_accepted(session):
    server, run = session
    server.assert_ok(run, FINAL)
