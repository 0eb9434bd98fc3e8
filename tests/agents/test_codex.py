"""Codex CLI (``codex exec``, OpenAI Responses API) runs a three-turn session against edgemoe: the
model adds a file with ``apply_patch`` through Codex's ``exec_command`` tool, reads it back with
``cat``, then answers."""

from __future__ import annotations

import pytest
from harness import (
    MAX_MODEL_LEN,
    MODEL,
    find_client,
    model_dir,
    offered_tools,
    save_requests,
    serve,
    tool_call,
    tool_results,
)

CONTENT = "hello from edgemoe\n"
FINAL = "Done: hello.txt holds the greeting."
THINK = "<think>\nThe user wants a new file: a patch adds it.\n</think>\n\n"
PATCH = "apply_patch <<'EOF'\n*** Begin Patch\n*** Add File: hello.txt\n+hello from edgemoe\n*** End Patch\nEOF"


def codex_config(base: str) -> str:
    """``config.toml`` for edgemoe: a Responses provider; the update check, analytics (OTLP metrics to
    ab.chatgpt.com) and the plugin sync (github.com, chatgpt.com) off; no hosted web search."""
    return f'''model = "{MODEL}"
model_provider = "edgemoe"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false

[model_providers.edgemoe]
name = "edgemoe"
base_url = "{base}/v1"
env_key = "EDGEMOE_API_KEY"
wire_api = "responses"
'''


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    codex = find_client("codex")
    with serve(model_dir(tmp_path_factory), tmp_path_factory.mktemp("codex")) as server:
        codex_home = server.home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(codex_config(server.base))
        turns = [THINK + tool_call("exec_command", {"cmd": PATCH}), tool_call("exec_command", {"cmd": "cat hello.txt"}),
                 FINAL]
        server.scripts.rule = lambda prompt: turns[min(tool_results(prompt), 2)] if "<tools>" in prompt else "OK"
        env = server.env(CODEX_HOME=str(codex_home), EDGEMOE_API_KEY="edgemoe-test")
        run = server.run([codex, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write",
                          "Create hello.txt with a greeting, then show it."], env)
        save_requests(server, "codex", codex, env)
        yield server, run


def test_session(session):
    server, run = session
    assert (server.workdir / "hello.txt").read_text() == CONTENT, server.explain(run)
    server.assert_ok(run, FINAL)
    turns = server.recorder.api_calls("/v1/responses")
    assert len(turns) == 3, server.explain(run)
    outputs = [item for item in turns[2].body["input"] if item.get("type") == "function_call_output"]
    assert len(outputs) == 2 and CONTENT.strip() in str(outputs[1]["output"]), server.explain(run)
    # the first turn's reasoning went back as a reasoning item
    reasoning = [item for item in turns[1].body["input"] if item.get("type") == "reasoning"]
    assert [c["text"] for item in reasoning for c in item["content"]] == ["The user wants a new file: a patch adds it."]
    assert {e.body["model"] for e in turns} == {MODEL}


def test_namespace_tools_offered(session):
    server, _ = session
    namespaces = [t for t in server.recorder.api_calls("/v1/responses")[0].body["tools"] if t["type"] == "namespace"]
    assert namespaces, "Codex sent no namespace tool"
    offered = offered_tools(server.scripts.seen[0].prompt)
    missing = [t["name"] for ns in namespaces for t in ns["tools"]
               if not any(name == t["name"] or name.endswith(t["name"]) for name in offered)]
    assert not missing, f"not offered to the model: {missing}; offered: {offered}"


def test_default_output_cap(session):
    server, _ = session
    assert "max_output_tokens" not in server.recorder.api_calls("/v1/responses")[0].body
    for seen in server.scripts.seen:
        assert seen.max_tokens < MAX_MODEL_LEN - seen.prompt_tokens, seen.max_tokens
