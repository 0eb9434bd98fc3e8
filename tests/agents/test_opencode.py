"""opencode (``opencode run``) runs a three-turn session against edgemoe through each of its three
AI SDK providers: Chat Completions (``@ai-sdk/openai-compatible``), Anthropic Messages
(``@ai-sdk/anthropic``) and OpenAI Responses (``@ai-sdk/openai``). The model writes a file with
opencode's ``write`` tool, reads it back with ``bash``, then answers; opencode's title request (no
tools) runs alongside."""

from __future__ import annotations

import json

import pytest
from harness import MAX_MODEL_LEN, MODEL, find_client, model_dir, save_requests, serve, tool_call, tool_results

CONTENT = "hello from edgemoe\n"
FINAL = "Done: hello.txt holds the greeting."
OUTPUT_CAP = 2048
# provider package -> the route it calls
PROVIDERS = {
    "chat": ("@ai-sdk/openai-compatible", "/v1/chat/completions"),
    "anthropic": ("@ai-sdk/anthropic", "/v1/messages"),
    "responses": ("@ai-sdk/openai", "/v1/responses"),
}


def opencode_config(base: str, package: str) -> dict:
    """``opencode.json``: edgemoe as a provider, with a context and output limit."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "edgemoe": {
                "npm": package,
                "name": "edgemoe",
                "options": {"baseURL": f"{base}/v1", "apiKey": "{env:EDGEMOE_API_KEY}"},
                "models": {MODEL: {"name": "edgemoe tiny", "limit": {"context": MAX_MODEL_LEN, "output": OUTPUT_CAP}}},
            }
        },
        "model": f"edgemoe/{MODEL}",
    }


def opencode_env(server) -> dict[str, str]:
    """opencode with its models.dev catalog fetch, auto-update, sharing, default plugins, LSP
    downloads and the reading of Claude Code's files off."""
    return server.env(
        EDGEMOE_API_KEY="edgemoe-test",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",
        OPENCODE_DISABLE_EXTERNAL_SKILLS="1",
    )


@pytest.fixture(scope="module", params=list(PROVIDERS))
def session(request, tmp_path_factory):
    opencode = find_client("opencode")
    package, route = PROVIDERS[request.param]
    with serve(model_dir(tmp_path_factory), tmp_path_factory.mktemp(f"opencode-{request.param}")) as server:
        config_dir = server.home / ".config/opencode"
        config_dir.mkdir(parents=True)
        (config_dir / "opencode.json").write_text(json.dumps(opencode_config(server.base, package), indent=1))
        turns = [
            "<think>\nThe user wants a new file.\n</think>\n\n"
            + tool_call("write", {"filePath": str(server.workdir / "hello.txt"), "content": CONTENT}),
            tool_call("bash", {"command": "cat hello.txt", "description": "Show hello.txt"}),
            FINAL,
        ]
        server.scripts.rule = lambda prompt: turns[min(tool_results(prompt), 2)] if "<tools>" in prompt else "Greeting"
        env = opencode_env(server)
        run = server.run([opencode, "run", "Write hello.txt with a greeting, then show it."], env)
        save_requests(server, f"opencode-{request.param}", opencode, env)
        yield server, run, route


def test_session(session):
    server, run, route = session
    assert (server.workdir / "hello.txt").read_text() == CONTENT, server.explain(run)
    server.assert_ok(run, FINAL)
    calls = server.recorder.api_calls(route)
    turns = [e for e in calls if e.body.get("tools")]
    assert len(turns) == 3 and len(calls) == 4, server.explain(run)  # and the title request
    assert CONTENT.strip() in json.dumps(turns[2].body), server.explain(run)  # the bash output went back
    caps = {e.body.get("max_tokens") or e.body.get("max_output_tokens") for e in calls}
    assert caps == {OUTPUT_CAP}
