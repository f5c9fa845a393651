"""A step that returns a state leaf in another dtype than it took (adam with
``mu_dtype=bfloat16`` on a float32 optimizer state): every strategy gets a program for the
new dtypes, as ``jax.jit`` traces again, and stays equal to the plain step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsched
from jaxsched.demo import steps
from support.equivalence import assert_trees_close, build, random_batches

STRATEGIES = [("allreduce", {}), ("wfbp", {}), ("dear", {}), ("approx", {"staleness": 0})]


def _bf16_moments_step(devices: int = 4, widen_moments: bool = True):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
    opt_state = tx.init(params)
    if widen_moments:  # as verify, or a checkpoint in float32, hands it over
        opt_state = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, opt_state)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 3, 2 * devices, 1)]
    return steps.make_step(apply_fn, tx, mesh), params, opt_state, batches


def _dtypes(tree):
    return [str(x.dtype) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("strategy,options", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_a_step_that_changes_a_leaf_dtype_gets_a_program_for_the_new_dtype(strategy, options):
    step, params, opt_state, batches = _bf16_moments_step()
    plain = (params, opt_state)
    for b in batches:
        plain = step(*plain, b)[:2]
    sched = jaxsched.schedule(step, strategy=strategy, **options)
    state = sched.init(params, opt_state)
    for b in batches:
        state, _ = sched(state, b)
    got = sched.finalize(state)
    assert _dtypes(got) == _dtypes(plain) and "bfloat16" in _dtypes(got[1])
    assert sched.num_programs == 2  # float32 moments in, then bfloat16 from step 2 on
    assert_trees_close(got, plain, rtol=1e-5, atol=1e-6)


def test_approx_with_delay_returns_the_step_dtype_from_the_first_step():
    step, params, opt_state, batches = _bf16_moments_step()
    sched = jaxsched.schedule(step, strategy="approx", staleness=1)
    state = sched.init(params, opt_state)
    for b in batches:
        state, _ = sched(state, b)
    assert _dtypes(state.opt_state) == _dtypes(step(params, opt_state, batches[0])[1])


def test_verify_keeps_bfloat16_moments_and_passes():
    """big_vision's configuration: Adam's first moment in bfloat16 from the start. Widened
    to float64 it would come back bfloat16 from the step and fail the comparison."""
    step, params, opt_state, batches = _bf16_moments_step(widen_moments=False)
    sched = jaxsched.schedule(step, strategy="dear")
    report = sched.verify(sched.init(params, opt_state), batches, steps=3)
    assert report.precision == "float64" and report.ok, str(report)


@pytest.mark.slow
def test_verify_of_a_step_that_narrows_a_leaf_passes():
    step, params, opt_state, batches = _bf16_moments_step(widen_moments=True)
    sched = jaxsched.schedule(step, strategy="dear")
    report = sched.verify(sched.init(params, opt_state), batches, steps=3)
    assert report.ok, str(report)
    assert np.isfinite(report.leaf_gap["opt_state[0].mu['head']['kernel']"])
