"""Per-call cost of the scheduled step on one device, where scheduling can gain nothing.

Run: ``.venv/bin/python benchmarks/call_overhead.py [--steps 400] [--width 64]``. Writes
``benchmarks/results/call_overhead.json``.

A ``jax.jit`` step ``(params, opt_state, batch) -> (params, opt_state, loss)`` of an MLP
(``--layers`` dense layers of ``--width``, batch ``--batch``, SGD with momentum) runs plain
and under each strategy on one CPU device. The steps are interleaved, in a shuffled order
each round, one step in flight (each call is blocked on), so that load on the machine
affects every runner alike; the medians are compared. The batches are the arrays a loader
hands over (``jnp`` arrays on the default device), cycled through, so that the scheduled
step sees what a training loop gives it. With nothing to overlap, the difference is the
Python cost of the scheduled call: the goal is within 3% and 30 us of the plain step on a
step of about 0.5 ms (``--width`` 64 is that on a 2-core CPU machine; pick the width that
gives it on yours). ``--donate`` jits the step with ``donate_argnums=(0, 1)``, as many
trainers do (the scheduled step then donates its whole state too). ``--paths`` adds, per
strategy, the same schedule with every loop call through the checked path, its batch
compared leaf by leaf in Python (``S:checked``, as before a training loop's call went
straight to the jitted core, which checks it) and the compiled program called
directly on the flat state and batch leaves, with no jaxsched Python at all
(``S:program``): where a strategy's cost goes, measured in the same run. With ``approx``
among the strategies, ``plain+pending`` runs the plain step that also returns its
gradients as ``approx`` holds them, and a count (`make_carrying_step`): what ``approx``'s
recurrence must carry from one step to the next, so the floor under its cost here.

On a GPU: ``JAX_PLATFORMS=cuda python3 benchmarks/call_overhead.py --width 1024 --batch 4096
--out OUT.json`` (about 0.5 ms a step on one H100 or H200); ``--width 64`` there gives a step
that is almost all dispatch, the worst case for a per-call cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.strategies._approx import PendingLayout  # noqa: E402

STRATEGIES = ("allreduce", "wfbp", "dear", "approx")


def mlp(width: int, layers: int, key: jax.Array) -> list[dict]:
    keys = jax.random.split(key, layers)
    return [{"w": jax.random.normal(k, (width, width)) * width**-0.5, "b": jnp.zeros(width, jnp.float32)} for k in keys]


def mlp_loss(params: list[dict], batch: tuple) -> jax.Array:
    x, y = batch
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def make_step(tx: optax.GradientTransformation, donate: bool = False):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def pending_like_approx(grads: list) -> tuple:
    """One step's gradients as ``approx`` holds them on one device (its `PendingLayout`:
    each large one its own array, the small ones packed per dtype), each with a leading
    device axis."""
    layout = PendingLayout.of([jax.ShapeDtypeStruct(g.shape, g.dtype) for g in grads])
    return tuple(a[None] for a in layout.pack(grads))


def make_carrying_step(tx: optax.GradientTransformation, donate: bool = False):
    """The plain step that also returns its gradients as ``approx``'s state holds them
    (`pending_like_approx`), and a count: what ``approx`` carries between steps on one
    device (``staleness=1``). The ``plain+pending`` runner: the floor under ``approx``'s
    cost here, since its recurrence holds one step's gradients until the next."""

    def step(params, opt_state, pending, count, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        pending = pending_like_approx(jax.tree.leaves(grads))
        return optax.apply_updates(params, updates), opt_state, pending, jnp.minimum(count + 1, 1), loss

    return jax.jit(step, donate_argnums=(0, 1, 2, 3) if donate else ())


def interleaved(runners: dict, batches: list, n_steps: int) -> dict[str, list[float]]:
    """Seconds per step of each runner, steps interleaved in a shuffled order per round."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = random.Random(0)
    for i in range(n_steps + 10):
        names = list(runners)
        order.shuffle(names)
        for name in names:
            run = runners[name]
            start = time.perf_counter()
            jax.block_until_ready(run(batches[i % len(batches)]))
            if i >= 10:  # the first calls compile and warm up
                times[name].append(time.perf_counter() - start)
    return times


def call_paths(strategy: str, step, params, tx, batch) -> dict:
    """``S:checked`` and ``S:program`` runners for ``--paths`` (reading the schedule's
    program: a benchmark of jaxsched's own call path)."""
    checked = jaxsched.schedule(step, strategy=strategy)
    bare = jaxsched.schedule(step, strategy=strategy)
    box = {}
    for name, sched in (("checked", checked), ("bare", bare)):
        box[name], _ = sched(sched.init(jax.tree.map(jnp.copy, params), tx.init(params)), batch)
    checked.program._batch_unchecked = False  # every loop call's batch checked in Python:
    checked._loop_call = None  # no training loop's call (`Program.loop_call`) for this program
    core, consts = bare.program.core, bare.program._device_consts()
    leaves = jax.tree.leaves(bare.program.returned)
    box["leaves"] = leaves

    def checked_call(b):
        box["checked"], loss = checked(box["checked"], b)
        return loss

    def program_call(b):
        outs = core(*box["leaves"], *jax.tree.leaves(b), *consts)
        box["leaves"] = list(outs[: len(leaves)])
        return outs[-1]

    return {f"{strategy}:checked": checked_call, f"{strategy}:program": program_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument(
        "--donate", action="store_true", help="jit the step with donate_argnums=(0, 1), as many trainers do"
    )
    parser.add_argument(
        "--paths", action="store_true", help="also time each strategy's checked call and its bare compiled program"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "call_overhead.json"))
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]

    tx = optax.sgd(1e-2, momentum=0.9)
    step = make_step(tx, args.donate)
    params = mlp(args.width, args.layers, jax.random.key(0))
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  # each runner its own: a donating step frees its state
    rng = np.random.default_rng(0)
    batches = [
        (
            jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32),
            jnp.asarray(rng.standard_normal((args.batch, args.width)), jnp.float32),
        )
        for _ in range(4)
    ]

    box = {"plain": (copy(params), tx.init(params))}

    def plain(batch):
        *box["plain"], loss = step(*box["plain"], batch)
        return loss

    runners = {"plain": plain}
    if "approx" in strategies:
        carrying = make_carrying_step(tx, args.donate)
        pending = pending_like_approx([jnp.zeros_like(leaf) for leaf in jax.tree.leaves(params)])
        box["plain+pending"] = (copy(params), tx.init(params), pending, jnp.zeros((), jnp.int32))

        def plain_pending(batch):
            *box["plain+pending"], loss = carrying(*box["plain+pending"], batch)
            return loss

        runners["plain+pending"] = plain_pending
    for strategy in strategies:
        sched = jaxsched.schedule(step, strategy=strategy)
        box[strategy] = sched.init(copy(params), tx.init(params))

        def scheduled(batch, sched=sched, name=strategy):
            box[name], loss = sched(box[name], batch)
            return loss

        runners[strategy] = scheduled
        if args.paths:
            runners.update(call_paths(strategy, step, copy(params), tx, batches[0]))

    times = interleaved(runners, batches, args.steps)
    median_us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    plain_us = median_us["plain"]
    result = {
        "command": "benchmarks/call_overhead.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, 1 {jax.devices()[0].device_kind} device",
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "model": f"MLP {args.layers} x {args.width}, batch {args.batch}, sgd momentum 0.9",
        "donate_argnums": [0, 1] if args.donate else [],
        "steps": args.steps,
        "median_step_us": median_us,
        "over_plain_us": {s: median_us[s] - plain_us for s in median_us if s != "plain"},
        "ratio_to_plain": {s: median_us[s] / plain_us for s in median_us if s != "plain"},
        "goal": "each strategy within 3% and 30 us of the plain step",
    }
    if "plain+pending" in median_us:
        floor = median_us["plain+pending"]
        result["approx_over_plain_pending_us"] = median_us["approx"] - floor
        result["approx_ratio_to_plain_pending"] = median_us["approx"] / floor
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"plain {plain_us:.0f} us")
    if "approx_over_plain_pending_us" in result:
        print(f"approx over plain+pending: {result['approx_over_plain_pending_us']:+.0f} us")
    for s in result["ratio_to_plain"]:
        print(
            f"{s:10s} {median_us[s]:7.0f} us  x{result['ratio_to_plain'][s]:.3f}  {result['over_plain_us'][s]:+.0f} us"
        )


if __name__ == "__main__":
    main()
