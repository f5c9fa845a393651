"""Mistakes in calling the API get a TypeError or ValueError that names the mistake and the
right call, not an error from deep inside JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched

TX = optax.adam(1e-2)


def _loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) - y) ** 2)


@jax.jit
def _step(params, opt_state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": _loss(params, batch)}


@pytest.fixture(scope="module")
def setup():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (4, 2))}
    batch = jax.device_put(
        (jax.random.normal(key, (16, 4)), jax.random.normal(key, (16, 2))), NamedSharding(mesh, P("data"))
    )
    return params, TX.init(params), batch


def test_the_users_trees_as_a_tuple_instead_of_the_state(setup):
    params, opt_state, batch = setup
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.raises(TypeError, match=r"\(params, opt_state\) as a tuple.*sched.init\(params, opt_state\)"):
        sched((params, opt_state), batch)


def test_finalize_of_the_users_trees(setup):
    params, opt_state, _ = setup
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.raises(TypeError, match=r"sched.finalize\(state\) got a tuple"):
        sched.finalize((params, opt_state))


def test_the_plain_steps_call_on_the_scheduled_step(setup):
    params, opt_state, batch = setup
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.raises(TypeError, match="sched\\(params, opt_state, batch\\) is the plain step's call"):
        sched(params, opt_state, batch)
    # the mistake leaves the schedule usable
    state, aux = sched(sched.init(params, opt_state), batch)
    assert jnp.isfinite(aux["loss"])


def test_init_with_its_arguments_swapped(setup):
    params, opt_state, batch = setup
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.raises(TypeError, match=r"swapped\? Call sched.init\(params, opt_state\)"):
        sched(sched.init(opt_state, params), batch)


@pytest.mark.parametrize("call", ["step", "finalize"])
def test_a_state_from_another_schedule(setup, call):
    params, opt_state, batch = setup
    dear = jaxsched.schedule(_step, strategy="dear")
    foreign, _ = dear(dear.init(params, opt_state), batch)  # dear's sharded layout
    wfbp = jaxsched.schedule(_step, strategy="wfbp")
    wfbp(wfbp.init(params, opt_state), batch)
    with pytest.raises(ValueError, match="state leaf params/w has shape .* come from another schedule"):
        wfbp(foreign, batch) if call == "step" else wfbp.finalize(foreign)


def test_demo_log_to_a_path_that_cannot_be_written(tmp_path, capsys):
    from jaxsched.tools.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo", "--log", str(blocker / "demo.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "Traceback" not in err
