"""What the transform costs: trace+compile time and step time of wfbp and dear vs allreduce.

Run: ``.venv/bin/python benchmarks/transform_overhead.py [--steps 30]``. Writes
``benchmarks/results/transform_overhead.json``. Every ratio is against the plain step
measured in the same run. On CPU collectives are synchronous (docs/benchmarks.md), so step-time
ratios here measure the transform's overhead, not overlap.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps

MODELS = {
    "mlp-4x512": dict(
        name="mlp",
        input_shape=(32, 32, 1),
        classes=10,
        options=dict(hidden=(512,) * 4),
        per_device=32,
        int_inputs=False,
    ),
    "transformer-2x128": dict(
        name="transformer",
        input_shape=(64,),
        classes=256,
        options=dict(dim=128, heads=4, layers=2),
        per_device=8,
        int_inputs=True,
    ),
}


def _batch(spec, n, rng):
    b = spec["per_device"] * n
    if spec["int_inputs"]:
        x = rng.integers(0, spec["classes"], size=(b, *spec["input_shape"])).astype(np.int32)
        return x, rng.integers(0, spec["classes"], size=x.shape).astype(np.int32)
    x = rng.standard_normal((b, *spec["input_shape"])).astype(np.float32)
    return x, rng.integers(0, spec["classes"], size=b).astype(np.int32)


STRATEGIES = ("allreduce", "wfbp", "dear")


def measure(model: str, devices: int, n_steps: int, repeats: int) -> list[dict]:
    """Compile and step times of every strategy; steps are interleaved round-robin so that
    load on the machine affects every strategy alike."""
    spec = MODELS[model]
    params, apply_fn = models.pure(models.build(spec["name"], spec["input_shape"], spec["classes"], **spec["options"]))
    tx = optax.adamw(1e-3)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    rng = np.random.default_rng(0)
    batches = [steps.shard_batch(_batch(spec, devices, rng), mesh) for _ in range(4)]
    compile_s = {s: [] for s in STRATEGIES}
    scheds, states = {}, {}
    for _ in range(repeats):  # fresh steps each time so nothing is cached
        for strategy in STRATEGIES:
            step = steps.make_step(apply_fn, tx, mesh)
            sched = jaxsched.schedule(step, strategy=strategy)
            # placed as the step returns it, so the plain step compiles once
            state = sched.init(*steps.place_replicated((params, tx.init(params)), mesh))
            start = time.perf_counter()
            if strategy == "allreduce":
                step.lower(params, tx.init(params), batches[0]).compile()
            else:
                sched.lower(state, batches[0]).compile()
            compile_s[strategy].append(time.perf_counter() - start)
            scheds[strategy], states[strategy] = sched, state
    times = {s: [] for s in STRATEGIES}
    for i in range(n_steps + 1):
        for strategy in STRATEGIES:
            start = time.perf_counter()
            states[strategy], aux = scheds[strategy](states[strategy], batches[i % len(batches)])
            jax.block_until_ready((states[strategy], aux))  # one step in flight (docs/benchmarks.md)
            if i:  # the first call compiles
                times[strategy].append(time.perf_counter() - start)
    return [
        {
            "model": model,
            "devices": devices,
            "strategy": s,
            "compile_s": statistics.median(compile_s[s]),
            "step_s": statistics.median(times[s]),
            "step_s_all": times[s],
        }
        for s in STRATEGIES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="fresh compilations per median")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "transform_overhead.json"))
    args = parser.parse_args()
    cases = [(m, d) for m in MODELS for d in (1, 8)]
    rows = []
    for model, devices in tqdm(cases, desc="transform overhead"):
        rows.extend(measure(model, devices, args.steps, args.repeats))
    for row in rows:
        base = next(
            r
            for r in rows
            if r["model"] == row["model"] and r["devices"] == row["devices"] and r["strategy"] == "allreduce"
        )
        row["compile_ratio"] = row["compile_s"] / base["compile_s"]
        row["step_ratio"] = row["step_s"] / base["step_s"]
    result = {
        "backend": jax.default_backend(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "note": "medians; ratios against allreduce measured in this run",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'model':>18} {'dev':>3} {'strategy':>9} {'compile s':>9} {'x plain':>7} {'step ms':>8} {'x plain':>7}")
    for r in rows:
        print(
            f"{r['model']:>18} {r['devices']:>3} {r['strategy']:>9} {r['compile_s']:9.2f} "
            f"{r['compile_ratio']:7.2f} {1e3 * r['step_s']:8.2f} {r['step_ratio']:7.2f}"
        )
    print(f"wrote {args.out}; the README table, from it:")
    names = {"mlp-4x512": "MLP 4x512", "transformer-2x128": "Transformer 2x128"}
    for model, devices in cases:
        pick = {r["strategy"]: r for r in rows if r["model"] == model and r["devices"] == devices}
        print(
            f"| {names[model]} | {devices} | {pick['wfbp']['compile_ratio']:.2f} / "
            f"{pick['dear']['compile_ratio']:.2f} | {pick['wfbp']['step_ratio']:.2f} / "
            f"{pick['dear']['step_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
