#!/usr/bin/env bash
# One command from a fresh clone: install edgemoe, build the tiny random-weight Qwen3-MoE model,
# and serve it on http://127.0.0.1:8000 (OpenAI-compatible). Extra arguments go to `edgemoe serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
# install unless python3 already imports edgemoe from this checkout (another install on PATH does not count)
python3 -c 'import edgemoe, os, sys; sys.exit(os.path.dirname(os.path.realpath(edgemoe.__file__)) != os.path.realpath("edgemoe"))' \
  2>/dev/null || python3 -m pip install -q -e .
MODEL=${EDGEMOE_DEMO_MODEL:-models/tiny}
[ -f "$MODEL/config.json" ] || python3 -m edgemoe make-model --arch qwen3_moe --preset tiny --out "$MODEL"
exec python3 -m edgemoe serve "$MODEL" "$@"
