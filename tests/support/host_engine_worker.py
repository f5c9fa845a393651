"""One process of the host-engine test: ``python host_engine_worker.py OUT [--jit] STRATEGY...``.

With ``--jit`` the step is the ``jax.jit`` form on global arrays (steps.make_jit_step),
partitioned per device by jaxsched; otherwise the jitted ``shard_map`` step.

Started by ``jaxsched.tools.launch`` (2 processes, 2 CPU devices each). The mesh takes device 0
of every process; the host engine runs collectives on device 1. For every strategy, the
xla engine and the host engine run the same batches; rank 0 writes the largest relative
difference of the finalized params and of the losses.
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
from support.equivalence import build, random_batches  # noqa: E402

out, strategies = sys.argv[1], sys.argv[2:]
jit_form = "--jit" in strategies
strategies = [s for s in strategies if s != "--jit"]
rank = jax.process_index()
devices = [d for d in jax.devices() if d.id == min(e.id for e in jax.devices() if e.process_index == d.process_index)]
mesh = jax.sharding.Mesh(np.array(devices), ("data",))
sharding = NamedSharding(mesh, P("data"))
params, apply_fn = build("mlp", 0)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
step = steps.make_jit_step(apply_fn, tx) if jit_form else steps.make_step(apply_fn, tx, mesh)
batches = []
for x, y in random_batches("mlp", 4, 8, 3):
    local = (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    batches.append(jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local))

report = {}
for strategy in strategies:
    finals, losses = {}, {}
    for engine in ("xla", "host"):
        sched = jaxsched.schedule(step, strategy=strategy, engine=engine, buckets=2000)
        state = sched.init(params, tx.init(params))
        losses[engine] = []
        for batch in batches:
            state, aux = sched(state, batch)
            losses[engine].append(float(np.asarray(aux["loss"].addressable_data(0))))
        finals[engine] = [np.asarray(leaf) for leaf in jax.tree.leaves(sched.finalize(state)[0])]
        if engine == "host":
            report[f"{strategy}_stages"] = [s.kind for s in sched.program.core.stages]
    gap = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(finals["host"], finals["xla"]))
    report[strategy] = {"params_rel_gap": gap, "losses": losses}
if rank == 0:
    with open(out, "w") as f:
        json.dump(report, f)
