"""Simulator vs measurement: predict the baseline step from measured profiles, then time it.

For each zoo model: measure its layer profile on all 8 virtual CPU devices at once
(``jaxsched.plan._profiling.profile_zoo_model(mesh=...)``) and the mesh's collective costs
(``profile_network``); simulate each strategy; then time the real step (median of
blocked steps) in the same run: ``allreduce`` is ``jaxsched.demo.steps.make_step`` (SGD);
``wfbp`` and ``dear`` are ``jaxsched.schedule`` (xla engine).
XLA:CPU runs collectives inline (docs/benchmarks.md), so the prediction uses
``simulate(..., shared_stream=True)``; one bucket (every model here is under 25 MB, the
engine's default threshold). The profiles carry the measured SGD update per layer
(``update_s``), the step's dispatch cost (``dispatch_s``, taken off the whole-model
forward and added once per iteration) and the bucket pack/unpack cost
(``copy_s_per_byte``, wfbp and dear). ``simulated_before_s`` is the same run's prediction
without the update and copy costs (what the simulator predicted before they were
measured). Writes ``benchmarks/results/sim_calibration.json``.

    python benchmarks/sim_calibration.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()

import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxsched.zoo import models  # noqa: E402
from jaxsched.plan import _profiling as profile
from jaxsched.demo import steps
from jaxsched.sim import simulate  # noqa: E402

CASES = [
    ("mlp", {"hidden": (512, 512, 512)}, 64),
    ("cnn", {"channels": 32}, 16),
    ("transformer", {"dim": 128, "layers": 4}, 8),
]


def measure_step(
    name: str, options: dict, batch: int, mesh, strategy: str = "allreduce", steps_count: int = 20
) -> float:
    rng = np.random.default_rng(0)
    workers = mesh.shape["data"]
    if name == "transformer":
        model = models.build(name, (32,), 64, 0, **options)
        x = rng.integers(0, 64, (batch * workers, 32)).astype(np.int32)
        y = rng.integers(0, 64, (batch * workers, 32)).astype(np.int32)
    else:
        model = models.build(name, (8, 8, 1), 10, 0, **options)
        x = rng.standard_normal((batch * workers, 8, 8, 1)).astype(np.float32)
        y = rng.integers(0, 10, batch * workers).astype(np.int32)
    params, apply_fn = models.pure(model)
    tx = optax.sgd(0.01)
    step = steps.make_step(apply_fn, tx, mesh)
    batch_on_mesh = steps.shard_batch((x, y), mesh)
    if strategy == "allreduce":
        state = (params, tx.init(params))
        run = lambda state: step(*state, batch_on_mesh)[:2]
    else:
        import jaxsched

        sched = jaxsched.schedule(step, strategy=strategy)
        state = sched.init(params, tx.init(params))
        run = lambda state: sched(state, batch_on_mesh)[0]
    samples = []
    for i in range(steps_count + 3):
        start = time.perf_counter()
        state = jax.block_until_ready(run(state))
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(rounds: int = 3) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    strategies = ["allreduce", "wfbp", "dear"]
    rows = []
    for name, options, batch in CASES:
        for strategy in strategies:
            per_round = []
            for _ in range(rounds):  # profile and measure back to back, several times: noise
                network, fit_errors = profile.profile_network(mesh, repeats=7)
                layers = profile.profile_zoo_model(
                    name, batch=batch, repeats=7, mesh=mesh, optimizer=optax.sgd(0.01), **options
                )
                one_bucket = [list(range(len(layers)))]
                predicted = simulate(layers, network, strategy, one_bucket, shared_stream=True).iteration_s
                before = simulate(
                    type(layers)([dataclasses.replace(l, update_s=0.0) for l in layers.layers]),
                    dataclasses.replace(network, copy_s_per_byte=0.0),
                    strategy,
                    one_bucket,
                    shared_stream=True,
                ).iteration_s
                measured = measure_step(name, options, batch, mesh, strategy)
                per_round.append(
                    {
                        "simulated_s": predicted,
                        "measured_s": measured,
                        "relative_error": (predicted - measured) / measured,
                        "simulated_before_s": before,
                        "relative_error_before": (before - measured) / measured,
                        "update_s": layers.update_s,
                        "dispatch_s": network.dispatch_s,
                        "copy_s_per_byte": network.copy_s_per_byte,
                        "fit_max_relative_error": fit_errors,
                    }
                )
            errors = sorted(r["relative_error"] for r in per_round)
            rows.append(
                {
                    "model": name,
                    "strategy": strategy,
                    "options": options,
                    "per_device_batch": batch,
                    "params": layers.total_params,
                    "layers": len(layers),
                    "rounds": per_round,
                    "median_relative_error": statistics.median(errors),
                    "median_relative_error_before": statistics.median(r["relative_error_before"] for r in per_round),
                }
            )
            print(
                f"{name:<12} {strategy:<10} "
                + "  ".join(f"{r['simulated_s'] * 1e3:6.1f}/{r['measured_s'] * 1e3:6.1f} ms" for r in per_round)
                + f"  median error {100 * rows[-1]['median_relative_error']:+.1f}%"
                f" (before {100 * rows[-1]['median_relative_error_before']:+.1f}%)",
                flush=True,
            )
    out = Path(__file__).parent / "results" / "sim_calibration.json"
    out.write_text(json.dumps({"rows": rows, "load_average": os.getloadavg()}, indent=1))
    print(f"load average {os.getloadavg()} -> {out}")


if __name__ == "__main__":
    import sys

    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
