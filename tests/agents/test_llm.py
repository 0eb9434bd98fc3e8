"""Simon Willison's ``llm`` runs a three-turn tool chain against edgemoe, through its OpenAI Chat
Completions and Responses model classes: the model calls a ``--functions`` tool that writes a file,
one that reads it back, then answers."""

from __future__ import annotations

import pytest
from harness import MODEL, find_client, model_dir, save_requests, serve, tool_call, tool_results

CONTENT = "hello from edgemoe\n"
FINAL = "Done: hello.txt holds the greeting."
OUTPUT_CAP = 256
ASK = "Write hello.txt with a greeting, then read it back."
TOOLS = '''
def write_file(path: str, content: str) -> str:
    """Write content to the file at path."""
    with open(path, "w") as f:
        f.write(content)
    return f"wrote {len(content)} characters to {path}"


def read_file(path: str) -> str:
    """Return the text of the file at path."""
    with open(path) as f:
        return f.read()
'''
# the model ids of extra-openai-models.yaml -> the route each calls
MODELS = {"edgemoe-chat": "/v1/chat/completions", "edgemoe-responses": "/v1/responses"}


def llm_models(base: str) -> str:
    """``extra-openai-models.yaml``: the served model as a Chat Completions and a Responses model."""
    return f"""- model_id: edgemoe-chat
  model_name: {MODEL}
  api_base: {base}/v1
  supports_tools: true
  supports_schema: true
- model_id: edgemoe-responses
  model_name: {MODEL}
  api_base: {base}/v1
  responses: true
  supports_tools: true
  supports_schema: true
"""


@pytest.fixture(scope="module", params=list(MODELS))
def session(request, tmp_path_factory):
    llm = find_client("llm")
    with serve(model_dir(tmp_path_factory), tmp_path_factory.mktemp(request.param)) as server:
        user_dir = server.home / "llm"
        user_dir.mkdir()
        (user_dir / "extra-openai-models.yaml").write_text(llm_models(server.base))
        (server.workdir / "tools.py").write_text(TOOLS)
        turns = [tool_call("write_file", {"path": "hello.txt", "content": CONTENT}),
                 tool_call("read_file", {"path": "hello.txt"}), FINAL]
        server.scripts.rule = lambda prompt: turns[min(tool_results(prompt), 2)]
        env = server.env(LLM_USER_PATH=str(user_dir))
        run = server.run([llm, "-m", request.param, "--functions", "tools.py", "--td",
                          "-o", "max_tokens", str(OUTPUT_CAP), ASK], env)
        save_requests(server, request.param.replace("edgemoe", "llm"), llm, env)
        yield server, run, MODELS[request.param]


def test_session(session):
    server, run, route = session
    assert (server.workdir / "hello.txt").read_text() == CONTENT, server.explain(run)
    server.assert_ok(run, FINAL)
    calls = server.recorder.api_calls(route)
    assert len(calls) == 3, server.explain(run)
    assert CONTENT.strip() in str(calls[2].body), server.explain(run)  # read_file's result went back
    assert {e.body.get("max_tokens") or e.body.get("max_output_tokens") for e in calls} == {OUTPUT_CAP}
