"""Does compute slow down while a collective runs on the other local device?

Run under the emulated cluster (2 hosts, 1 Gbit links, one core per process):

    .venv/bin/python -c "import sys; from jaxsched.tools import cluster, launch; \\
        c = cluster.Cluster.up(2, '1gbit', prefix='jxse'); \\
        code = launch.launch(2, [sys.executable, 'benchmarks/host_contention.py'], cluster=c); \\
        c.down(); sys.exit(code)"

Each process has two CPU devices: a 2-layer backward (2048 wide, batch 224) on device 0,
a psum of 8.4M float32 (33.6 MB) over every process's device 1. Medians of 8 rounds of
compute alone, the psum alone, and both dispatched together (time until the compute is
done, and until both are). Rank 0 writes ``benchmarks/results/host_contention.json``.
"""

import json
import os
import statistics
import time
from pathlib import Path

import jaxsched.tools.launch

jaxsched.tools.launch.initialize(cpu_devices=2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

rank = jax.process_index()
cores = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cores[rank % len(cores)]})
spare = [
    max((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(jax.process_count())
]
comm_mesh = jax.sharding.Mesh(np.array(spare), ("data",))
psum = jax.jit(
    jax.shard_map(
        lambda g: lax.psum(g, "data"), mesh=comm_mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False
    )
)
grads = jax.make_array_from_process_local_data(NamedSharding(comm_mesh, P("data")), np.ones((1, 8_400_000), np.float32))
device = jax.local_devices()[0]
width = 2048
x = jax.device_put(np.random.default_rng(rank).standard_normal((224, width)).astype(np.float32), device)
w = jax.device_put(np.random.default_rng(9).standard_normal((width, width)).astype(np.float32) / 50, device)


@jax.jit
def compute(x, w):
    return jax.grad(lambda w: jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)


def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


compute(x, w).block_until_ready()
psum(grads).block_until_ready()
rounds = {"compute_s": [], "comm_s": [], "compute_during_comm_s": [], "both_s": []}
for _ in range(8):
    rounds["compute_s"].append(timed(lambda: compute(x, w)))
    rounds["comm_s"].append(timed(lambda: psum(grads)))
    start = time.perf_counter()
    reduced = psum(grads)
    done = compute(x, w)
    done.block_until_ready()
    rounds["compute_during_comm_s"].append(time.perf_counter() - start)
    reduced.block_until_ready()
    rounds["both_s"].append(time.perf_counter() - start)
if rank == 0:
    result = {k: statistics.median(v) for k, v in rounds.items()}
    result["all"] = rounds
    out = Path(__file__).parent / "results" / "host_contention.json"
    out.write_text(json.dumps(result, indent=1))
    print({k: round(v * 1e3, 1) for k, v in result.items() if k != "all"})
