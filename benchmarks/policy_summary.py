"""One table from the decode benchmark runs of the expert-policy study (``scripts/gpu_check.sh policy``):
for every (regime, CPU threads, budget) each policy's tokens/s, the best fixed policy (``fill-all``,
``cpu-all``, ``static``, ``qstar``) and the ``auto`` policy's ratio to it. ``fill-all`` runs the CPU
executor for nothing, so the benchmark runs it at the first thread count only; its row serves every
thread count of that budget. Runs repeated with ``decode.py --repeats N`` (the policies alternating within a
budget) count by their median, and each row gives the spread of the repeats: the largest ``(max - min) / median``
of one policy's tokens/s in that row, the noise a ratio of that row has to be read against.

    python benchmarks/policy_summary.py OUT/policy    # reads OUT/policy/*/decode.json, writes summary.md/.json

A run folder is named after its regime (e.g. ``realistic``); its ``decode.json`` is
``benchmarks/decode.py``'s output, every result naming its CPU threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

FIXED = ("fill-all", "cpu-all", "static", "qstar")
ORDER = ("qstar", "auto", "fill-all", "cpu-all", "static", "adaptive")


def summarize(root: Path) -> tuple[list[dict], str]:
    """Rows (one per regime, threads, budget) and their markdown table.

    Raises:
        FileNotFoundError: no ``*/decode.json`` under ``root``.
    """
    runs = sorted(root.glob("*/decode.json"))
    if not runs:
        raise FileNotFoundError(f"{root}: no */decode.json (run scripts/gpu_check.sh policy first)")
    rows = []
    for path in runs:
        regime = path.parent.name
        data = json.loads(path.read_text())
        samples: dict[tuple[int, float], dict[str, list[float]]] = {}
        for r in data["results"]:
            if isinstance(r["budget_gb"], (int, float)):
                key = (r["threads"], float(r["budget_gb"]))
                samples.setdefault(key, {}).setdefault(r["policy"], []).append(r["tokens_per_s"])
        groups = {key: {p: statistics.median(v) for p, v in pols.items()} for key, pols in samples.items()}
        for (threads, gb), tps in sorted(groups.items()):
            spread = max(((max(v) - min(v)) / statistics.median(v) for v in samples[threads, gb].values()
                          if len(v) > 1), default=None)
            for (_, gb2), other in groups.items():  # fill-all uses no CPU threads: decode.py runs it once
                if gb2 == gb and "fill-all" in other:
                    tps.setdefault("fill-all", other["fill-all"])
            fixed = {p: tps[p] for p in FIXED if p in tps}
            best = max(fixed, key=fixed.get) if fixed else None
            rows.append({"regime": regime, "threads": threads, "budget_gb": gb,
                         "tokens_per_s": tps, "best_fixed": best, "spread": spread,
                         "repeats": max(len(v) for v in samples[threads, gb].values()),
                         "auto_ratio": tps["auto"] / fixed[best] if best and "auto" in tps else None})
    policies = [p for p in ORDER if any(p in r["tokens_per_s"] for r in rows)]
    lines = ["| regime | threads | budget (GB) | " + " | ".join(policies)
             + " | best fixed | auto / best fixed | repeats | spread |",
             "|---|---|---|" + "---|" * len(policies) + "---|---|---|---|"]
    for r in rows:
        cells = [f"{r['tokens_per_s'][p]:.1f}" if p in r["tokens_per_s"] else "-" for p in policies]
        ratio = "-" if r["auto_ratio"] is None else f"{r['auto_ratio']:.3f}"
        spread = "-" if r["spread"] is None else f"{r['spread']:.3f}"
        lines.append(f"| {r['regime']} | {r['threads']} | {r['budget_gb']:g} | " + " | ".join(cells)
                     + f" | {r['best_fixed'] or '-'} | {ratio} | {r['repeats']} | {spread} |")
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="folder holding <regime>/decode.json")
    a = ap.parse_args(argv)
    root = Path(a.root)
    try:
        rows, table = summarize(root)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    (root / "summary.md").write_text(table + "\n")
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
