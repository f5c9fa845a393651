"""Scheduled.verify: plain against scheduled on the user's data, judged against a rounding
baseline; a defect is caught at the step it appears."""
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import jaxsched
from jaxsched import replay, steps
from jaxsched.strategies import UserLayoutStrategy, register_strategy, unregister_strategy
from equivalence import build, random_batches


class SlightlyWrong(UserLayoutStrategy):
    """A defective toy strategy: every reduced gradient comes out 0.1% too large."""

    name = "toy_slightly_wrong"

    def per_device(self, planned, values, collective_state):
        body = planned.captured.body
        reducing = {id(body.eqns[r.eqn_index]) for r in planned.analysis.reductions}

        def run(eqn, operands):
            out = replay.bind(eqn, operands)
            return [o * 1.001 for o in out] if id(eqn) in reducing else out

        return replay.eval_inline(body, [], values, run=run), collective_state


def _setup(strategy, n=6):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", n, 8, 4)]
    return sched, sched.init(params, tx.init(params)), batches


@pytest.mark.parametrize("strategy", [pytest.param("wfbp", marks=pytest.mark.slow), "dear"])
def test_verify_reports_agreement_with_a_baseline_per_leaf(strategy):
    sched, state, batches = _setup(strategy)
    report = sched.verify(state, batches, steps=6)
    assert report.ok and report.first_divergent_step is None
    assert report.steps == 6 and len(report.step_gap) == 6
    assert any(k.startswith("params") for k in report.leaf_gap)
    assert any(k.startswith("aux") for k in report.leaf_gap)
    assert max(report.leaf_gap.values()) < 1e-5
    assert max(report.baseline_gap.values()) > 0  # the nudged run really differs
    assert "agree for all 6 steps" in str(report)


def test_verify_names_the_first_step_a_defect_shows_and_the_worst_leaf():
    register_strategy(SlightlyWrong)
    try:
        sched, state, batches = _setup("toy_slightly_wrong", n=3)
        report = sched.verify(state, batches, steps=3)
    finally:
        unregister_strategy("toy_slightly_wrong")
    assert not report.ok and report.first_divergent_step == 1
    assert report.worst_leaf.startswith(("params", "opt_state"))
    assert "agree up to step 0" in str(report)


def test_verify_rejects_too_few_batches():
    sched, state, batches = _setup("wfbp", n=2)
    with pytest.raises(ValueError, match="needs 5 batches, got 2"):
        sched.verify(state, batches, steps=5)
