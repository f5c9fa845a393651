"""One process of the multi-process test: ``python multiprocess_worker.py PORT RANK OUT``.

Each process owns one CPU device; together they form a 2-device mesh over gloo. Rank 0
writes the finalized params so the test can compare them with a 2-device run in one
process.
"""

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # tests/: `support` importable
import sys

import jax

port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank, initialization_timeout=60
)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.demo import steps  # noqa: E402
from support.equivalence import build, random_batches  # noqa: E402

params, apply_fn = build("mlp", 0)
tx = optax.adam(1e-2)
mesh = jax.make_mesh((2,), ("data",))
sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
state = sched.init(params, tx.init(params))
sharding = NamedSharding(mesh, P("data"))
for x, y in random_batches("mlp", 5, 8, 1):
    local = (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local)
    state, aux = sched(state, batch)
    jax.block_until_ready(aux)
final_params, _ = sched.finalize(state)
if rank == 0:
    np.savez(out, *[np.asarray(leaf) for leaf in jax.tree.leaves(final_params)])
jax.distributed.shutdown()
