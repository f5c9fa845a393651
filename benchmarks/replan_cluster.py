"""A static bucket plan against ``replan="auto"`` while the emulated cluster's links change.

Two hosts of the emulated cluster, each one process with two CPU devices (the host engine:
compute on one, collectives on the other), ``--steps`` steps of a tanh MLP under ``wfbp``:

* steps ``[0, a)`` at ``--fast``, ``[a, b)`` at ``--slow``, ``[b, steps)`` at ``--fast`` again
  (``--change-at a,b``); rank 0 changes every link itself between two steps
  (`jaxsched.tools.cluster.set_links`), both processes waiting for each other around it;
* ``static``: planned once (``buckets="auto"``) for the network measured at the start;
* ``replan``: the same first plan (the same layer and network profiles are handed to it),
  with ``replan=`` (``"auto"`` unless ``--every`` is given): it probes the network every
  ``every`` steps and switches plan when the simulator predicts a gain.

The two run interleaved, step by step (which one goes first alternates), so they share the
machine's and the network's state. Per phase: the median step of each, the phase's ceiling
(the compute-only step and a gradient-sized psum dispatched together, as ``jaxsched bench``
measures it, timed in the middle of the phase), the compute-only and comm-only times; the
replans with their step numbers, the simulator's predicted gain, and the wall time of the
first step on each new plan (tracing and compiling included when the plan is new) against
the median of that phase. Measured, not simulated, except the predicted gains.

    jaxsched cluster up --hosts 2 --prefix jxr --subnet 10.197.0.0/24
    jaxsched launch --hosts 2 --cluster --prefix jxr --cpu-devices 2 -- \\
        python benchmarks/replan_cluster.py --prefix jxr --json benchmarks/results/replan_cluster.json
    jaxsched cluster down --prefix jxr

Each process is pinned to one core of the machine (two cores: the runs of other jobs on it
show up as noise in every variant alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jaxsched.tools.launch

#: the replanned schedule's first call is a warm-up: its call ``n`` is benchmark step ``n - 2``
WARM_UP_CALLS = 1


def summarize(report: dict) -> dict:
    """Per phase and per switch, what the raw step times say (adds ``phases`` to ``report``).

    A decision taken after the replanned schedule's call ``d.step`` follows benchmark step
    ``d.step - 1 - WARM_UP_CALLS``; a switch record's ``step`` counts the calls before the
    new plan's first one, so that first step is benchmark step ``step - WARM_UP_CALLS``.
    Each switch's measured gain is taken over the steps it ran after its first one (which
    traces and compiles) and before the next switch, against the static plan's same steps.
    """
    times, out = report["step_s"], []
    for d in report["decisions"]:
        d["after_benchmark_step"] = d["step"] - 1 - WARM_UP_CALLS
    firsts = [r["step"] - WARM_UP_CALLS for r in report["replans"]]
    for k, r in enumerate(report["replans"]):
        first = firsts[k]
        end = firsts[k + 1] if k + 1 < len(firsts) else len(times["replan"])
        r["first_benchmark_step"] = first
        seg = (first + 1, end)
        if seg[1] - seg[0] >= 5:
            s_med = statistics.median(times["static"][seg[0] : seg[1]])
            r_med = statistics.median(times["replan"][seg[0] : seg[1]])
            r.update(
                {
                    "measured_over": list(seg),
                    "static_median_s": s_med,
                    "replan_median_s": r_med,
                    "measured_gain": 1 - r_med / s_med,
                }
            )
    for (lo, hi, bandwidth), bound in zip(report["phase_steps"], report["bounds"]):
        med = {n: statistics.median(times[n][lo:hi]) for n in times}
        switches = [r for r in report["replans"] if lo <= r["first_benchmark_step"] < hi]
        for r in switches:
            r["first_step_over_phase_median_s"] = r["first_step_s"] - med["replan"]
        out.append(
            {
                "steps": [lo, hi],
                "bandwidth": bandwidth,
                "static_median_s": med["static"],
                "replan_median_s": med["replan"],
                **bound,
                "replan_vs_static": med["replan"] / med["static"],
                "static_vs_ceiling": med["static"] / bound["ceiling_s"],
                "replan_vs_ceiling": med["replan"] / bound["ceiling_s"],
                "replans": [r["first_benchmark_step"] for r in switches],
                "monitor_s": sum(d["seconds"] for d in report["decisions"] if lo <= d["after_benchmark_step"] < hi),
                "static_total_s": sum(times["static"][lo:hi]),
                "replan_total_s": sum(times["replan"][lo:hi]),
            }
        )
    report["phases"] = out
    return report


def format_report(report: dict) -> str:
    lines = [
        report["command"],
        "phase | link | static median | replan median | ceiling | "
        "static total | replan total | monitoring | switches (first step)",
    ]
    for row in report["phases"]:
        lines.append(
            f"{row['steps'][0]}-{row['steps'][1] - 1} | {row['bandwidth']} | "
            f"{row['static_median_s'] * 1e3:.0f} ms | {row['replan_median_s'] * 1e3:.0f} ms | "
            f"{row['ceiling_s'] * 1e3:.0f} ms | {row['static_total_s']:.1f} s | "
            f"{row['replan_total_s']:.1f} s | {row['monitor_s']:.2f} s | {row['replans']}"
        )
    for d in report["decisions"]:
        gain = "-" if d["predicted_gain"] is None else f"{d['predicted_gain']:.1%}"
        lines.append(
            f"decision after step {d['after_benchmark_step']}: drift {d['drift']:.2f}, "
            f"predicted gain {gain}, switched {d['switched']}, {d['seconds'] * 1e3:.0f} ms"
        )
    for r in report["replans"]:
        measured = (
            f", measured {r['measured_gain']:.1%} over steps {r['measured_over']}" if "measured_gain" in r else ""
        )
        lines.append(
            f"switch, first step {r['first_benchmark_step']}: {len(r['old_buckets'])} -> "
            f"{len(r['new_buckets'])} buckets, predicted gain {r['predicted_gain']:.1%}"
            f"{measured}; first step {r['first_step_s']:.2f} s (reused={r['reused']})"
        )
    return "\n".join(lines)


if __name__ == "__main__" and "--summarize" in sys.argv:  # re-read a saved result, no cluster
    saved = json.loads(Path(sys.argv[sys.argv.index("--summarize") + 1]).read_text())
    print(format_report(summarize(saved)))
    sys.exit(0)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--change-at", default="100,200", help="steps where the links change")
parser.add_argument("--fast", default="1gbit")
parser.add_argument("--slow", default="100mbit")
parser.add_argument("--prefix", default="jxr", help="the emulated cluster's prefix")
parser.add_argument("--width", type=int, default=384)
parser.add_argument("--depth", type=int, default=12)
parser.add_argument(
    "--batch", type=int, default=None, help="rows per process (default: calibrated so compute ~ comm at --fast)"
)
parser.add_argument("--every", type=int, default=None, help="Replan(every=...); default 'auto'")
parser.add_argument("--min-gain", type=float, default=None, help="Replan(min_gain=...)")
parser.add_argument("--no-pin", action="store_true", help="do not pin each process to a core")
parser.add_argument("--json", help="write the result here (rank 0)")
parser.add_argument("--summarize", metavar="JSON", help="print the report of a saved result and exit")
args = parser.parse_args()

if not args.no_pin:  # before JAX starts its thread pools, so that every thread inherits the core
    rank_env = int(os.environ.get(jaxsched.tools.launch.ENV_PROCESS_ID, "0"))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank_env % len(cores)]})
info = jaxsched.tools.launch.initialize(cpu_devices=2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.tools import cluster  # noqa: E402
from jaxsched.tools.bench import calibrate_batch  # noqa: E402
from jaxsched.runtime.engine._host import spare_devices  # noqa: E402
from jaxsched.pipeline.replan import Replan, without_engine_costs  # noqa: E402

rank, nproc = jax.process_index(), jax.process_count()
mesh_devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]
mesh = jax.sharding.Mesh(np.array(mesh_devices), ("data",))
spare_mesh = jax.sharding.Mesh(np.array(spare_devices(mesh)), ("data",))
batch_sharding = NamedSharding(mesh, P("data"))
width, depth = args.width, args.depth
keys = jax.random.split(jax.random.PRNGKey(0), depth)
params = {
    f"layer{i:02d}": {"kernel": jax.random.normal(keys[i], (width, width)) / width**0.5, "bias": jnp.zeros(width)}
    for i in range(depth)
}
tx = optax.sgd(1e-3, momentum=0.9)


def loss_fn(p, x, y):
    for i in range(depth):
        x = jnp.tanh(x @ p[f"layer{i:02d}"]["kernel"] + p[f"layer{i:02d}"]["bias"])
    return jnp.mean((x - y) ** 2)


def make(reduce: bool):
    def body(p, s, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        if reduce:
            grads = lax.pmean(grads, "data")
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, {"loss": lax.pmean(loss, "data")}

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )


step, compute_only = make(True), make(False)
n_grads = sum(np.size(leaf) for leaf in jax.tree.leaves(params))


def psum(m):
    return jax.jit(
        jax.shard_map(lambda g: lax.psum(g, "data"), mesh=m, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )


comm_only, spare_comm = psum(mesh), psum(spare_mesh)
grads_like = jax.make_array_from_process_local_data(batch_sharding, np.ones((1, n_grads), np.float32))
spare_grads = jax.make_array_from_process_local_data(
    NamedSharding(spare_mesh, P("data")), np.ones((1, n_grads), np.float32)
)
state0 = (params, tx.init(params))


def batch_of(rows: int, seed: int):
    rng = np.random.default_rng(seed * nproc + rank)
    local = (
        rng.standard_normal((rows, width)).astype(np.float32),
        rng.standard_normal((rows, width)).astype(np.float32),
    )
    return tuple(jax.make_array_from_process_local_data(batch_sharding, a) for a in local)


def timed(fn, *a) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*a))
    return time.perf_counter() - start


def median_time(fn, *a, repeats: int = 5) -> float:
    timed(fn, *a)
    return statistics.median(timed(fn, *a) for _ in range(repeats))


def agreed(values):
    return [float(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64))]


def set_links(bandwidth: str) -> None:
    multihost_utils.sync_global_devices(f"links {bandwidth} before")
    if rank == 0:
        cluster.set_links(args.prefix, bandwidth)
    multihost_utils.sync_global_devices(f"links {bandwidth} after")


set_links(args.fast)
rows = args.batch
calibration = None
if rows is None:

    def measure(probe: int) -> tuple[float, float]:
        c = median_time(compute_only, *state0, batch_of(probe, 0), repeats=3)
        m = median_time(comm_only, grads_like, repeats=3)
        return tuple(agreed([c, m]))

    cal = calibrate_batch(measure, 256, tolerance=0.15, max_probes=5, multiple=8, max_batch=8192)
    rows, calibration = cal.batch, cal.to_dict()
batches = [batch_of(rows, s) for s in range(4)]

static = jaxsched.schedule(step, strategy="wfbp", engine="host", buckets="auto")
states = {"static": static.init(*state0)}
states["static"], _ = static(states["static"], batches[0])
layer_profile = static.program.layer_profile
network_profile = without_engine_costs(static.program.network_profile)
options = (
    "auto"
    if args.every is None and args.min_gain is None
    else Replan(**{k: v for k, v in (("every", args.every), ("min_gain", args.min_gain)) if v is not None})
)
replan = jaxsched.schedule(
    step,
    strategy="wfbp",
    engine=static.engine,
    replan=options,
    layer_profile=layer_profile,
    network_profile=network_profile,
)
states["replan"] = replan.init(*state0)
scheds = {"static": static, "replan": replan}
# warm-up: one step each besides the first static one (every program compiled before timing)
states["replan"], _ = replan(states["replan"], batches[0])
assert [len(b.params) for b in replan.program.buckets] == [len(b.params) for b in static.program.buckets]
first_plan = [[static.program.planned.paths[i] for i in b.params] for b in static.program.buckets]


def run(name: str, b) -> float:
    start = time.perf_counter()
    new_state, aux = scheds[name](states[name], b)
    jax.block_until_ready((new_state, aux))
    states[name] = new_state
    return time.perf_counter() - start


def ceiling(b) -> dict:
    def both():
        return spare_comm(spare_grads), compute_only(*state0, b)

    return {
        "ceiling_s": median_time(both, repeats=3),
        "compute_s": median_time(compute_only, *state0, b, repeats=3),
        "comm_s": median_time(comm_only, grads_like, repeats=3),
    }


a, b = (int(x) for x in args.change_at.split(","))
phases = [(0, a, args.fast), (a, b, args.slow), (b, args.steps, args.fast)]
times = {"static": [], "replan": []}
bounds = []
# The replanner counts the warm-up step: its step k here is the replanner's step k + 1.
for lo, hi, bandwidth in phases:
    if lo:
        set_links(bandwidth)
    middle = (lo + hi) // 2
    for k in range(lo, hi):
        if k == middle:
            bounds.append(ceiling(batches[k % 4]))
        order = ("static", "replan") if k % 2 == 0 else ("replan", "static")
        for name in order:
            times[name].append(run(name, batches[k % 4]))
set_links(args.fast)

if rank == 0:
    report = {
        "command": "jaxsched launch --hosts 2 --cluster --prefix jxr --cpu-devices 2 -- python "
        "benchmarks/replan_cluster.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and k not in ("json", "no_pin", "summarize")
        ),
        "processes": nproc,
        "batch_per_process": rows,
        "calibration": calibration,
        "model": {"width": width, "depth": depth, "gradient_bytes": int(4 * n_grads)},
        "replan_options": str(options),
        "first_plan": first_plan,
        "monitor": "stages" if replan._replanner._stages else "probe",
        "planned_network": network_profile.to_dict(),
        "phase_steps": [[lo, hi, bw] for lo, hi, bw in phases],
        "bounds": bounds,
        "replans": [
            {
                **r._asdict(),
                "old_buckets": [list(x) for x in r.old_buckets],
                "new_buckets": [list(x) for x in r.new_buckets],
            }
            for r in replan.replans
        ],
        "decisions": [d._asdict() for d in replan.replan_decisions],
        "step_s": times,
    }
    summarize(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
    print(format_report(report))
