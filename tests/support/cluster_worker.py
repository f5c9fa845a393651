"""One process under ``jaxsched.tools.launch``: ``python cluster_worker.py MODE [ARGS]``.

Modes:
  echo            print one line on stdout and one on stderr (no JAX)
  fail-sleep [PIDFILE]  rank 1 exits 3 after 0.2 s, the others sleep (no JAX); rank 0
                  writes its pid to PIDFILE
  fail-collective rank 1 crashes (exit 3) after jax.distributed starts; the others block in a psum
  raise           rank 1 raises after jax.distributed starts; the others block in a psum
  psum [MB REPS]  psum of (rank + 1) over every process; prints the sum (and timings with MB)
"""

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # tests/: `support` importable
import os
import sys
import time

mode = sys.argv[1]
rank = int(os.environ.get("JAXSCHED_PROCESS_ID", "-1"))

if mode == "echo":
    print(f"hello from {rank} of {os.environ['JAXSCHED_NUM_PROCESSES']}")
    print(f"stderr line of {rank}", file=sys.stderr)
    sys.exit(0)
if mode == "fail-sleep":
    if rank == 0 and len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(0.2)
        sys.exit(3)
    time.sleep(600)
    sys.exit(0)

import jaxsched.tools.launch  # noqa: E402

info = jaxsched.tools.launch.initialize(cpu_devices=1)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

assert jax.process_index() == info.process_id == rank, (jax.process_index(), info, rank)
n = info.num_processes
mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
sharding = NamedSharding(mesh, P("x"))


def run(local):
    x = jax.make_array_from_process_local_data(sharding, local)
    return np.asarray(jax.block_until_ready(psum(x)).addressable_shards[0].data)


if mode in ("fail-collective", "raise"):
    print(f"ready, gloo interface {info.interface}", flush=True)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        os._exit(3)
    run(np.ones(4, np.float32))  # never completes: rank 1 does not join
    sys.exit(0)

if mode == "psum":
    mb = float(sys.argv[2]) if len(sys.argv) > 2 else 0
    got = run(np.full(4, rank + 1, np.float32))
    print(f"psum {got[0]:g} expected {n * (n + 1) / 2:g} interface {info.interface}", flush=True)
    if mb:
        reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
        local = np.ones(int(mb * 1e6) // 4, np.float32)
        x = jax.make_array_from_process_local_data(sharding, local)
        jax.block_until_ready(psum(x))  # compile and warm up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(psum(x))
            times.append(time.perf_counter() - t)
        print(
            f"psum of {mb:g} MB float32 over {n} processes: "
            f"median {np.median(times) * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, "
            f"max {max(times) * 1e3:.0f}, {reps} reps)",
            flush=True,
        )
    jax.distributed.shutdown()
    sys.exit(0)
sys.exit(f"unknown mode {mode}")
