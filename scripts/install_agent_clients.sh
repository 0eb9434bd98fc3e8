#!/usr/bin/env bash
# Installs pinned releases of the five coding-agent clients that tests/agents/ drives against
# `edgemoe serve`, into one ignored folder (default: .agent-clients/ at the repository root):
#   npm/     Claude Code, Codex CLI, opencode (npm --prefix; binaries in npm/node_modules/.bin)
#   aider/   a virtualenv holding aider-chat (its pinned dependencies must not meet edgemoe's)
#   llm/     a virtualenv holding llm
# The tests find them there (or on PATH; $EDGEMOE_AGENT_CLIENTS moves the folder). Needs npm and Node.js
# (checked with Node 20: Claude Code's package asks for >= 22, but what it installs is a native binary,
# which runs; Codex starts through a Node launcher) and python3 >= 3.11 with venv. Re-running is cheap:
# installed pins are kept. Measured on the build machine: 2 min 20 s, 1.9 GB.
#
#   scripts/install_agent_clients.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
AIDER_VERSION=0.86.2
LLM_VERSION=0.36

DIR=$(realpath -m "${1:-${EDGEMOE_AGENT_CLIENTS:-.agent-clients}}")
mkdir -p "$DIR"
start=$(date +%s)

export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
npm install --prefix "$DIR/npm" --no-save --loglevel=error \
  "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" "opencode-ai@$OPENCODE_VERSION"

venv() {  # venv NAME REQUIREMENT
  local env="$DIR/$1"
  [ -x "$env/bin/python" ] || python3 -m venv "$env"
  "$env/bin/python" -m pip install -q --disable-pip-version-check "$2"
}
venv aider "aider-chat==$AIDER_VERSION"
venv llm "llm==$LLM_VERSION"

echo "agent clients in $DIR ($(du -sh "$DIR" | cut -f1), $(( $(date +%s) - start )) s):"
"$DIR/npm/node_modules/.bin/claude" --version
"$DIR/npm/node_modules/.bin/codex" --version
echo "opencode $("$DIR/npm/node_modules/.bin/opencode" --version)"
"$DIR/aider/bin/aider" --version
"$DIR/llm/bin/llm" --version
