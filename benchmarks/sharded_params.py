"""`jax.jit` steps with sharded parameters (FSDP, HSDP): what each strategy costs per step and
what it keeps in memory, against the plain jit step in the same run.

Run: ``.venv/bin/python benchmarks/sharded_params.py [--steps 30] [--repeats 3]``. Writes
``benchmarks/results/sharded_params.json``. On 8 virtual CPU devices:

* **per-step time**: the plain jit step and the step under ``allreduce``, ``wfbp`` and
  ``dear``, stepped interleaved (one step of each in turn), medians; on FSDP over 8 devices
  and on HSDP (2 replicas of FSDP over 4). XLA:CPU runs collectives synchronously, so the
  ratios measure what the scheduled program adds (or saves), not overlap;
* **state per device**: the bytes one device holds of the state between steps (the
  scheduled state against the plain step's params and optimizer state);
* **compiled memory**: XLA's memory analysis of each compiled program per device
  (arguments, outputs, temporaries; peak = arguments + outputs + temporaries - aliased);
* **collectives**: how many of each kind each compiled program holds and how many elements
  they move per device, which explains the times: XLA's partitioner gathers each weight
  again for backward and reshards gradients with all-to-alls, where the scheduled program
  gathers each weight once and reduce-scatters each gradient into its block.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxsched  # noqa: E402

WIDTH, LAYERS, PER_DEVICE = 512, 6, 32
STRATEGIES = ("allreduce", "wfbp", "dear")
LAYOUTS = {
    "fsdp": ((8,), ("fsdp",), P("fsdp")),
    "hsdp": ((2, 4), ("data", "fsdp"), P(("data", "fsdp"))),
}


def setup(layout: str, seed: int = 0):
    shape, names, batch_spec = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P("fsdp", None))
    params = {
        f"layer{i}": {
            "w": jax.device_put((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), sharding),
            "b": jax.device_put(np.zeros(WIDTH, np.float32), NamedSharding(mesh, P())),
        }
        for i in range(LAYERS)
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            h = x
            for i in range(LAYERS):
                h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
            return jnp.mean((h - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    rows = PER_DEVICE * mesh.size
    batches = [
        jax.device_put(
            (
                rng.standard_normal((rows, WIDTH)).astype(np.float32),
                rng.standard_normal((rows, WIDTH)).astype(np.float32),
            ),
            NamedSharding(mesh, batch_spec),
        )
        for _ in range(4)
    ]
    return mesh, step, params, tx.init(params), batches


def device_bytes(tree) -> int:
    """Bytes device 0 holds of ``tree``'s arrays."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


def memory(compiled) -> dict:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    out = {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
    }
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def collectives(compiled) -> dict:
    """Per kind of collective in the compiled program: how many, and the elements they return."""
    count: collections.Counter = collections.Counter()
    elements: collections.Counter = collections.Counter()
    for line in compiled.as_text().splitlines():
        if " = " not in line:
            continue
        result = line.split(" = ", 1)[1]
        for kind in KINDS:
            at = max(result.find(f" {kind}("), result.find(f" {kind}-start("))
            if at < 0:
                continue
            count[kind] += 1
            for dims in SHAPE.findall(result[:at]):
                elements[kind] += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            break
    return {kind: {"count": count[kind], "elements": elements[kind]} for kind in sorted(count)}


def measure(layout: str, steps: int, repeats: int) -> dict:
    mesh, step, params, opt_state, batches = setup(layout)
    runners = {"plain": None}
    states = {"plain": (params, opt_state)}
    for strategy in STRATEGIES:
        runners[strategy] = jaxsched.schedule(step, strategy=strategy)
        states[strategy] = runners[strategy].init(params, opt_state)

    def one(name: str, k: int) -> float:
        batch = batches[k % len(batches)]
        start = time.perf_counter()
        if name == "plain":
            *states[name], aux = step(*states[name], batch)
        else:
            states[name], aux = runners[name](states[name], batch)
        jax.block_until_ready((states[name], aux))
        return time.perf_counter() - start

    for name in runners:  # compile and warm up
        for k in range(2):
            one(name, k)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in tqdm(range(repeats), desc=f"{layout}: repeats", leave=False):
        for k in range(steps):
            for name in runners:
                times[name].append(one(name, k))
    plain_s = statistics.median(times["plain"])
    lowered_plain = step.lower(params, opt_state, batches[0]).compile()
    result = {
        "mesh": dict(mesh.shape),
        "plain": {
            "median_step_s": plain_s,
            "state_bytes_per_device": device_bytes((params, opt_state)),
            "compiled": memory(lowered_plain),
            "collectives": collectives(lowered_plain),
        },
    }
    for strategy in STRATEGIES:
        sched = runners[strategy]
        state = states[strategy]
        median = statistics.median(times[strategy])
        compiled = sched.lower(state, batches[0]).compile()
        result[strategy] = {
            "median_step_s": median,
            "vs_plain": median / plain_s,
            "state_bytes_per_device": device_bytes((state.params, state.opt_state, state.collective_state)),
            "compiled": memory(compiled),
            "collectives": collectives(compiled),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each runner per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sharded_params.json")
    args = parser.parse_args()
    results = {
        "what": "jax.jit steps with sharded parameters: per-step time, state per device and compiled memory, "
        "each strategy against the plain jit step in the same run (8 virtual CPU devices; XLA:CPU runs "
        "collectives synchronously: the times measure the transform's cost, not overlap)",
        "command": f"benchmarks/sharded_params.py --steps {args.steps} --repeats {args.repeats}",
        "model": f"{LAYERS} dense layers of {WIDTH} (tanh), weights P('fsdp', None), biases replicated, "
        f"clip_by_global_norm + adamw, {PER_DEVICE} rows per device",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__},
        "layouts": {},
    }
    for layout in tqdm(LAYOUTS, desc="layouts"):
        results["layouts"][layout] = measure(layout, args.steps, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for layout, r in results["layouts"].items():
        plain = r["plain"]
        print(
            f"{layout}: plain {plain['median_step_s'] * 1e3:.1f} ms, "
            f"state {plain['state_bytes_per_device'] / 1e6:.2f} MB, "
            f"peak {plain['compiled'].get('peak_bytes', 0) / 1e6:.2f} MB"
        )
        kinds = lambda c: ", ".join(f"{v['count']} {k}" for k, v in c.items())
        print(f"  plain collectives: {kinds(plain['collectives'])}")
        for strategy in STRATEGIES:
            s = r[strategy]
            print(
                f"  {strategy:9s} {s['median_step_s'] * 1e3:7.1f} ms ({s['vs_plain']:.2f}x), state "
                f"{s['state_bytes_per_device'] / 1e6:.2f} MB, peak {s['compiled'].get('peak_bytes', 0) / 1e6:.2f} MB; "
                f"{kinds(s['collectives'])}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
