"""One process of the DiLoCo host-engine test: ``python diloco_host_worker.py OUT OPTIONS_JSON``.

Started by ``jaxsched.tools.launch`` (2 processes, 2 CPU devices each). The mesh takes device 0
of every process; the host engine runs collectives on device 1. The same batches run
under ``diloco`` with the xla engine and with the host engine; rank 0 writes the largest
relative difference of the finalized params and the losses, and the stage kinds of the
host engine's program for each phase it ran.
"""

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # tests/: `support` importable
import json
import sys

import jaxsched.tools.launch

info = jaxsched.tools.launch.initialize(cpu_devices=2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.demo import steps  # noqa: E402
from jaxsched.runtime.engine import HostEngine  # noqa: E402
from support.equivalence import build, random_batches  # noqa: E402

out, options = sys.argv[1], json.loads(sys.argv[2])
rank = jax.process_index()
devices = [d for d in jax.devices() if d.id == min(e.id for e in jax.devices() if e.process_index == d.process_index)]
mesh = jax.sharding.Mesh(np.array(devices), ("data",))
sharding = NamedSharding(mesh, P("data"))
params, apply_fn = build("mlp", 0)
tx = optax.adam(1e-2)
step = steps.make_step(apply_fn, tx, mesh)
batches = []
for x, y in random_batches("mlp", 7, 8, 3):
    local = (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    batches.append(jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local))

finals, losses, stages = {}, {}, {}
for engine in ("xla", "host"):
    sched = jaxsched.schedule(
        step,
        strategy="diloco",
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        engine=engine if engine == "xla" else HostEngine(record_timings=True),
        **options,
    )
    state = sched.init(params, tx.init(params))
    losses[engine] = []
    for batch in batches:
        state, aux = sched(state, batch)
        losses[engine].append(float(np.asarray(aux["loss"].addressable_data(0))))
    finals[engine] = [np.asarray(leaf) for leaf in jax.tree.leaves(sched.finalize(state)[0])]
    if engine == "host":
        stages = {
            repr(key): [s.kind for s in core.stages] for key, core in sched.program._phase_cores.items() if core.stages
        }
gap = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(finals["host"], finals["xla"]))
if rank == 0:
    with open(out, "w") as f:
        json.dump({"params_rel_gap": gap, "losses": losses, "stages": stages}, f)
