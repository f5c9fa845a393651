"""`jaxsched bench` end to end on loopback (2 processes): the report's shape, the Gantt
chart written where asked (never into the committed results unless --save), and bad
options refused in one line before any work. Speed is not asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_reports_every_strategy(tmp_path):
    out, png, results = tmp_path / "out.json", tmp_path / "gantt.png", tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "jaxsched", "bench", "--no-cluster", "--hosts", "2", "--steps", "2",
         "--depth", "3", "--width", "32", "--batch", "16", "--strategies", "allreduce,wfbp",
         "--json", str(out), "--png", str(png), "--out", str(results), "--timeout", "300"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"compute_s", "comm_s", "bound_s", "ceiling_s", "strategies"} <= report.keys()
    assert report["ceiling_s"] > 0 and report["comm_tree_s"] > 0
    assert report["layers"]["depth"] == 3 and report["layers"]["width"] == 32
    for name in ("allreduce", "wfbp"):
        row = report["strategies"][name]
        assert row["step_s"] > 0 and row["speedup"] > 0
        assert row["ratio_to_ceiling"] == pytest.approx(row["step_s"] / report["ceiling_s"])
        assert row["max_loss_gap_to_plain"] < 1e-4   # the host engine computes the plain step
    assert "3x32 tanh MLP" in done.stdout
    assert png.stat().st_size > 10_000
    assert [p.name for p in results.iterdir()] == ["overlap.jsonl"]


@pytest.mark.parametrize("argv,message", [
    (["--strategies", "allreduce,deer"], "'deer' is unknown"),
    (["--steps", "-1"], "-1 must be positive"),
    (["--hosts", "1"], "at least 2"),
    (["--compression", "zip"], "--compression 'zip'"),
    (["--out", "README.md"], "is a file"),
])
def test_bench_refuses_bad_options_in_one_line_before_any_work(argv, message, capsys):
    from jaxsched.cli import main

    assert main(["bench", "--no-cluster", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
