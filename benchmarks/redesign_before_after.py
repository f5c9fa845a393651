"""The core redesign before and after, measured in one session.

Runs ``benchmarks/transform_overhead.py`` of the old tree with the old and the new
``jaxsched`` on the import path, alternately (old, new, old, new), and compares each
strategy's compile and step ratios against the plain step of the same run:

    git worktree add /tmp/old d2f507f
    .venv/bin/python benchmarks/redesign_before_after.py --old /tmp/old --rounds 2

Writes ``benchmarks/results/redesign_before_after.json``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(tree: Path, script: Path, out: Path, steps: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(
        [sys.executable, str(script), "--steps", str(steps), "--repeats", str(repeats), "--out", str(out)],
        env=env,
        check=True,
        capture_output=True,
    )
    return json.loads(out.read_text())


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    keys = [(r["model"], r["devices"], r["strategy"]) for r in runs["old"][0]["rows"]]
    for key in keys:
        entry = {"model": key[0], "devices": key[1], "strategy": key[2]}
        for tree, results in runs.items():
            found = [
                next(r for r in res["rows"] if (r["model"], r["devices"], r["strategy"]) == key) for res in results
            ]
            entry[f"{tree}_step_ratio"] = [f["step_ratio"] for f in found]
            entry[f"{tree}_compile_ratio"] = [f["compile_ratio"] for f in found]
            entry[f"{tree}_step_ms"] = [1e3 * f["step_s"] for f in found]
        rows.append(entry)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="a checkout of the tree before the redesign")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/redesign_before_after.json"))
    parser.add_argument("--from-json", nargs="*", help="old1 new1 old2 new2 ...: reuse runs made already")
    args = parser.parse_args()
    old = Path(args.old).resolve()
    script = old / "benchmarks" / "transform_overhead.py"  # one script for both trees
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    if args.from_json:
        for k, path in enumerate(args.from_json):
            runs["old" if k % 2 == 0 else "new"].append(json.loads(Path(path).read_text()))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for tree, path in (("old", old), ("new", ROOT)):
                    runs[tree].append(run(path, script, Path(tmp) / f"{tree}{r}.json", args.steps, args.repeats))
    rows = compare(runs)
    print(f"{'model':>18} {'dev':>3} {'strategy':>9} | step x plain old -> new | compile x plain old -> new")
    for r in rows:
        step = " ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(r["old_step_ratio"], r["new_step_ratio"]))
        comp = " ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(r["old_compile_ratio"], r["new_compile_ratio"]))
        print(f"{r['model']:>18} {r['devices']:>3} {r['strategy']:>9} | {step} | {comp}")
    moves = [
        abs(statistics.mean(r["new_step_ratio"]) - statistics.mean(r["old_step_ratio"]))
        for r in rows
        if r["strategy"] != "allreduce"
    ]
    noise = [
        abs(a - b)
        for r in rows
        if r["strategy"] != "allreduce"
        for a, b in [(r["old_step_ratio"][0], r["old_step_ratio"][-1])]
    ]
    worst_compile = max(max(r["new_compile_ratio"]) for r in rows)
    summary = {
        "largest_step_ratio_move": max(moves),
        "old_run_to_run_step_ratio_noise": max(noise),
        "worst_new_compile_ratio": worst_compile,
        "rows": rows,
    }
    print(
        f"largest move of a mean step ratio: {max(moves):.2f}; the old tree's own run-to-run move: "
        f"{max(noise):.2f}; worst compile ratio after: {worst_compile:.2f}"
    )
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
