"""Why DeAR is slower than WFBP on virtual CPU devices: step times and a profiler summary.

Run: ``.venv/bin/python benchmarks/dear_cpu_profile.py``. Times the plain step, wfbp and
dear on a 4-layer Transformer (8 virtual CPU devices, SGD), interleaved step by step,
then records 3 steps of each under ``jax.profiler`` and sums the time spent in the
collectives and rendezvous waits over the 8 device threads. Writes
``benchmarks/results/dear_cpu_profile.json``.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps

COLLECTIVE_WORDS = (
    "all-reduce",
    "all_reduce",
    "all_gather",
    "all-gather",
    "reduce_scatter",
    "reduce-scatter",
    "Rendezvous",
)


def main(n_steps: int = 10, profiled_steps: int = 3) -> None:
    params, apply_fn = models.pure(models.build("transformer", (64,), 256, dim=128, heads=4, layers=4))
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((8,), ("data",))
    x = np.random.default_rng(0).integers(0, 256, size=(64, 64)).astype(np.int32)
    batch = steps.shard_batch((x, x), mesh)
    runs = {}
    for strategy in ("allreduce", "wfbp", "dear"):
        sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy)
        state = sched.init(params, tx.init(params), batch)
        state, aux = sched(state, batch)
        jax.block_until_ready((state, aux))
        runs[strategy] = (sched, state)
    times = {k: [] for k in runs}
    for _ in range(n_steps):
        for k, (sched, state) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(sched(state, batch))
            times[k].append(time.perf_counter() - start)
    result = {"step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "profile": {}}
    for k, (sched, state) in runs.items():
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                for _ in range(profiled_steps):
                    jax.block_until_ready(sched(state, batch))
            trace = json.load(gzip.open(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[-1]))
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        totals = collections.Counter()
        for event in events:
            if event.get("ph") == "X" and any(w in event["name"] for w in COLLECTIVE_WORDS):
                totals[event["name"]] += event.get("dur", 0) / 1e3 / profiled_steps
        result["profile"][k] = {"thread_ms_per_step": dict(totals.most_common())}
    out = Path(__file__).parent / "results" / "dear_cpu_profile.json"
    out.write_text(json.dumps(result, indent=2))
    print("median step (ms, interleaved):", {k: round(v, 1) for k, v in result["step_ms"].items()})
    for k, prof in result["profile"].items():
        print(
            f"{k:>9}: collectives and rendezvous, ms summed over 8 device threads per step:",
            {name: round(ms, 1) for name, ms in prof["thread_ms_per_step"].items()},
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
