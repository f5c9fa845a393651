"""`jaxsched bench` end to end on loopback (2 processes): the report's shape, a missing
strategy reported as missing, the Gantt chart written. Speed is not asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_reports_every_strategy_and_a_missing_one(tmp_path):
    out, png, results = tmp_path / "out.json", tmp_path / "gantt.png", tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "jaxsched", "bench", "--no-cluster", "--hosts", "2", "--steps", "2",
         "--depth", "3", "--width", "32", "--batch", "16", "--strategies", "allreduce,wfbp,nosuch",
         "--json", str(out), "--png", str(png), "--results-dir", str(results), "--timeout", "300"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"compute_s", "comm_s", "bound_s", "ceiling_s", "strategies"} <= report.keys()
    assert report["ceiling_s"] > 0 and report["comm_tree_s"] > 0
    assert report["layers"]["depth"] == 3 and report["layers"]["width"] == 32
    assert report["strategies"]["nosuch"] == {"missing": True}
    for name in ("allreduce", "wfbp"):
        row = report["strategies"][name]
        assert row["step_s"] > 0 and row["speedup"] > 0
        assert row["ratio_to_ceiling"] == pytest.approx(row["step_s"] / report["ceiling_s"])
        assert row["max_loss_gap_to_plain"] < 1e-4   # the host engine computes the plain step
    assert "3x32 tanh MLP" in done.stdout and "missing" in done.stdout
    assert png.stat().st_size > 10_000
    assert list(results.iterdir())
