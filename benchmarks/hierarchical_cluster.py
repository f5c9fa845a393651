"""Hierarchical against flat gradient sums on the emulated cluster, measured.

Every process of ``jaxsched launch`` holds ``--cpu-devices`` local CPU devices. The step is
data parallel over ``("hosts", "local")``: the batch is sharded over both and the
gradients are ``pmean``ed over both. It runs three ways, interleaved step by step so that
they share the machine's state:

* ``plain``: the user's step (XLA:CPU's all-reduce over all devices);
* ``wfbp, flat``: ``collective=Collective()``, one psum per bucket over both axes;
* ``wfbp, hierarchical``: the collective jaxsched picks on this mesh, because the devices
  say that ``hosts`` crosses processes: ``Hierarchical(fast="local", slow="hosts")``.

Per variant: the median step time of ``--steps`` steps, and the bytes this host's
interface sent per step (``/sys/class/net/<if>/statistics/tx_bytes`` in its namespace:
every byte that crossed hosts, gloo's framing and TCP included). Measured, not simulated.

    .venv/bin/jaxsched cluster up --hosts 2 --bandwidth 1gbit
    .venv/bin/jaxsched launch --hosts 2 --cluster --cpu-devices 2 -- \\
        .venv/bin/python benchmarks/hierarchical_cluster.py --json benchmarks/results/hierarchical_cluster.json
    .venv/bin/jaxsched cluster down

The machine has 2 cores: each process's two devices and gloo share them, so step times
are the emulated cluster's, not a real one's; the bytes do not depend on that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jaxsched.tools.launch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
parser.add_argument("--hidden", default="1024,1024", help="MLP hidden sizes (comma separated)")
parser.add_argument("--batch-per-device", type=int, default=16)
parser.add_argument("--json", help="write the result here (rank 0)")
args = parser.parse_args()

info = jaxsched.tools.launch.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps
from jaxsched.runtime.collectives import Collective  # noqa: E402

local = jax.local_device_count()
mesh = jax.make_mesh((info.num_processes, local), ("hosts", "local"), devices=jax.devices())
axes = ("hosts", "local")
hidden = tuple(int(h) for h in args.hidden.split(","))
params, apply_fn = models.pure(models.build("mlp", (32, 32, 1), 10, seed=0, hidden=hidden))
tx = optax.sgd(1e-2, momentum=0.9)
step = steps.make_step(apply_fn, tx, mesh, axis=axes)
n_params = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))

rng = np.random.default_rng(info.process_id)
rows = args.batch_per_device * local
local_batch = (rng.standard_normal((rows, 32, 32, 1)).astype(np.float32), rng.integers(0, 10, rows).astype(np.int32))
batch = tuple(jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)), a) for a in local_batch)


def tx_bytes() -> int:
    if not info.interface:
        return 0
    return int(Path(f"/sys/class/net/{info.interface}/statistics/tx_bytes").read_text())


class Plain:
    def __init__(self):
        self.state = (params, tx.init(params))

    def __call__(self):
        p, o, aux = step(*self.state, batch)
        self.state = (p, o)
        return aux


class Scheduled:
    def __init__(self, **options):
        self.sched = jaxsched.schedule(step, strategy="wfbp", **options)
        self.state = self.sched.init(params, tx.init(params))

    def __call__(self):
        self.state, aux = self.sched(self.state, batch)
        return aux


class CommOnly:
    """The gradient bytes summed alone, without compute: where the step's time goes."""

    def __init__(self, collective):
        from jaxsched.runtime.collectives import BucketSpec

        spec = BucketSpec(
            0, n_params, np.dtype(np.float32), mesh.size, mesh_axes=tuple((a, mesh.shape[a]) for a in axes)
        )
        state = collective.init([spec])[0]
        body = lambda x: collective.all_reduce(x[0], axes, spec, state)[0][None]
        self.run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False))
        self.x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P(axes)), np.ones((local, n_params), np.float32)
        )

    def __call__(self):
        return self.run(self.x)


variants = {"plain": Plain(), "wfbp, flat": Scheduled(collective=Collective()), "wfbp, hierarchical": Scheduled()}
for run in variants.values():  # compile and warm up
    jax.block_until_ready(run())
    jax.block_until_ready(run())
hierarchy = variants["wfbp, hierarchical"].sched.program.strategy.collective
chosen = repr(hierarchy)
variants["comm only, flat"] = CommOnly(Collective())
variants["comm only, hierarchical"] = CommOnly(hierarchy)
for name in ("comm only, flat", "comm only, hierarchical"):
    jax.block_until_ready(variants[name]())
times = {name: [] for name in variants}
sent = {name: 0 for name in variants}
for _ in range(args.steps):
    for name, run in variants.items():
        before, start = tx_bytes(), time.perf_counter()
        jax.block_until_ready(run())
        times[name].append(time.perf_counter() - start)
        sent[name] += tx_bytes() - before
# the three trajectories agree: same data, same initial state, exact strategies
final = {
    name: np.asarray(
        jax.tree.leaves(v.state if name == "plain" else v.sched.finalize(v.state))[0].addressable_shards[0].data
    )
    for name, v in variants.items()
    if not name.startswith("comm only")
}
agree = all(np.allclose(final["plain"], f, rtol=1e-4, atol=1e-6) for f in final.values())
every = jax.experimental.multihost_utils.process_allgather(np.array([sent[name] / args.steps for name in variants]))
if info.process_id == 0:
    result = {
        "what": "measured on the emulated cluster (network namespaces + tc)",
        "processes": info.num_processes,
        "local_devices": local,
        "mesh": dict(mesh.shape),
        "interface": info.interface,
        "params": n_params,
        "gradient_bytes": 4 * n_params,
        "steps": args.steps,
        "hierarchical_collective": chosen,
        "trajectories_agree": agree,
        "variants": {
            name: {
                "median_step_s": statistics.median(times[name]),
                "min_step_s": min(times[name]),
                "tx_bytes_per_step_per_host": [float(b) for b in every[:, k]],
            }
            for k, name in enumerate(variants)
        },
    }
    print(
        f"{n_params / 1e6:.1f}M params ({4 * n_params / 1e6:.1f} MB of gradients), "
        f"{info.num_processes} hosts x {local} devices, interface {info.interface or 'loopback'}; "
        f"hierarchical = {chosen}; trajectories agree: {agree}"
    )
    for name in variants:
        row = result["variants"][name]
        print(
            f"  {name:<20} median step {row['median_step_s'] * 1e3:8.1f} ms   sent per step per host "
            f"{np.mean(row['tx_bytes_per_step_per_host']) / 1e6:8.2f} MB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
jax.distributed.shutdown()
