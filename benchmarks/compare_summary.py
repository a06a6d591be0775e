"""The table of a ``gpu_suite.sh compare`` run with ``COMPARE=flash``: for each staged tree and pass, the decode step's
replay-to-replay time, the working tree's ("this", run first in each pass) divided by it (above 1: this tree is
slower), the graph's and the outputs' copy's parts of it, and each frontier's decode and prefill tokens/s; the rows
come from the ``flash_<tree>[_pass<k>].json`` files ``flash_full.py --timeline`` wrote. gpu_suite.sh prints it at
the end of the call, so the call's output carries the ratios (the JSON files come back with it).

    python benchmarks/compare_summary.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"flash_(?P<tree>.+?)(?:_pass(?P<k>\d+))?\.json$")


def runs(folder: Path) -> list[dict]:
    """One dict a file: tree, pass (1 for a file without ``_pass<k>``), the timeline's medians (ms) and the rows,
    in the order gpu_suite.sh ran them ("this" first in each pass, then the trees by name)."""
    out = []
    for path in folder.glob("flash_*.json"):
        m = NAME.match(path.name)
        data = json.loads(path.read_text())
        out.append({"tree": m["tree"], "pass": int(m["k"] or 1), "timeline": data.get("timeline_ms") or {},
                    "rows": data.get("rows", []), "layers": data.get("layers")})
    return sorted(out, key=lambda r: (r["pass"], r["tree"] != "this", r["tree"]))


def table(folder: Path) -> str:
    """The markdown table of :func:`runs`, with "this"'s step over each other tree's of the same pass (none where a
    timeline is missing: a run without ``--timeline``)."""
    rows = runs(folder)
    if not rows:
        raise SystemExit(f"no flash_*.json in {folder}: was COMPARE=flash run with --timeline?")
    frontiers = sorted({r["ctx"] for run in rows for r in run["rows"]})
    head = ["tree", "pass", "layers", "replay to replay ms", "this / tree", "graph ms", "copy_out ms",
            *(f"decode / prefill t/s at {c}" for c in frontiers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    this = {run["pass"]: run["timeline"].get("replay_to_replay") for run in rows if run["tree"] == "this"}
    for run in rows:
        step, base = run["timeline"].get("replay_to_replay"), this.get(run["pass"])
        ratio = f"{base / step:.3f}" if step and base and run["tree"] != "this" else ""
        by_ctx = {r["ctx"]: r for r in run["rows"]}
        cells = [f"{by_ctx[c]['gen_tps']:.1f} / {by_ctx[c]['prefill_tps']:,.0f}" if c in by_ctx else ""
                 for c in frontiers]
        ms = [f"{run['timeline'][k]:.3f}" if k in run["timeline"] else "" for k in
              ("replay_to_replay", "graph", "copy_out")]
        lines.append("| " + " | ".join([run["tree"], str(run["pass"]), str(run["layers"] or ""), ms[0], ratio, *ms[1:],
                                         *cells]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="gpu_suite.sh's $OUT")
    print(table(p.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
