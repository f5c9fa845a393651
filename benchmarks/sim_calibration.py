"""Simulator vs measurement: predict the baseline step from measured profiles, then time it.

For each zoo model: measure its layer profile on all 8 virtual CPU devices at once
(``jaxsched.profile.profile_zoo_model(mesh=...)``) and the mesh's collective costs
(``profile_network``); simulate strategy ``allreduce`` (the only engine that exists
today: ``jaxsched.steps.make_step``, SGD); then time that real step (median of blocked
steps) in the same run. Writes ``benchmarks/results/sim_calibration.json``.

    PYTHONPATH=. python benchmarks/sim_calibration.py
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()

import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxsched import models, profile, steps  # noqa: E402
from jaxsched.sim import simulate  # noqa: E402

CASES = [("mlp", {"hidden": (512, 512, 512)}, 64), ("cnn", {"channels": 32}, 16),
         ("transformer", {"dim": 128, "layers": 4}, 8)]


def measure_step(name: str, options: dict, batch: int, mesh, steps_count: int = 20) -> float:
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
    opt_state = tx.init(params)
    batch_on_mesh = steps.shard_batch((x, y), mesh)
    samples = []
    for i in range(steps_count + 3):
        start = time.perf_counter()
        params, opt_state, aux = jax.block_until_ready(step(params, opt_state, batch_on_mesh))
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    network, fit_errors = profile.profile_network(mesh, repeats=7)
    rows = []
    for name, options, batch in CASES:
        layers = profile.profile_zoo_model(name, batch=batch, repeats=7, mesh=mesh, **options)
        # The real step psums every gradient leaf after backward; XLA may or may not fuse
        # them, so report one bucket and one bucket per layer (top-level group).
        predicted = simulate(layers, network, "allreduce").iteration_s
        per_layer = simulate(layers, network, "allreduce", [[i] for i in range(len(layers))]).iteration_s
        measured = measure_step(name, options, batch, mesh)
        rows.append({"model": name, "options": options, "per_device_batch": batch,
                     "params": layers.total_params, "layers": len(layers),
                     "simulated_allreduce_s": predicted,
                     "simulated_allreduce_per_layer_buckets_s": per_layer,
                     "measured_allreduce_s": measured,
                     "relative_error": (predicted - measured) / measured,
                     "relative_error_per_layer_buckets": (per_layer - measured) / measured})
        print(f"{name:<12} simulated {predicted * 1e3:8.2f} ms (one bucket), {per_layer * 1e3:8.2f} ms "
              f"(per layer)  measured {measured * 1e3:8.2f} ms  error {100 * rows[-1]['relative_error']:+.1f}% "
              f"/ {100 * rows[-1]['relative_error_per_layer_buckets']:+.1f}%")
    print("network fit max relative error:", {k: round(v, 3) for k, v in fit_errors.items()})
    out = Path(__file__).parent / "results" / "sim_calibration.json"
    out.write_text(json.dumps({"rows": rows, "network": network.to_dict(),
                               "fit_max_relative_error": fit_errors}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
