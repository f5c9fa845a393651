"""The host engine: stages cut at collectives, dispatched over two local devices per process."""

import io
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.tools import launch as launch_lib
from jaxsched.demo import steps
from jaxsched.runtime.engine import HostEngine, HostEngineError, PerDeviceProgram, host_engine_applies
from jaxsched.runtime.engine._host import cut_stages, spare_devices
from support.equivalence import build, random_batches
from support import SUPPORT_DIR

HERE = Path(__file__).parent
CHILD_ENV = {
    "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    "JAX_PLATFORMS": "cpu",
}


def _one_device_program(body, in_specs, out_specs):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    return mesh, PerDeviceProgram(body, mesh, "data", in_specs, out_specs)


def test_stages_alternate_at_collectives_and_keep_only_what_later_stages_read():
    def body(x, w):
        h = jnp.tanh(x @ w)
        s = lax.psum(h, "data")  # collective 1
        g = lax.all_gather(s * 2, "data", tiled=True)  # collective 2 reads compute after 1
        return (g.sum() + x.sum(),)

    mesh, program = _one_device_program(body, (P("data"), P()), (P(),))
    jaxpr = program.jaxpr(jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((3, 3), jnp.float32))
    stages = cut_stages(jaxpr)
    assert [s.kind for s in stages] == ["compute", "comm", "compute", "comm", "compute", "compute"]
    assert [s.name for s in stages if s.kind == "comm"] == [
        "psum (48 B)",
        "all_gather (48 B)",
    ]  # under 1 kB: not buckets
    x = jaxpr.invars[0]
    # x.sum() waits for no collective: it is dispatched before the work that needs the gather
    assert x in stages[0].inputs and x in stages[-2].inputs and x not in stages[-1].inputs
    assert [e.primitive.name for e in stages[-2].eqns] == ["reduce_sum"]
    assert all(len(s.eqns) == 1 for s in stages if s.kind == "comm")


def STAGEABLE() -> list[str]:
    """Every registered strategy but kfac, which refreshes its inverses (and skips factor
    updates) under lax.cond with the collective inside; the host engine refuses a
    collective nested in control flow by design, naming it."""
    return [s for s in jaxsched.STRATEGIES if s != "kfac"]


@pytest.mark.slow  # a heavy compile: runs in `make test-slow` (CI runs both)
def test_one_process_host_engine_equals_xla_for_every_strategy():
    """One process, mesh of device 0, collectives on device 1: the staging path end to end."""
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = steps.make_step(apply_fn, tx, mesh)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 3, 4, 2)]
    for strategy in STAGEABLE():
        results = []
        for engine in ("xla", HostEngine(record_timings=True)):
            sched = jaxsched.schedule(step, strategy=strategy, engine=engine)
            state = sched.init(params, tx.init(params))
            losses = []
            for batch in batches:
                state, aux = sched(state, batch)
                losses.append(float(aux["loss"]))
            results.append((sched.finalize(state), losses))
        np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        timings = sched.program.core.timings
        assert len(timings) == 3 and {t.kind for t in timings[-1]} == {"compute", "comm"}
        assert all(0 <= t.dispatched <= t.done and t.started <= t.done for t in timings[-1])


def test_host_engine_reports_overlap_and_a_measured_cost_per_collective():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    engine = HostEngine()
    costs = engine.costs(mesh)
    assert costs.overlaps and 0 < costs.per_collective_s < 0.5
    assert engine.costs(mesh) is costs  # measured once per mesh
    assert not jaxsched.runtime.engine.XlaEngine().costs(mesh).overlaps  # XLA:CPU: collectives inline


def test_host_engine_refuses_meshes_it_cannot_stage():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(HostEngineError, match="no local cpu device outside the mesh"):
        spare_devices(mesh)
    mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    program = PerDeviceProgram(lambda x: (x,), mesh2, "data", (P("data"),), (P("data"),))
    with pytest.raises(HostEngineError, match="exactly one mesh device per process.*jaxsched launch"):
        HostEngine().compile(program)
    assert not host_engine_applies(mesh2)  # one process: auto keeps the xla engine

    def looped(x):
        return (lax.fori_loop(0, 2, lambda i, c: lax.psum(c, "data"), x),)

    _, program = _one_device_program(looped, (P("data"),), (P("data"),))
    with pytest.raises(HostEngineError, match="psum inside scan at .*test_host_engine.py.*top level"):
        HostEngine().compile(program)(jax.device_put(jnp.ones(2), jax.devices()[0]))


def test_auto_engine_is_xla_in_one_process():
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp")
    batch = steps.shard_batch(next(random_batches("mlp", 1, 4, 0)), mesh)
    sched(sched.init(params, tx.init(params)), batch)
    assert sched.program.engine.name == "xla"


def _launch_two(worker: str, *args: str, timeout_s: float) -> str:
    """Runs ``tests/support/<worker>`` in two processes of two CPU devices each; returns
    their output once both exited cleanly."""
    log = io.StringIO()
    code = launch_lib.launch(
        2,
        [sys.executable, str(SUPPORT_DIR / worker), *args],
        env=CHILD_ENV,
        stdout=log,
        stderr=log,
        timeout_s=timeout_s,
        grace_s=2,
    )
    assert code == 0, log.getvalue()[-4000:]
    return log.getvalue()


@pytest.mark.slow
def test_two_processes_host_engine_equals_xla_engine_for_every_strategy(tmp_path):
    out = tmp_path / "report.json"
    strategies = STAGEABLE()
    _launch_two("host_engine_worker.py", str(out), *strategies, timeout_s=240)
    report = json.loads(out.read_text())
    for strategy in strategies:
        assert report[strategy]["params_rel_gap"] < 1e-5, (strategy, report[strategy])
        np.testing.assert_allclose(report[strategy]["losses"]["host"], report[strategy]["losses"]["xla"], rtol=1e-5)
        assert report[f"{strategy}_stages"].count("comm") >= 1


@pytest.mark.slow
def test_two_processes_run_their_collectives_in_dispatch_order(tmp_path):
    """Process 0's first collective waits on a long loop, its second is ready at once;
    process 1's first is ready before its second. Both sums stay exact only if every
    process runs its communication stages in dispatch order."""
    log = _launch_two("collective_order_worker.py", timeout_s=120)
    assert log.count("both sums exact") == 2, log[-2000:]


def test_communication_stages_share_one_order_per_set_of_spare_devices():
    """Every staged program on the same spare devices takes its token from one chain: the
    stages of a new plan (or of a measurement) queue behind those of the last one."""
    from jaxsched.runtime.engine._host import CollectiveOrder, StagedProgram

    mesh, program = _one_device_program(lambda x: (lax.psum(x * 2.0, "data"),), (P("data"),), (P("data"),))
    first, second = StagedProgram(program), StagedProgram(program)
    assert first.order is second.order
    x = jax.device_put(jnp.ones(4), jax.NamedSharding(mesh, P("data")))
    before = first.order.token
    np.testing.assert_allclose(first(x)[0], 2.0)
    assert first.order.token is not before  # each communication stage hands the next a new token
    after_first = second.order.token
    np.testing.assert_allclose(second(x)[0], 2.0)
    assert second.order.token is not after_first and CollectiveOrder.on(first.comm_mesh) is first.order
