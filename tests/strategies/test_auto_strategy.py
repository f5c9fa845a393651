"""strategy="auto": picks the exact strategy the simulator predicts fastest for the step on
the engine that runs it, and the chosen program is exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsched
import jaxsched.runtime.compress  # noqa: F401  (attribute access below)
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched.demo import steps
from jaxsched.sim._costmodel import Layer, LayerProfile
from jaxsched.runtime.engine import EngineCosts, XlaEngine
from support.equivalence import build, random_batches

# The test MLP's layers, made heavy: 40 MB of gradients each, 50/100 ms forward/backward.
HEAVY = LayerProfile([Layer(name, 10**7, 4 * 10**7, 0.05, 0.10) for name in ("hidden/0", "hidden/1", "head")])


class OverlappingXla(XlaEngine):
    """The xla engine, as it plans on GPU/TPU: collectives overlap compute."""

    def __init__(self, per_collective_s: float = 0.0):
        super().__init__()
        self.per_collective_s = per_collective_s

    def costs(self, mesh):
        return EngineCosts(overlaps=True, per_collective_s=self.per_collective_s)


def _run(engine, n_steps=3, **options):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    step = steps.make_step(apply_fn, tx, mesh)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", n_steps, 16, 4)]
    sched = jaxsched.schedule(
        step, strategy="auto", engine=engine, layer_profile=HEAVY, network_profile="1gbe", **options
    )
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    for b in batches:
        state, aux = sched(state, b)
        *plain, plain_aux = step(*plain, b)
    sched_params, _ = sched.finalize(state)
    for a, b in zip(jax.tree.leaves(plain[0]), jax.tree.leaves(sched_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    return sched


def test_auto_overlaps_where_the_engine_can_and_stays_exact():
    sched = _run(OverlappingXla())
    choice = sched.strategy.last_choice
    assert choice.overlaps and set(choice.simulated_s) == {"allreduce", "wfbp", "dear"}
    assert choice.chosen != "allreduce"
    assert choice.simulated_s[choice.chosen] == min(choice.simulated_s.values())
    assert choice.simulated_s[choice.chosen] < choice.simulated_s["allreduce"]
    assert sched.program.strategy.name == choice.chosen


def test_auto_keeps_the_plain_step_where_nothing_overlaps():
    sched = _run("xla")  # XLA:CPU runs collectives inline: one shared stream
    choice = sched.strategy.last_choice
    assert not choice.overlaps
    assert choice.chosen == "allreduce" and sched.program.strategy.name == "allreduce"


@pytest.mark.slow
def test_a_costly_collective_dispatch_merges_buckets():
    cheap = _run(OverlappingXla(0.0), n_steps=1, candidates=("wfbp",)).strategy.last_choice
    costly = _run(OverlappingXla(5.0), n_steps=1, candidates=("wfbp",)).strategy.last_choice
    assert len(costly.buckets) < len(cheap.buckets)
    assert costly.per_collective_s == 5.0


@pytest.mark.slow
def test_explicit_buckets_are_kept_and_compressors_skip_allreduce():
    plan = [["head"], ["hidden"]]
    sched = _run(OverlappingXla(), n_steps=1, buckets=plan)
    assert sched.strategy.last_choice.buckets == plan
    auto = jaxsched.strategies.Auto(collective=jaxsched.runtime.compress.Cast("bfloat16"))
    assert [c.name for c in auto.candidate_strategies()] == ["wfbp", "dear"]
    with pytest.raises(ValueError, match="'nope' is not a registered strategy"):
        jaxsched.schedule(lambda *a: a, strategy="auto", candidates=("nope",))


@pytest.mark.parametrize("options", [dict(strategy="auto"), dict(strategy="wfbp", buckets="auto")])
def test_auto_choices_run_under_a_context_mesh(options):
    """Under ``jax.set_mesh`` (how Explicit axes are used), choosing measures this machine's
    compute on one device outside the context mesh: the step runs and equals the plain one."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(np.random.default_rng().integers(1 << 30))
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(mesh, P()))}
        batches = [
            jax.device_put(
                (rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)),
                NamedSharding(mesh, P("data")),
            )
            for _ in range(2)
        ]
        plain = (params, tx.init(params))
        for b in batches:
            *plain, _ = step(*plain, b)
        sched = jaxsched.schedule(step, **options)
        state = sched.init(params, tx.init(params))
        for b in batches:
            state, _ = sched(state, b)
        got = sched.finalize(state)
    np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(plain[0]["w"]), rtol=1e-5, atol=1e-6)
