"""`jax.jit` steps: what scheduling a step written on global arrays costs, and what it gains.

Run: ``.venv/bin/python benchmarks/jit_steps.py [--steps 100] [--skip-compiled]``. Writes
``benchmarks/results/jit_steps.json``. Three measurements, each against its baseline in
the same run:

* **one device**: the scheduled jit step (``wfbp``, ``dear``) against the plain jit step,
  per-step time (medians of interleaved steps), at two batch sizes: what the scheduled
  step adds is a fixed Python cost per call (turning its state into the compiled
  program's inputs), so its share falls as the step grows;
* **eight virtual CPU devices**: how long jaxsched takes to build the program (trace,
  partition, rewrite, compile) against ``jax.jit``'s own compile of the plain step, and the
  per-step time of the scheduled jit step against the same step written with ``shard_map``
  and scheduled the same way;
* **compiled for GPU and TPU clusters** (``h100:1x8x8``; ``v5p:2x2x2`` with 2 slices): XLA's
  own estimate of the step and of its exposed communication, scheduled jit step against
  the plain jit step. These are the compilers' estimates, not measurements.

On CPU, XLA runs collectives synchronously (docs/benchmarks.md): step-time ratios on the
virtual devices measure the transform's overhead, not overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU/TPU devices need no backend

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps

MODEL = dict(name="mlp", input_shape=(32, 32, 1), classes=10, options=dict(hidden=(512,) * 4))
PER_DEVICE = 32
STRATEGIES = ("wfbp", "dear")


def _setup(devices: int, per_device: int = PER_DEVICE):
    params, apply_fn = models.pure(
        models.build(MODEL["name"], MODEL["input_shape"], MODEL["classes"], **MODEL["options"])
    )
    tx = optax.adamw(1e-3)
    mesh = jax.make_mesh((devices,), ("data",), (AxisType.Auto,), devices=jax.devices()[:devices])
    rng = np.random.default_rng(0)
    rows = per_device * devices
    batches = [
        jax.device_put(
            (
                rng.standard_normal((rows, *MODEL["input_shape"])).astype(np.float32),
                rng.integers(0, MODEL["classes"], rows).astype(np.int32),
            ),
            NamedSharding(mesh, P("data")),
        )
        for _ in range(4)
    ]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return params, apply_fn, tx, mesh, batches


def _interleaved(runners: dict, batches: list, n_steps: int, label: str) -> dict:
    """Median seconds per step of each runner. Steps are interleaved, in a shuffled order each
    round (with a fixed order, later runners are measured slower on 8 virtual devices), so that
    load on the machine affects every runner alike; one step in flight (docs/benchmarks.md)."""
    times = {name: [] for name in runners}
    order = random.Random(0)
    for i in tqdm(range(n_steps + 1), desc=label, leave=False):
        names = list(runners)
        order.shuffle(names)
        for name in names:
            run = runners[name]
            start = time.perf_counter()
            jax.block_until_ready(run(batches[i % len(batches)]))
            if i:  # the first call compiles
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _stepper(step, state):
    box = {"state": state}

    def run(batch):
        *box["state"], aux = step(*box["state"], batch)
        return aux

    return run


def _scheduled(sched, state):
    box = {"state": state}

    def run(batch):
        box["state"], aux = sched(box["state"], batch)
        return aux

    return run


def one_device(n_steps: int, per_device: int) -> dict:
    params, apply_fn, tx, _, batches = _setup(1, per_device)
    step = steps.make_jit_step(apply_fn, tx)
    runners = {"plain": _stepper(step, (params, tx.init(params)))}
    for strategy in STRATEGIES:
        sched = jaxsched.schedule(step, strategy=strategy)
        runners[strategy] = _scheduled(sched, sched.init(params, tx.init(params)))
    medians = _interleaved(runners, batches, n_steps, f"one device, batch {per_device}")
    return {
        "batch": per_device,
        "step_s": medians,
        "overhead_s": {s: medians[s] - medians["plain"] for s in STRATEGIES},
        "ratio_to_plain": {s: medians[s] / medians["plain"] for s in STRATEGIES},
    }


def eight_devices(n_steps: int) -> dict:
    params, apply_fn, tx, mesh, batches = _setup(8)
    jit_step = steps.make_jit_step(apply_fn, tx)
    start = time.perf_counter()
    jit_step.lower(params, tx.init(params), batches[0]).compile()
    plain_compile = time.perf_counter() - start
    build, runners = {}, {}
    for strategy in STRATEGIES:
        for form in ("jit", "shard_map"):
            step = jit_step if form == "jit" else steps.make_step(apply_fn, tx, mesh)
            sched = jaxsched.schedule(step, strategy=strategy)
            state = sched.init(params, tx.init(params))
            start = time.perf_counter()
            sched.lower(state, batches[0]).compile()
            build[f"{strategy}/{form}"] = time.perf_counter() - start
            runners[f"{strategy}/{form}"] = _scheduled(sched, state)
    medians = _interleaved(runners, batches, n_steps, "eight devices")
    return {
        "plain_jit_compile_s": plain_compile,
        "build_s": build,
        "build_ratio_to_plain_compile": {k: v / plain_compile for k, v in build.items()},
        "step_s": medians,
        "jit_over_shard_map": {s: medians[f"{s}/jit"] / medians[f"{s}/shard_map"] for s in STRATEGIES},
    }


def compiled(target: str) -> dict:
    """XLA's estimates for the plain jit step and the scheduled ones on ``target``."""
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    from jaxsched.demo.config import OptimizerConfig

    spec = ModelSpec(
        "mlp", (1024,), 1000, {"hidden": (2048,) * 6}, 64, OptimizerConfig(name="adamw", learning_rate=1e-4)
    )
    exp = abstract_experiment(spec, target=target, form="jit")
    rows = {}
    for strategy in tqdm(("allreduce", "wfbp"), desc=target, leave=False):
        sched = jaxsched.schedule(exp.step, strategy=strategy, buckets=2048 * 2049 * 4)
        inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=strategy == "allreduce")
        if strategy == "allreduce":
            base = inspection.baseline
            rows["plain"] = {
                "step_us": base.step_s * 1e6 if base.step_s else None,
                "exposed_us": base.exposed_comm_s * 1e6 if base.exposed_comm_s is not None else None,
            }
        report = inspection.report
        rows[strategy] = {
            "step_us": report.step_s * 1e6 if report.step_s else None,
            "exposed_us": report.exposed_comm_s * 1e6 if report.exposed_comm_s is not None else None,
        }
    plain = rows["plain"]["step_us"]
    return {
        "model": exp.description,
        "estimate": "XLA's own schedule estimate, not a measurement",
        "rows": rows,
        "wfbp_over_plain": rows["wfbp"]["step_us"] / plain if plain else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--skip-compiled", action="store_true", help="leave out the GPU/TPU compiles (they need the aot extra)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "jit_steps.json"))
    args = parser.parse_args()
    result = {
        "command": "benchmarks/jit_steps.py",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {jax.local_device_count()} virtual CPU devices",
        "model": f"mlp {MODEL['options']['hidden']}, {PER_DEVICE} examples per device, adamw",
        "one_device": [one_device(args.steps, rows) for rows in (PER_DEVICE, 8 * PER_DEVICE)],
        "eight_devices": eight_devices(args.steps),
    }
    if not args.skip_compiled:
        result["compiled"] = {t: compiled(t) for t in ("h100:1x8x8", "v5p:2x2x2:slices=2")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
