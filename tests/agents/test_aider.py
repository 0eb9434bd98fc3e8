"""aider (``aider --message``, Chat Completions through litellm) edits a file against edgemoe in two
turns: the model rewrites ``hello.txt`` in aider's ``whole`` edit format, then, in a second run that
restores the chat history, appends a line with a ``diff`` (SEARCH/REPLACE) edit. aider has no tool
calls; its edits are parsed from the reply's text."""

from __future__ import annotations

import json

import pytest
from harness import MAX_MODEL_LEN, MODEL, find_client, model_dir, save_requests, serve

OUTPUT_CAP = 2048
ASK_WHOLE = "Replace the text of hello.txt with a greeting."
ASK_DIFF = "Add a second line to hello.txt."
WHOLE = "I will replace the file's text.\n\nhello.txt\n```\nhello from edgemoe\n```\n"
DIFF = ("I will append a line.\n\nhello.txt\n```\n<<<<<<< SEARCH\nhello from edgemoe\n=======\nhello from edgemoe\n"
        "second line\n>>>>>>> REPLACE\n```\n")


def aider_settings() -> tuple[str, str]:
    """``.aider.model.settings.yml`` (the output cap, sent as ``max_tokens``) and
    ``.aider.model.metadata.json`` (context window, zero cost: without it aider downloads litellm's
    model catalog from raw.githubusercontent.com) for the served model."""
    settings = f"- name: openai/{MODEL}\n  edit_format: whole\n  extra_params:\n    max_tokens: {OUTPUT_CAP}\n"
    metadata = {f"openai/{MODEL}": {"max_input_tokens": MAX_MODEL_LEN, "max_output_tokens": OUTPUT_CAP,
                                    "input_cost_per_token": 0, "output_cost_per_token": 0,
                                    "litellm_provider": "openai", "mode": "chat"}}
    return settings, json.dumps(metadata, indent=1)


def reply(prompt: str) -> str:
    """The scripted reply to the last user message of aider's request."""
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if ASK_DIFF in last:
        return DIFF
    if ASK_WHOLE in last:
        return WHOLE
    raise AssertionError(f"unexpected aider request: {last[:300]!r}")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    aider = find_client("aider")
    with serve(model_dir(tmp_path_factory), tmp_path_factory.mktemp("aider")) as server:
        settings, metadata = aider_settings()
        (server.home / ".aider.model.settings.yml").write_text(settings)
        (server.home / ".aider.model.metadata.json").write_text(metadata)
        (server.workdir / "hello.txt").write_text("old text\n")
        server.scripts.rule = reply
        env = server.env(OPENAI_API_BASE=f"{server.base}/v1", OPENAI_API_KEY="edgemoe-test",
                         LITELLM_LOCAL_MODEL_COST_MAP="True")
        common = [aider, "--model", f"openai/{MODEL}", "--yes-always", "--no-git", "--no-analytics",
                  "--no-check-update", "--no-show-release-notes", "--no-pretty"]
        first = server.run([*common, "--message", ASK_WHOLE, "hello.txt"], env)
        after_first = (server.workdir / "hello.txt").read_text()
        second = server.run([*common, "--edit-format", "diff", "--restore-chat-history", "--message", ASK_DIFF,
                             "hello.txt"], env)
        save_requests(server, "aider", aider, env)
        yield server, first, after_first, second


def test_session(session):
    server, first, after_first, second = session
    assert first.returncode == 0 and "Applied edit to hello.txt" in first.stdout, server.explain(first)
    assert after_first == "hello from edgemoe\n", server.explain(first)
    assert second.returncode == 0 and "Applied edit to hello.txt" in second.stdout, server.explain(second)
    assert (server.workdir / "hello.txt").read_text() == "hello from edgemoe\nsecond line\n", server.explain(second)
    calls = server.recorder.api_calls("/v1/chat/completions")
    assert len(calls) == 2 and all(e.status == 200 for e in calls), server.explain(second)
    # the second run sent the first turn back (restored history): the user's ask and the whole-file reply
    history = json.dumps(calls[1].body["messages"])
    assert ASK_WHOLE in history and "hello from edgemoe" in history, server.explain(second)
    assert {e.body.get("max_tokens") for e in calls} == {OUTPUT_CAP}
