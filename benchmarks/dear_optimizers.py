"""``dear`` on the optax optimizers a user reaches for: what it gathers, what it keeps per
device, how long a step takes against ``wfbp``; and, compiled for an H100 cluster, adamw
with a schedule on the zoo Transformer against the plain step.

    .venv/bin/python benchmarks/dear_optimizers.py                 # the table
    .venv/bin/python benchmarks/dear_optimizers.py --compiled h100:1x8x8

Part one runs on 8 virtual CPU devices (tests/optimizer_zoo.py: a small MLP whose leaf sizes
do not divide by 8, each optimizer with a schedule and, where it decays weights, a mask).
Per optimizer: the bytes all-gathered per step (read from the lowered program) against the
parameter bytes, the optimizer state bytes one device holds against the plain step's, any
fallback, and the median step time of ``dear`` and ``wfbp``, interleaved step by step in
the same run. CPU step times say nothing about overlap (XLA:CPU runs collectives
synchronously, FACTS.md); they show what the sharded update costs here.

Part two (``--compiled``) compiles for compile-only devices (jaxsched.tools.aot): nothing runs on
an accelerator, every time is XLA's latency-hiding scheduler estimate, NOT a measurement.

Writes benchmarks/results/dear_optimizers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the optimizer catalogue the tests share
RESULTS = HERE / "results"
JSON_PATH = RESULTS / "dear_optimizers.json"

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i1": 1}


def gathered_bytes(text: str) -> int:
    """Bytes all-gathered per step: the result of every all-gather in the lowered program."""
    import math
    import re

    total = 0
    for match in re.finditer(r'"stablehlo\.all_gather"', text):
        sig = re.search(r"\)\s*->\s*\(?tensor<([^>]*)>", text[match.end() :])
        *dims, dtype = sig.group(1).split("x")
        total += math.prod(int(d) for d in dims) * DTYPE_BYTES.get(dtype, 4)
    return total


def time_steps(runs: dict, batches: list, repeats: int) -> dict:
    """Median step seconds per run, interleaved step by step (one step in flight)."""
    times = {k: [] for k in runs}
    for r in range(repeats):
        for k, (sched, state) in list(runs.items()):
            start = time.perf_counter()
            state, aux = sched(state, batches[r % len(batches)])
            jax.block_until_ready((state, aux))
            times[k].append(time.perf_counter() - start)
            runs[k] = (sched, state)
    return {k: statistics.median(v) for k, v in times.items()}


def optimizer_table(names, repeats: int) -> list[dict]:
    import jaxsched
    import optimizer_zoo as zoo
    from jaxsched.check._verify import relative_gap

    rows = []
    for name in names:
        run = zoo.run(name, devices=8, n_steps=3)
        sched, state = run["sched"], run["state"]
        text = sched.lower(state, run["batches"][0]).as_text()
        wfbp = jaxsched.schedule(sched.step, strategy="wfbp")
        w_state = wfbp.init(*run["plain"])
        w_state, _ = wfbp(w_state, run["batches"][0])
        step_s = time_steps({"dear": (sched, state), "wfbp": (wfbp, w_state)}, run["batches"], repeats)
        gap = max(relative_gap(a, b) for a, b in zip(jax.tree.leaves(run["got"]), jax.tree.leaves(run["plain"])))
        found = run["collectives"]
        row = {
            "optimizer": name,
            "buckets": run["buckets"],
            "all_gathers": len(found["all_gather"]),
            "reduce_scatters": len(found["reduce_scatter"]),
            "all_reduce_elements": found["all_reduce"],
            "gathered_bytes_per_step": gathered_bytes(text),
            "param_bytes": run["param_bytes"],
            "opt_state_bytes_plain": run["opt_bytes_plain"],
            "opt_state_bytes_per_device": run["opt_bytes_per_device"],
            "fallbacks": [[p, line] for r in sched.program.bucket_report for p, line in r.fallbacks],
            "max_rel_diff_vs_plain": gap,
            "dear_step_ms": 1e3 * step_s["dear"],
            "wfbp_step_ms": 1e3 * step_s["wfbp"],
        }
        rows.append(row)
        print(
            f"{name:16s} AG {row['all_gathers']} ({row['gathered_bytes_per_step']} B of "
            f"{row['param_bytes']} B params)  opt/device {row['opt_state_bytes_per_device']} B "
            f"(plain {row['opt_state_bytes_plain']} B)  dear {row['dear_step_ms']:.2f} ms  "
            f"wfbp {row['wfbp_step_ms']:.2f} ms  rel diff {gap:.1e}"
            + (f"  fallbacks {row['fallbacks']}" if row["fallbacks"] else ""),
            flush=True,
        )
    return rows


def compiled_transformer(target: str) -> dict:
    """dear with adamw and a warm-up + cosine schedule on the zoo Transformer, compiled for
    ``target``, beside the plain step as XLA compiles it (XLA's estimates)."""
    import math
    import warnings

    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxsched
    from jaxsched.zoo import models
    from jaxsched.demo import steps
    from jaxsched.tools.aot._experiment import ZOO, mesh_for

    spec = ZOO["transformer"]
    mesh = mesh_for(target)
    model = nnx.eval_shape(lambda: models.build(spec.name, spec.input_shape, spec.num_outputs, **spec.options))
    params, apply_fn = models.pure(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=1000, decay_steps=100_000)
    mask = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
    tx = optax.adamw(schedule, weight_decay=0.1, mask=mask)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)
    params = abstract(params)
    opt_state = abstract(jax.eval_shape(tx.init, params))
    rows = spec.batch_per_device * mesh.devices.size
    batch = tuple(
        jax.ShapeDtypeStruct((rows,) + tuple(spec.input_shape), jnp.int32, sharding=sharded) for _ in range(2)
    )
    step = steps.make_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(step, strategy="dear")
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxsched.FallbackWarning)
        inspection = sched.inspect(sched.init(params, opt_state, batch), batch)
    report, plain = inspection.report, inspection.baseline
    kinds = {}
    for c in report.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    param_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params))
    result = {
        "target": target,
        "model": "transformer",
        "params": sum(math.prod(a.shape) for a in jax.tree.leaves(params)),
        "optimizer": "adamw, warmup + cosine schedule, decay mask on matrices",
        "buckets": len(sched.program.buckets),
        "collectives": kinds,
        "all_gather_bytes": sum(c.bytes for c in report.collectives if c.kind == "all-gather"),
        "param_bytes": param_bytes,
        "fallbacks": [str(w.message) for w in caught],
        "dear_step_us": None if report.step_s is None else 1e6 * report.step_s,
        "dear_exposed_comm_us": None if report.exposed_comm_s is None else 1e6 * report.exposed_comm_s,
        "plain_step_us": None if plain.step_s is None else 1e6 * plain.step_s,
        "plain_exposed_comm_us": None if plain.exposed_comm_s is None else 1e6 * plain.exposed_comm_s,
        "ratios": inspection.ratios(),
        "wall_s": round(time.perf_counter() - started, 1),
        "note": "XLA's latency-hiding scheduler estimate for compile-only devices, not a measurement",
    }
    print(json.dumps(result, indent=1))
    return result


def main() -> None:
    import optimizer_zoo as zoo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="*", default=list(zoo.OPTIMIZERS))
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per strategy")
    parser.add_argument("--compiled", default=None, help="also compile for a target, e.g. h100:1x8x8")
    parser.add_argument("--skip-table", action="store_true")
    args = parser.parse_args()
    result = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    if not args.skip_table:
        result["optimizers"] = optimizer_table(args.optimizers, args.repeats)
        result["cpu"] = "8 virtual CPU devices; step times are medians of interleaved steps"
    if args.compiled:
        result.setdefault("compiled", {})[args.compiled] = compiled_transformer(args.compiled)
    RESULTS.mkdir(exist_ok=True)
    JSON_PATH.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {JSON_PATH}")


if __name__ == "__main__":
    main()
