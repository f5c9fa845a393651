"""Per-device peak memory of a scanned FSDP stack whose step donates its state.

Trainers jit their step with ``donate_argnums`` so that XLA writes the new parameters and
optimizer state over the old ones. The scheduled program then donates its own state too,
and ``inspect`` compiles the plain step with the same donation. This compiles, on 8 CPU
devices, a ``lax.scan`` over ``--layers`` stacked ``--width`` x ``--width`` weights split
``P(None, 'fsdp', None)`` (``jax.checkpoint`` per layer, adam), with and without donation,
and records XLA's memory analysis of the plain step and of each strategy's program (peak:
arguments + outputs + temporaries - aliased outputs). Nothing is timed.

    .venv/bin/python benchmarks/donated_memory.py     # about half a minute

Writes benchmarks/results/donated_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

RESULT = Path(__file__).parent / "results" / "donated_memory.json"
STRATEGIES = ("allreduce", "wfbp", "dear")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxsched

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    tx = optax.adam(1e-3)

    def loss_fn(p, x, y):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, p["w"])
        return jnp.mean((h - y) ** 2)

    def train_step(p, o, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    rng = np.random.default_rng(0)
    stack = rng.standard_normal((args.layers, args.width, args.width)).astype(np.float32) / np.sqrt(args.width)
    params = {"w": jax.device_put(stack, NamedSharding(mesh, P(None, "fsdp", None)))}
    opt_state = tx.init(params)
    batch = tuple(
        jax.device_put(rng.standard_normal((args.rows, args.width)).astype(np.float32), NamedSharding(mesh, P("fsdp")))
        for _ in range(2)
    )
    layer_bytes = args.width * args.width * 4
    rows = []
    for donate in ((), (0, 1)):
        step = jax.jit(train_step, donate_argnums=donate)
        for strategy in STRATEGIES:
            sched = jaxsched.schedule(step, strategy=strategy)
            inspection = sched.inspect(sched.init(params, opt_state), batch)
            assert inspection.baseline is not None  # inspect compiles the plain step by default
            plain, scheduled = inspection.baseline.peak_memory_bytes, inspection.report.peak_memory_bytes
            assert plain is not None and scheduled is not None  # XLA:CPU has a memory analysis
            rows.append(
                {
                    "donate_argnums": list(donate),
                    "strategy": strategy,
                    "plain_peak_bytes": plain,
                    "scheduled_peak_bytes": scheduled,
                    "over_plain_in_layers": round((scheduled - plain) / layer_bytes, 3),
                }
            )
            print(
                f"donate {str(donate):7s} {strategy:10s} plain {plain / 1e6:6.2f} MB, "
                f"scheduled {scheduled / 1e6:6.2f} MB ({rows[-1]['over_plain_in_layers']:+.2f} layers)",
                flush=True,
            )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "what": "XLA's memory analysis per device (compiled, not measured while running)",
                "model": f"scan over {args.layers} x {args.width}x{args.width} f32, adam, {args.rows} rows, 8 CPU devs",
                "layer_bytes": layer_bytes,
                "command": "benchmarks/donated_memory.py " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d"),
                "machine": {"python": sys.version.split()[0], "jax": jax.__version__},
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
