"""Where XLA:TPU puts an all-reduce whose operands are ready when the step starts.

``approx`` sums the previous step's gradients while this step's forward and backward run,
so on paper every all-reduce can hide behind compute. On one ``v5p:2x2x2`` slice (the
8x1024 MLP of the per-target table, sgd with momentum, 512 rows per chip) the step's
instruction costs still read about half of the plain step's communication exposed. This
compiles the same sums in four shapes, written directly with ``shard_map`` (no jaxsched
rewrite in between), to see whether the shape of the step is the cause:

- ``plain``: the gradients summed after backward, then the update (XLA alone), compiled
  with XLA's defaults (the per-target table's baseline) and with the engine's TPU options;
- ``update_at_end``: ``approx``'s shape, the pending sums at the start and the update
  that reads them at the end;
- ``sums_carried``: the sums only returned, as if the update moved to the next step;
- ``one_flat_sum``: the pending gradients packed into one buffer and summed once.

Each program gets two estimates: XLA's latency-hiding schedule, and the instruction costs
(XLA:TPU's ``estimated_cycles`` of each fusion added up, each collective priced alone, an
asynchronous one charged what the costed compute between its start and its done leaves
uncovered). It also records, per all-reduce, the costed compute in its window. Nothing
runs on a TPU: every time is an estimate of XLA's, NOT a measurement.

    .venv-aot/bin/python benchmarks/tpu_approx_windows.py     # about two minutes

Writes benchmarks/results/tpu_approx_windows.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULT = Path(__file__).parent / "results" / "tpu_approx_windows.json"
TARGET = "v5p:2x2x2"
LAYERS, WIDTH, ROWS = 8, 1024, 512
VARIANTS = ("plain", "update_at_end", "sums_carried", "one_flat_sum")
DEFAULTS = "plain, XLA's defaults"  # the per-target table's baseline: no async options
_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?([0-9.]+)')


def _step(variant: str) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    def loss(weights: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in weights:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def update(weights: list[jax.Array], momentum: list[jax.Array], grads: list[jax.Array]) -> tuple[list, list]:
        momentum = [0.9 * m + g for m, g in zip(momentum, grads)]
        return [w - 0.01 * m for w, m in zip(weights, momentum)], momentum

    def body(weights: list, momentum: list, pending: list, x: jax.Array) -> tuple:
        if variant in ("plain", DEFAULTS):
            grads = jax.grad(loss)(weights, x)
            summed = [jax.lax.psum(g, "data") for g in grads]
            return (*update(weights, momentum, summed), grads)
        if variant == "one_flat_sum":
            flat = jax.lax.psum(jnp.concatenate([g.reshape(-1) for g in pending]), "data")
            summed = [flat[i * WIDTH * WIDTH : (i + 1) * WIDTH * WIDTH].reshape(WIDTH, WIDTH) for i in range(LAYERS)]
        else:
            summed = [jax.lax.psum(g, "data") for g in pending]
        grads = jax.grad(loss)(weights, x)
        if variant == "sums_carried":
            return weights, summed, grads
        return (*update(weights, momentum, summed), grads)

    return body


def _windows(hlo: str, clock: float) -> dict[str, Any]:
    """Costed compute (us) before the first collective, in each window, between windows and
    after the last, in the final program's order."""
    entry = hlo[hlo.index("ENTRY") :]
    spans: list[tuple[str, float]] = []
    acc = 0.0
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if not m:
            continue
        name = m.group(1)
        if name.startswith(("async-collective-start", "async-collective-done")) or re.search(r" all-reduce\(", line):
            spans.append((name, acc / clock))
            acc = 0.0
        elif cycles := _CYCLES.search(line):
            acc += float(cycles.group(1))
    spans.append(("end", acc / clock))
    inside = [us for name, us in spans if name.startswith("async-collective-done")]
    return {
        "before_first_us": round(spans[0][1], 1),
        "inside_each_window_us": [round(us, 1) for us in inside],
        "after_last_us": round(spans[-1][1], 1),
        "outside_windows_us": round(sum(us for name, us in spans if not name.startswith("async-collective-done")), 1),
    }


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    import jaxsched.tools.aot as aot
    from jaxsched import check
    from jaxsched.core._progress import progress
    from jaxsched.runtime.engine._xla import TPU_OPTIONS

    name, topology, slices = aot.parse_target(TARGET)
    devices = aot.devices(name, topology, slices=slices)
    mesh = Mesh(np.array(devices), ("data",), axis_types=(AxisType.Explicit,))
    whole = NamedSharding(mesh, P())
    matrices = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=whole)] * LAYERS
    batch = jax.ShapeDtypeStruct((ROWS * mesh.size, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    rows = []
    for variant in progress([DEFAULTS, *VARIANTS], f"compiling for {TARGET}"):
        body = _step(variant)
        options = {} if variant == DEFAULTS else TPU_OPTIONS
        specs = (P(), P(), P(), P("data"))
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
        lowered = step.trace(matrices, matrices, matrices, batch).lower()
        compiled, schedule = check.compile_with_schedule(lowered, options)
        by_schedule = check.report(compiled, schedule, mesh, label=variant)
        unscheduled = check.report(compiled, None, mesh, label=variant)
        by_costs = check.estimate_from_instruction_costs(unscheduled, compiled, mesh)
        clock_match = re.search(r"cycles_per_microsecond: (\d+)", schedule or "")
        clock = float(clock_match.group(1)) if clock_match else 1750.0  # v5p's, as the schedules write it
        row = {
            "variant": variant,
            "compiler_options": "XLA's defaults" if variant == DEFAULTS else "the engine's TPU options",
            "schedule_step_us": by_schedule.step_s and round(by_schedule.step_s * 1e6, 1),
            "schedule_exposed_us": by_schedule.exposed_comm_s and round(by_schedule.exposed_comm_s * 1e6, 1),
            "costs_step_us": by_costs.step_s and round(by_costs.step_s * 1e6, 1),
            "costs_exposed_us": by_costs.exposed_comm_s and round(by_costs.exposed_comm_s * 1e6, 1),
            "all_reduces": sum(w.kind == "all-reduce" and w.bytes >= 1 << 20 for w in by_schedule.collectives),
            "schedule_compute_in_each_window_us": [
                round(w.compute_s * 1e6, 1) for w in by_schedule.collectives if w.compute_s is not None
            ],
            **_windows(compiled.as_text() or "", clock),
        }
        rows.append(row)
        print(
            f"{variant:22s} instruction costs: step {row['costs_step_us']} us, exposed {row['costs_exposed_us']} us; "
            f"schedule: step {row['schedule_step_us']} us, exposed {row['schedule_exposed_us']} us (XLA's estimates)",
            flush=True,
        )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "what": "XLA:TPU's estimates (NOT measured) of pending all-reduces in four step shapes",
                "target": TARGET,
                "model": f"MLP {LAYERS}x{WIDTH}, {ROWS} rows per chip, sgd with momentum",
                "command": "benchmarks/tpu_approx_windows.py",
                "date": time.strftime("%Y-%m-%d"),
                "machine": {"python": sys.version.split()[0], "jax": jax.__version__},
                "compiler_options": TPU_OPTIONS,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
