"""Host time per call: the scheduled step's dispatch against the plain step's.

Run from the repository root: ``.venv/bin/python benchmarks/dispatch_overhead.py``
(a tiny MLP on 8 virtual CPU devices, so that dispatch, not compute, is what is timed; the
median of 200 calls, each blocked on after its time is taken, so that at most one step is
in flight). Writes ``benchmarks/results/dispatch_overhead.json``.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps


def dispatch_us(call, state, calls: int = 200) -> float:
    for _ in range(5):
        state = jax.block_until_ready(call(state))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state = call(state)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(state)
    return statistics.median(times) * 1e6


def main() -> None:
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.sgd(0.1)
    step = steps.make_step(apply_fn, tx, mesh)
    batch = steps.shard_batch((jnp.ones((16, 8, 8, 1)), jnp.zeros(16, "int32")), mesh)
    state0 = (params, tx.init(params))
    result = {"plain_us": dispatch_us(lambda s: step(*s, batch)[:2], state0)}
    for strategy in ("allreduce", "wfbp", "dear"):
        sched = jaxsched.schedule(step, strategy=strategy)
        result[f"{strategy}_us"] = dispatch_us(lambda s: sched(s, batch)[0], sched.init(*state0))
        result[f"{strategy}_over_plain_us"] = result[f"{strategy}_us"] - result["plain_us"]
    out = ROOT / "benchmarks" / "results" / "dispatch_overhead.json"
    out.write_text(json.dumps(result, indent=1))
    print({k: round(v) for k, v in result.items()})


if __name__ == "__main__":
    main()
