"""Time a psum of float32 between processes started by ``jaxsched.tools.launch``.

One process per host, one CPU device each; gloo collectives (bound to the namespace's
interface under ``--cluster``). Rank 0 prints the median, min and max of ``--reps`` timed
psums after one warm-up, and with ``--json`` appends a row to that file.

    # loopback
    .venv/bin/jaxsched launch --hosts 2 -- python benchmarks/cluster_psum.py
    # two namespaces, unshaped and at 1 Gbit/s (root)
    .venv/bin/jaxsched launch --hosts 2 --cluster --bandwidth none -- \\
        python benchmarks/cluster_psum.py --label unshaped
    .venv/bin/jaxsched launch --hosts 2 --cluster --bandwidth 1gbit -- \\
        python benchmarks/cluster_psum.py --label 1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxsched.tools.launch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mb", type=float, default=40.0, help="megabytes (10**6) per process")
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--label", default="", help="what this run is, e.g. '1gbit'")
parser.add_argument("--json", help="append a JSON line with the result to this file")
args = parser.parse_args()

info = jaxsched.tools.launch.initialize(cpu_devices=1)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((info.num_processes,), ("x",), devices=jax.devices())
psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
n = int(args.mb * 1e6) // 4
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(n, np.float32))
first = np.asarray(jax.block_until_ready(psum(x)).addressable_shards[0].data[:1])
assert first[0] == info.num_processes, first
times = []
for _ in range(args.reps):
    t = time.perf_counter()
    jax.block_until_ready(psum(x))
    times.append(time.perf_counter() - t)
if info.process_id == 0:
    row = {
        "label": args.label,
        "processes": info.num_processes,
        "mb": args.mb,
        "interface": info.interface,
        "reps": args.reps,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }
    print(
        f"psum {args.mb:g} MB float32, {info.num_processes} processes, "
        f"interface {info.interface or 'default'} {args.label}: "
        f"median {row['median_s'] * 1e3:.0f} ms (min {row['min_s'] * 1e3:.0f}, "
        f"max {row['max_s'] * 1e3:.0f}, {args.reps} reps)",
        flush=True,
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
jax.distributed.shutdown()
