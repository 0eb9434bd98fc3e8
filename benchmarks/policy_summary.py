"""One table from the decode benchmark runs of the expert-policy study (``scripts/gpu_check.sh policy``):
for every (regime, CPU threads, budget) each policy's tokens/s, the best fixed policy (``fill-all``,
``cpu-all``, ``static``, ``qstar``) and the ``auto`` policy's ratio to it (and each variant's, e.g. ``auto/graded``:
``auto`` run again with another join count, ``decode.py --join-lateness yes-no,graded``); any other run of the
folder, e.g. ``decode.py --fill-shares``' ``share S``, gets a column of its own after the policies. ``fill-all``
runs the CPU executor for nothing, so the benchmark runs it at the first thread count only; its row serves every
thread count of that budget. Runs repeated with ``decode.py --repeats N`` (the policies alternating within a
budget) count by their median, and each row gives the spread of the repeats: the largest ``(max - min) / median``
of one policy's tokens/s in that row, the noise a ratio of that row has to be read against.

    python benchmarks/policy_summary.py OUT/policy    # reads OUT/policy/*/decode.json, writes summary.md/.json

A run folder is named after its regime (e.g. ``realistic``); its ``decode.json`` is
``benchmarks/decode.py``'s output, every result naming its CPU threads. A folder ``REGIME@TREE`` holds another
source tree's runs of the same regime (a before/after on one machine); where it ran no fixed policy (only ``auto``),
its ratio is to the best fixed policy of folder ``REGIME`` at the same threads and budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

FIXED = ("fill-all", "cpu-all", "static", "qstar")
ORDER = ("qstar", "auto", "fill-all", "cpu-all", "static", "adaptive")


def _samples(path: Path) -> dict[tuple[int, float], dict[str, list[float]]]:
    """``{(threads, budget_gb): {policy: [tokens/s of each repeat]}}`` of one run folder's ``decode.json``."""
    samples: dict[tuple[int, float], dict[str, list[float]]] = {}
    for r in json.loads(path.read_text())["results"]:
        if isinstance(r["budget_gb"], (int, float)):
            key = (r["threads"], float(r["budget_gb"]))
            samples.setdefault(key, {}).setdefault(r["policy"], []).append(r["tokens_per_s"])
    return samples


def _medians(samples: dict[tuple[int, float], dict[str, list[float]]]) -> dict[tuple[int, float], dict[str, float]]:
    """Each policy's median tokens/s per ``(threads, budget_gb)`` of one run folder's :func:`_samples`."""
    return {key: {p: statistics.median(v) for p, v in pols.items()} for key, pols in samples.items()}


def _row(groups: dict[tuple[int, float], dict[str, float]], threads: int, gb: float) -> dict[str, float]:
    """One row's tokens/s per policy; ``fill-all`` (no CPU threads: ``decode.py`` runs it once a budget) from
    whichever thread count of the same budget ran it."""
    tps = dict(groups.get((threads, gb), {}))
    for (_, gb2), other in groups.items():
        if gb2 == gb and "fill-all" in other:
            tps.setdefault("fill-all", other["fill-all"])
    return tps


def summarize(root: Path) -> tuple[list[dict], str]:
    """Rows (one per regime, threads, budget) and their markdown table.

    Raises:
        FileNotFoundError: no ``*/decode.json`` under ``root``.
    """
    runs = sorted(root.glob("*/decode.json"))
    if not runs:
        raise FileNotFoundError(f"{root}: no */decode.json (run scripts/gpu_check.sh policy first)")
    rows = []
    by_folder = {path.parent.name: _samples(path) for path in runs}
    medians = {name: _medians(samples) for name, samples in by_folder.items()}
    for regime, samples in by_folder.items():
        groups = medians[regime]
        home = medians.get(regime.split("@")[0], {})  # the regime's own folder: fixed policies for a tree's auto
        for threads, gb in sorted(groups):
            spread = max(((max(v) - min(v)) / statistics.median(v) for v in samples[threads, gb].values()
                          if len(v) > 1), default=None)
            tps = _row(groups, threads, gb)
            fixed = {p: tps[p] for p in FIXED if p in tps}
            if not fixed:
                theirs = _row(home, threads, gb)
                fixed = {p: theirs[p] for p in FIXED if p in theirs}
            best = max(fixed, key=fixed.get) if fixed else None
            ratios = {p: v / fixed[best] for p, v in tps.items() if best and p.split("/")[0] == "auto"}
            rows.append({"regime": regime, "threads": threads, "budget_gb": gb,
                         "tokens_per_s": tps, "best_fixed": best, "spread": spread,
                         "repeats": max(len(v) for v in samples[threads, gb].values()),
                         "auto_ratio": ratios.get("auto"), "ratios": ratios})
    names = {p for r in rows for p in r["tokens_per_s"]}
    policies = [v for p in ORDER for v in sorted(names) if v.split("/")[0] == p]  # a variant after its policy
    policies += sorted(names - set(policies))  # any other run, e.g. decode.py --fill-shares' "share S"
    autos = [p for p in policies if p.split("/")[0] == "auto"]
    lines = ["| regime | threads | budget (GB) | " + " | ".join(policies) + " | best fixed | "
             + "".join(f"{p} / best fixed | " for p in autos) + "repeats | spread |",
             "|---|---|---|" + "---|" * (len(policies) + len(autos)) + "---|---|---|"]
    for r in rows:
        cells = [f"{r['tokens_per_s'][p]:.1f}" if p in r["tokens_per_s"] else "-" for p in policies]
        ratios = [f"{r['ratios'][p]:.3f}" if p in r["ratios"] else "-" for p in autos]
        spread = "-" if r["spread"] is None else f"{r['spread']:.3f}"
        lines.append(f"| {r['regime']} | {r['threads']} | {r['budget_gb']:g} | " + " | ".join(cells)
                     + f" | {r['best_fixed'] or '-'} | " + "".join(f"{x} | " for x in ratios)
                     + f"{r['repeats']} | {spread} |")
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
