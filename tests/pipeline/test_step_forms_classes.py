"""The step form is decided once, by the first ``init`` (or the first call given an
`UnsplitState`), and gives the schedule one of two runners: the trees form's or the state
form's; the form never changes afterwards."""

import jax
import optax
import pytest

import jaxsched
from jaxsched.pipeline._trees_runner import TreesRunner
from jaxsched.demo import steps
from jaxsched.pipeline._state_step import StateForm, UnsplitState
from jaxsched.zoo import models


def _setup():
    params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = optax.sgd(0.1)
    trees_step = steps.make_step(apply_fn, tx, mesh)

    def state_step(*args):  # a signature that says no form: init's arguments decide
        state, batch = args
        new_params, new_opt_state, aux = trees_step(state["params"], state["opt_state"], batch)
        return {"params": new_params, "opt_state": new_opt_state}, aux

    batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    return params, tx.init(params), trees_step, state_step, batch


def test_nothing_is_decided_before_the_first_init():
    *_, trees_step, _, _ = _setup()
    sched = jaxsched.schedule(trees_step)
    assert sched._runner is None
    assert sched.num_programs == 0 and sched.replans == [] and sched.replan_decisions == []
    with pytest.raises(jaxsched.JaxschedRuntimeError, match="not been traced"):
        _ = sched.program


def test_the_trees_form_runs_a_trees_runner_and_keeps_it():
    params, opt_state, trees_step, _, batch = _setup()
    sched = jaxsched.schedule(trees_step)
    state = sched.init(params, opt_state)
    runner = sched._runner
    assert isinstance(runner, TreesRunner) and runner.schedule is sched
    state, _ = sched(state, batch)
    with pytest.raises(
        jaxsched.JaxschedTypeError,
        match=r"initialized in the trees form \(init\(params, opt_state\)\); sched.init got the state form",
    ):
        sched.init({"params": params, "opt_state": opt_state})
    assert sched._runner is runner and sched.num_programs == 1
    new_params, _ = sched.finalize(state)
    assert jax.tree.structure(new_params) == jax.tree.structure(params)


def test_the_state_form_runs_a_state_form_over_a_trees_runner_and_keeps_it():
    params, opt_state, _, state_step, batch = _setup()
    sched = jaxsched.schedule(state_step)
    sstate = sched.init({"params": params, "opt_state": opt_state})
    runner = sched._runner
    assert isinstance(sstate, UnsplitState) and isinstance(runner, StateForm) and runner.inner is None
    sstate, _ = sched(sstate, batch)
    assert isinstance(runner.inner, TreesRunner) and runner.inner.schedule is not sched
    with pytest.raises(
        jaxsched.JaxschedTypeError,
        match=r"initialized in the state form \(init\(state\)\); sched.init got the trees form",
    ):
        sched.init(params, opt_state)
    assert sched._runner is runner and sched.program is runner.inner.last_program
    assert sorted(sched.finalize(sstate)) == ["opt_state", "params"]


def test_a_call_with_an_unsplit_state_decides_the_state_form():
    params, opt_state, _, state_step, batch = _setup()
    sched = jaxsched.schedule(state_step)
    sstate, _ = sched(UnsplitState({"params": params, "opt_state": opt_state}), batch)
    assert isinstance(sched._runner, StateForm) and sched._form == "state"


@pytest.mark.parametrize("form", ["trees", "state"])
def test_a_training_loop_call_takes_the_fast_path(form, monkeypatch):
    """A call on the state the schedule just returned, with a batch of a known signature,
    runs the program again without the checks of the first call (in either form)."""
    params, opt_state, trees_step, state_step, batch = _setup()
    sched = jaxsched.schedule(trees_step if form == "trees" else state_step)
    state = sched.init(params, opt_state) if form == "trees" else sched.init({"params": params, "opt_state": opt_state})
    state, _ = sched(state, batch)

    def refuse(*args, **kwargs):
        raise AssertionError("the fast path was not taken")

    monkeypatch.setattr(type(sched._runner), "call", refuse)
    state, aux = sched(state, batch)
    assert sorted(aux) == ["accuracy", "loss"]
