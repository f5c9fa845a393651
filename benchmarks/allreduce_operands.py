"""Why the plain step looked 2x slower than wfbp in ``jaxsched demo``: a second compilation,
and XLA:CPU all-reducing a tuple one operand at a time.

Run: ``.venv/bin/python benchmarks/allreduce_operands.py``. On 8 virtual CPU devices:

0. the plain step's first three calls, starting from freshly built parameters (on one
   device) and from parameters placed on the mesh as the step returns them;
1. a jitted ``psum`` of N float32 arrays (the demo MLP's gradient shapes, cycled) passed
   as a tuple, against the same arrays concatenated into one flat buffer, N = 1..32;
2. ``jax.profiler`` counts of the ``Rendezvous`` events per call for N = 8 (the demo's
   6 gradient leaves + 2 metrics), summed over the 8 device threads;
   and the same comparison for the gradients of ``make bench``'s MLP 4x512 (10 leaves,
   5.3 MB), where the concatenation copies cost more than the rendezvous they save;
3. the demo's own step (MLP 64-128-128-10, adam, global batch 128): plain, the plain
   step with its gradients concatenated by hand before one ``pmean``, and
   ``jaxsched.schedule(strategy="wfbp")``, interleaved step by step.

Writes ``benchmarks/results/allreduce_operands.json``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps
from jaxsched.plan._profiling import profile_psum_operands, psum_programs  # noqa: E402


def rendezvous_events(arrays: list[np.ndarray], mesh, calls: int = 5) -> dict[str, dict[str, float]]:
    """Per call, summed over the device threads: how many ``Rendezvous`` events the
    profiler records and the thread-ms spent in them, tuple psum vs flat psum."""
    from jax.sharding import NamedSharding

    placed = [jax.device_put(a, NamedSharding(mesh, P())) for a in arrays]
    counts = {}
    for layout, program in psum_programs(len(placed), mesh).items():
        jax.block_until_ready(program(*placed))
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                for _ in range(calls):
                    jax.block_until_ready(program(*placed))
            trace = json.load(gzip.open(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[-1]))
        events = [
            e
            for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
            if e.get("ph") == "X" and e.get("name") == "Rendezvous"
        ]
        counts[layout] = {
            "rendezvous_per_call": len(events) / calls,
            "rendezvous_thread_ms": sum(e.get("dur", 0) for e in events) / 1e3 / calls,
        }
    return counts


def _flat_pmean_step(apply_fn, tx, mesh):
    """The reference step, except that the gradients travel as one concatenated buffer."""

    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, x), y))(params)
        leaves, treedef = jax.tree.flatten(grads)
        flat = lax.pmean(jnp.concatenate([g.ravel() for g in leaves]), "data")
        sizes = np.cumsum([g.size for g in leaves])[:-1]
        grads = treedef.unflatten([part.reshape(g.shape) for part, g in zip(jnp.split(flat, sizes), leaves)])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )


def first_calls(calls: int = 3) -> dict[str, list[float]]:
    """Seconds of the plain step's first ``calls`` calls, unplaced vs placed initial state."""
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(128, 128)))
    tx = optax.adam(3e-3)
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    batch = steps.shard_batch((rng.random((128, 8, 8, 1), np.float32), rng.integers(0, 10, 128).astype(np.int32)), mesh)
    seconds = {}
    for start in ("fresh", "placed"):
        step = steps.make_step(apply_fn, tx, mesh)
        state = (params, tx.init(params))
        if start == "placed":
            state = steps.place_replicated(state, mesh)
        seconds[start] = []
        for _ in range(calls):
            started = time.perf_counter()
            *state, aux = step(*state, batch)
            jax.block_until_ready(aux)
            seconds[start].append(time.perf_counter() - started)
    return seconds


def demo_steps(n_steps: int) -> dict[str, float]:
    """Median step time (ms) of the demo's step three ways, interleaved."""
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(128, 128)))
    tx = optax.adam(3e-3)
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    batch = steps.shard_batch((rng.random((128, 8, 8, 1), np.float32), rng.integers(0, 10, 128).astype(np.int32)), mesh)
    runners = {
        "plain (tuple pmean)": jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="allreduce"),
        "plain, grads concatenated by hand": jaxsched.schedule(
            _flat_pmean_step(apply_fn, tx, mesh), strategy="allreduce"
        ),
        "wfbp": jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp"),
    }
    states = {k: r.init(params, tx.init(params)) for k, r in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(n_steps + 1):
        for k, runner in runners.items():
            start = time.perf_counter()
            states[k], aux = runner(states[k], batch)
            jax.block_until_ready((states[k], aux))  # one multi-device step in flight
            if i:
                times[k].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce_operands.json"))
    args = parser.parse_args()
    first = first_calls()
    mesh = jax.make_mesh((8,), ("data",))
    params, _ = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(128, 128)))
    shapes = [leaf.shape for leaf in jax.tree.leaves(params)] + [(), ()]
    psum_rows = []
    for n in (1, 2, 4, 8, 16, 32):
        arrays = [np.ones(shapes[i % len(shapes)], np.float32) for i in range(n)]
        psum_rows.append({"operands": n, **profile_psum_operands(arrays, mesh, repeats=args.repeats)})
    arrays = [np.ones(s, np.float32) for s in shapes]
    events = rendezvous_events(arrays, mesh)
    big, _ = models.pure(models.build("mlp", (32, 32, 1), 10, hidden=(512,) * 4))
    big_leaves = [np.ones(leaf.shape, np.float32) for leaf in jax.tree.leaves(big)]
    bench_mlp = {
        "operands": len(big_leaves),
        "megabytes": sum(a.nbytes for a in big_leaves) / 1e6,
        **profile_psum_operands(big_leaves, mesh, repeats=max(10, args.repeats // 10)),
    }
    demo = demo_steps(args.steps)
    result = {
        "backend": jax.default_backend(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "devices": 8,
        "cpus": os.cpu_count(),
        "load_average_1_5_15": os.getloadavg(),
        "repeats": args.repeats,
        "steps": args.steps,
        "note": "medians of interleaved calls; tuple = one psum of N operands, flat = one psum of their concatenation",
        "first_calls_s": first,
        "psum_ms": psum_rows,
        "profile_n8": events,
        "bench_mlp_4x512_psum_ms": bench_mlp,
        "demo_step_ms": demo,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for start, seconds in first.items():
        print(f"plain step, first calls from {start} parameters: " + ", ".join(f"{1e3 * t:.0f} ms" for t in seconds))
    print(f"{'operands':>8} {'tuple ms':>9} {'flat ms':>8} {'ratio':>6}")
    for row in psum_rows:
        print(
            f"{row['operands']:>8} {row['tuple_ms']:9.3f} {row['flat_ms']:8.3f} {row['tuple_ms'] / row['flat_ms']:6.2f}"
        )
    print(
        f"make bench's MLP 4x512 gradients ({bench_mlp['operands']} arrays, "
        f"{bench_mlp['megabytes']:.1f} MB): tuple {bench_mlp['tuple_ms']:.2f} ms, "
        f"flat {bench_mlp['flat_ms']:.2f} ms"
    )
    for layout, counts in events.items():
        print(
            f"profile, {layout}: {counts['rendezvous_per_call']:.0f} Rendezvous events per call "
            f"over 8 device threads, {counts['rendezvous_thread_ms']:.2f} thread-ms in them"
        )
    for name, ms in demo.items():
        print(f"demo step, {name}: {ms:.2f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
