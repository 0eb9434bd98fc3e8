#!/usr/bin/env bash
# One command from a fresh clone: install edgemoe, build the tiny random-weight Qwen3-MoE model,
# and serve it on http://127.0.0.1:8000 (OpenAI-compatible). Extra arguments go to `edgemoe serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v edgemoe >/dev/null || python3 -m pip install -q -e .
MODEL=${EDGEMOE_DEMO_MODEL:-models/tiny}
[ -f "$MODEL/config.json" ] || edgemoe make-model --arch qwen3_moe --preset tiny --out "$MODEL"
exec edgemoe serve "$MODEL" "$@"
