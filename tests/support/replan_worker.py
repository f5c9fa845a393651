"""One process of the two-process re-planning tests:
``python replan_worker.py PORT RANK OUT STRATEGY MODE``.

MODE ``switch``: 30 steps with a forced switch of plan before step 10; rank 0 writes the
finalized params and the bucket counts before and after. MODE ``stages``: the same on the
host engine (two local devices per process), monitored from its stage timings every 8
steps. MODE ``lost`` / ``corrupt``:
monitoring every 5 steps, with rank 1's agreement message dropped or garbled; the process
must exit with a ReplanAgreementError, not hang.
"""

import sys
from pathlib import Path as _Path

sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # tests/: `support` importable

import jax

port, rank, out, strategy, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.config.update("jax_num_cpu_devices", 2 if mode == "stages" else 1)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank, initialization_timeout=60
)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.demo import steps  # noqa: E402
from jaxsched.pipeline.replan import KeyValueStore  # noqa: E402
from support.replan_model import (
    batches,
    bandwidth_bound,
    latency_bound,
    layer_profile,
    leaves,  # noqa: E402
    optimizer,
    tanh_mlp,
)


class FaultyStore(KeyValueStore):
    """The real store, except that this process's own messages are dropped or garbled."""

    def __init__(self, fault: str):
        super().__init__()
        self.fault = fault

    def set(self, key: str, value: str) -> None:
        if self.fault == "corrupt":
            super().set(key, value[: len(value) // 2])
        # "lost": nothing is sent


params, apply = tanh_mlp()
tx = optimizer()
mesh_devices = [
    min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(2)
]  # one device per process; the spare one carries collectives
mesh = jax.sharding.Mesh(np.array(mesh_devices), ("data",))
step = steps.make_step(apply, tx, mesh)
options = {
    "switch": jaxsched.Replan(every=1000),
    "stages": jaxsched.Replan(every=8, monitor="stages", min_gain=0.5),
}.get(mode, jaxsched.Replan(every=5, timeout_s=5))
sched = jaxsched.schedule(
    step, strategy=strategy, replan=options, layer_profile=layer_profile(), network_profile=latency_bound(2)
)
if mode in ("lost", "corrupt") and rank == 1:
    sched._replanner.store = FaultyStore(mode)
state = sched.init(params, tx.init(params))
sharding = NamedSharding(mesh, P("data"))
counts = []
for n, (x, y) in enumerate(batches(30, 8)):
    if mode in ("switch", "stages") and n == 10:
        counts.append(len(sched.program.buckets))
        assert sched.replan(network=bandwidth_bound(2)) is not None
    local = (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local)
    state, aux = sched(state, batch)
    jax.block_until_ready(aux)
    if mode in ("switch", "stages") and n == 10:
        counts.append(len(sched.program.buckets))
if mode == "stages":
    assert sched.program.engine.name == "host", sched.program.engine
final_params, _ = sched.finalize(state)
if rank == 0:
    np.savez(
        out,
        *leaves(final_params),
        counts=np.asarray(counts),
        steps=np.asarray([r.step for r in sched.replans]),
        decisions=np.asarray([d.step for d in sched.replan_decisions]),
    )
jax.distributed.shutdown()
