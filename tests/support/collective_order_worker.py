"""One process of the collective-order test: ``python collective_order_worker.py``.

Started by ``jaxsched.tools.launch`` (2 processes, 2 CPU devices each). A host-engine
program with two collectives: the first waits for a loop whose length is per process
(long on process 0, none on process 1); the second reads an input, ready at once. Process
0's second collective is therefore ready long before its first, process 1's after it.
Unless the engine keeps dispatch order, the processes pair different collectives. Each
process checks both sums exactly and exits non-zero if either is wrong.
"""

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # tests/: `support` importable

import jaxsched.tools.launch

jaxsched.tools.launch.initialize(cpu_devices=2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxsched.runtime.engine import HostEngine, PerDeviceProgram  # noqa: E402

LOOP = (400_000, 0)  # iterations of the loop before the first collective, per process
rank = jax.process_index()
devices = [d for d in jax.devices() if d.id == min(e.id for e in jax.devices() if e.process_index == d.process_index)]
mesh = jax.sharding.Mesh(np.array(devices), ("data",))


def body(n, x, z):
    y = lax.fori_loop(0, n[0], lambda i, v: v + 1.0, x)  # x + n, exactly
    return lax.psum(y, "data"), lax.psum(z, "data")


spec = (P("data"),) * 3
run = HostEngine().compile(PerDeviceProgram(body, mesh, "data", spec, (P("data"), P("data"))))
sharding = NamedSharding(mesh, P("data"))


def local(r: int) -> tuple:
    return (
        np.asarray([LOOP[r]], np.int32),
        np.arange(100, dtype=np.float32) + r,
        np.arange(7, dtype=np.float32) * (r + 2),
    )


expected_y = sum(local(r)[1] + LOOP[r] for r in range(2))
expected_z = sum(local(r)[2] for r in range(2))
for _ in range(3):
    args = [jax.make_array_from_process_local_data(sharding, a) for a in local(rank)]
    y, z = run(*args)
    np.testing.assert_array_equal(np.asarray(y.addressable_data(0)), expected_y)
    np.testing.assert_array_equal(np.asarray(z.addressable_data(0)), expected_z)
print(f"process {rank}: both sums exact, stages {[s.kind for s in run.stages]}")
