"""DiLoCo against per-step gradient sums on the emulated cluster, measured in one run.

Two processes (``jaxsched launch --cluster``), each in its own network namespace behind a
shaped link, each with two local CPU devices; the step runs on a mesh of each process's
first device (the second is the host engine's spare device). A 4-layer 1448-wide MLP
(33.6 MB of gradients; fragments are whole leaves, so four layers give four fragments of
about equal size), ``sgd(momentum=0.9)``. Variants, interleaved step by step:

* ``compute`` (the ceiling): the same step without the gradient reduction;
* ``allreduce``: the user's step (pmean after backward);
* ``wfbp`` and ``approx`` (staleness 1) on the ``host`` engine;
* ``diloco`` with H=10: one fragment; four fragments with τ=1; four fragments with τ=1
  and 4-bit outer gradients (``Quantize(bits=4)``), on the ``xla`` engine.

Per variant: the mean step over whole H-step cycles (DiLoCo's steps differ: most send
nothing), the median, the ratio to the ceiling, and the bytes this host's interface sent
per step (``/sys/class/net/<if>/statistics/tx_bytes``: every byte that crossed hosts).
The per-process batch is calibrated first so that compute is close to one all-reduce of
the gradients (else one side dominates). Measured, not simulated.

    jaxsched cluster up --hosts 2 --bandwidth 1gbit --prefix jxd --subnet 10.198.0.0/24
    jaxsched launch --hosts 2 --cluster --prefix jxd --cpu-devices 2 -- \\
        python benchmarks/diloco_cluster.py --json benchmarks/results/diloco_cluster.json
    jaxsched cluster down --prefix jxd
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jaxsched.tools.launch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cycles", type=int, default=2, help="timed H-step cycles per variant")
parser.add_argument("--width", type=int, default=1448)
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--batch", type=int, help="rows per process (default: calibrated)")
parser.add_argument("--json", help="write the result here (rank 0)")
args = parser.parse_args()

info = jaxsched.tools.launch.initialize(cpu_devices=2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.runtime.compress import Quantize  # noqa: E402

H = 10
rank, nproc = jax.process_index(), jax.process_count()
mesh = jax.sharding.Mesh(
    np.array([min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]),
    ("data",),
)
sharding = NamedSharding(mesh, P("data"))
width = args.width
depth = args.depth
keys = jax.random.split(jax.random.PRNGKey(0), depth)
params = {
    f"layer{i}": {"kernel": jax.random.normal(keys[i], (width, width)) / width**0.5, "bias": jnp.zeros(width)}
    for i in range(depth)
}
n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
tx = optax.sgd(1e-3, momentum=0.9)


def loss_fn(p, x, y):
    for i in range(depth):
        x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
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


plain, compute_only = make(True), make(False)
comm_only = jax.jit(
    jax.shard_map(lambda g: lax.psum(g, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
)
grads_like = jax.make_array_from_process_local_data(sharding, np.ones((1, n_params), np.float32))


def batch_of(rows: int, seed: int):
    rng = np.random.default_rng(seed * nproc + rank)
    local = (
        rng.standard_normal((rows, width)).astype(np.float32),
        rng.standard_normal((rows, width)).astype(np.float32),
    )
    return tuple(jax.make_array_from_process_local_data(sharding, a) for a in local)


def timed(fn, *a) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*a))
    return time.perf_counter() - start


def plot_timelines(timelines: dict, path: Path) -> None:
    """A Gantt chart per phase: compute stages on one row, communication stages on another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes_ = plt.subplots(len(timelines), 1, figsize=(10, 1.6 * len(timelines) + 0.6), squeeze=False)
    for ax, (key, spans) in zip(axes_[:, 0], sorted(timelines.items())):
        for s in spans:
            row = 1 if s["kind"] == "compute" else 0
            ax.barh(
                row,
                (s["done"] - s["started"]) * 1e3,
                left=s["started"] * 1e3,
                color="tab:blue" if row else "tab:orange",
                edgecolor="black",
                linewidth=0.3,
            )
        ax.set_yticks([0, 1], ["comm (spare device)", "compute"])
        sender, arriver = eval(key)  # noqa: S307 (our own repr of a tuple of ints/None)
        ax.set_title(
            f"host engine, streaming DiLoCo H={H} F=4 tau=1: step that sends fragment "
            f"{sender} and applies fragment {arriver}"
            if sender is not None
            else "host engine, streaming DiLoCo: a step that sends nothing",
            fontsize=8,
        )
    axes_[-1, 0].set_xlabel("ms since the step began (measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tx_bytes() -> int:
    if not info.interface:
        return 0
    return int(Path(f"/sys/class/net/{info.interface}/statistics/tx_bytes").read_text())


state0 = (params, tx.init(params))
rows = args.batch
if rows is None:  # compute-only close to one all-reduce of the gradients
    probe = 128
    timed(compute_only, *state0, batch_of(probe, 0))
    timed(comm_only, grads_like)
    c = statistics.median(timed(compute_only, *state0, batch_of(probe, 0)) for _ in range(3))
    m = statistics.median(timed(comm_only, grads_like) for _ in range(3))
    c, m = multihost_utils.broadcast_one_to_all(np.array([c, m]))
    rows = int(max(8, min(8192, round(probe * float(m) / float(c) / 8) * 8)))
batches = [batch_of(rows, s) for s in range(4)]

variants = {
    "compute (ceiling)": None,
    "allreduce": None,
    "wfbp (host engine)": dict(strategy="wfbp", engine="host"),
    "approx k=1 (host engine)": dict(strategy="approx", engine="host", staleness=1),
    "diloco H=10 F=1": dict(strategy="diloco", engine="xla", inner_steps=H),
    "diloco H=10 F=4 tau=1": dict(strategy="diloco", engine="xla", inner_steps=H, fragments=4, overlap_steps=1),
    "diloco H=10 F=4 tau=1 4-bit": dict(
        strategy="diloco", engine="xla", inner_steps=H, fragments=4, overlap_steps=1, compression=Quantize(bits=4)
    ),
    "diloco H=10 F=4 tau=1 (host engine)": dict(
        strategy="diloco", engine="host", inner_steps=H, fragments=4, overlap_steps=1
    ),
}
scheds, states = {}, {}
for name, options in variants.items():
    if options is None:
        states[name] = state0
        continue
    scheds[name] = jaxsched.schedule(plain, **options)
    states[name] = scheds[name].init(*state0)


def run_one(name: str, b) -> tuple[float, int]:
    before, start = tx_bytes(), time.perf_counter()
    if name in scheds:
        new, aux = scheds[name](states[name], b)
    else:
        fn = compute_only if name.startswith("compute") else plain
        *new, aux = fn(*states[name], b)
        new = tuple(new)
    jax.block_until_ready((new, aux))
    elapsed = time.perf_counter() - start
    states[name] = new
    return elapsed, tx_bytes() - before


for warm in range(2 * H):  # compile every phase's program; whole cycles keep variants in phase
    for name in variants:
        run_one(name, batches[warm % 4])
times = {name: [] for name in variants}
sent = {name: 0 for name in variants}
for step in range(args.cycles * H):
    for name in variants:
        t, b = run_one(name, batches[step % 4])
        times[name].append(t)
        sent[name] += b
# One cycle of streaming DiLoCo on the host engine with stage timestamps: the timeline of
# a step that sends a fragment (its outer all-reduce on the spare device beside the step's
# compute) and of one that sends nothing.
from jaxsched.runtime.engine import HostEngine  # noqa: E402

traced = jaxsched.schedule(
    plain, strategy="diloco", engine=HostEngine(record_timings=True), inner_steps=H, fragments=4, overlap_steps=1
)
st = traced.init(*state0)
for k in range(2 * H + 3):  # every phase twice: the timeline is a warm call
    st, aux = traced(st, batches[k % 4])
    jax.block_until_ready(aux)
timelines = {
    repr(key): [
        dict(kind=t.kind, name=t.name, dispatched=t.dispatched, started=t.started, done=t.done)
        for t in core.timings[-1]
    ]
    for key, core in traced.program._phase_cores.items()
    if core.timings
}
every = multihost_utils.process_allgather(np.array([sent[n] / (args.cycles * H) for n in variants]))
if rank == 0:
    ceiling = statistics.mean(times["compute (ceiling)"])
    base_bytes = float(np.mean(every[:, list(variants).index("allreduce")]))
    result = {
        "what": "measured on the emulated cluster (network namespaces + tc); step times "
        "are means over whole H-step cycles",
        "command": "jaxsched launch --hosts 2 --cluster --prefix jxd --cpu-devices 2 "
        "-- python benchmarks/diloco_cluster.py",
        "processes": nproc,
        "interface": info.interface,
        "params": n_params,
        "layers": {"width": width, "depth": depth},
        "gradient_bytes": 4 * n_params,
        "batch_per_process": rows,
        "inner_steps": H,
        "cycles": args.cycles,
        "variants": {},
        "host_engine_timelines": timelines,
    }
    print(
        f"{n_params / 1e6:.1f}M params, {nproc} hosts, batch {rows} per host, interface {info.interface or 'loopback'}"
    )
    print(
        f"  {'variant':<30} {'mean ms':>8} {'median ms':>9} {'x ceiling':>9} {'MB sent/step':>12} {'fewer bytes':>11}"
    )
    for k, name in enumerate(variants):
        mean = statistics.mean(times[name])
        per_step = float(np.mean(every[:, k]))
        row = {
            "mean_step_s": mean,
            "median_step_s": statistics.median(times[name]),
            "ratio_to_ceiling": mean / ceiling,
            "tx_bytes_per_step_per_host": [float(b) for b in every[:, k]],
            "bytes_reduction_vs_allreduce": (base_bytes / per_step if per_step > 0.01 * base_bytes else None),
            "step_s_all": times[name],
        }
        result["variants"][name] = row
        fewer = f"{row['bytes_reduction_vs_allreduce']:.1f}x" if row["bytes_reduction_vs_allreduce"] else "-"
        print(
            f"  {name:<30} {mean * 1e3:8.1f} {row['median_step_s'] * 1e3:9.1f} "
            f"{row['ratio_to_ceiling']:9.2f} {per_step / 1e6:12.2f} {fewer:>11}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        plot_timelines(timelines, Path(args.json).with_suffix(".png"))
jax.distributed.shutdown()
