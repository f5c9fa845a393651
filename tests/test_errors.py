"""Bad input gets a clear error naming the leaf, primitive or source line and what to do.
Every class here is a row of the README's table of bad inputs, message as quoted there."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from jaxsched.runtime.engine._host import HostEngineError, spare_devices
from support.equivalence import build, random_batches

# the bad-input table of the troubleshooting guide quotes these messages
README = (Path(__file__).parent.parent / "docs" / "verify.md").read_text()


def _mesh(n=2):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _mlp_step(strategy="dear", **options):
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    mesh = _mesh()
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy, **options)
    batch = steps.shard_batch(next(random_batches("mlp", 1, 4, 0)), mesh)
    return sched, sched.init(params, tx.init(params)), batch, params


def _custom(body, out_specs=(P(), P(), P()), strategy="wfbp"):
    mesh = _mesh()
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=out_specs, check_vma=False))
    sched = jaxsched.schedule(step, strategy=strategy)
    params = {"w": np.ones(3, np.float32)}
    return sched(
        sched.init(params, ()), jax.device_put(np.ones((4, 3), np.float32), jax.NamedSharding(mesh, P("data")))
    )


def _no_reduction(p, s, x):
    g = jax.grad(lambda q: jnp.sum(q["w"] * x))(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())


def _foreign_axis(p, s, x):
    g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), "model")
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())


def _nested(p, s, x):
    def body(c, _):
        return lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(c), "data"), None

    g, _ = lax.scan(body, p, None, length=1)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())


def _renamed_output(p, s, x):
    g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), "data")
    return {"v": p["w"] - g["w"]}, s, jnp.zeros(())


def _elementwise(p, s, x):
    g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), "data")
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())


def _one_output(p, s, x):
    return p


def _wrong_shape(_):
    sched, state, batch, params = _mlp_step("dear")
    bad = jax.tree.map(lambda a: a, params)
    bad["head"]["bias"] = np.zeros(3, np.float32)
    sched(state._replace(params=bad), batch)


def _two_axis_mesh():
    return jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])


def _grads_over_a_model_axis(_):
    mesh = _two_axis_mesh()

    def body(p, s, x):
        g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), ("data", "model"))
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    sched = jaxsched.schedule(step, strategy="wfbp")
    sched(
        sched.init({"w": np.ones(3, np.float32)}, ()),
        jax.device_put(np.ones((4, 3), np.float32), jax.NamedSharding(mesh, P("data"))),
    )


def _kfac_on_model_sharded_params(_):
    mesh = _two_axis_mesh()

    def body(p, s, x):
        def loss(q):
            return jnp.sum(lax.psum(jnp.tanh(x @ q["w"]), "model"))

        g = lax.pmean(jax.grad(loss)(p), "data")
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=({"w": P(None, "model")}, P(), P("data")),
            out_specs=({"w": P(None, "model")}, P(), P()),
            check_vma=False,
        )
    )
    sched = jaxsched.schedule(step, strategy="kfac")
    w = jax.device_put(np.ones((3, 4), np.float32), jax.NamedSharding(mesh, P(None, "model")))
    sched(sched.init({"w": w}, ()), jax.device_put(np.ones((4, 3), np.float32), jax.NamedSharding(mesh, P("data"))))


def _hierarchical_on_one_axis(_):
    from jaxsched.runtime.collectives import Hierarchical

    sched, state, batch, _p = _mlp_step("wfbp", collective=Hierarchical("ici", "dcn"))
    sched(state, batch)


def _jit_with_sharded_params(_):
    def step(state, x):  # a parameter split over both data axes, along two dimensions
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * g}, jnp.zeros(())

    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), (jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4])
    sched = jaxsched.schedule(jax.jit(step))
    w = jax.device_put(np.ones((4, 2), np.float32), jax.NamedSharding(mesh, P("data", "fsdp")))
    x = jax.device_put(np.ones((4, 4), np.float32), jax.NamedSharding(mesh, P(("data", "fsdp"))))
    sched(sched.init({"w": w}), x)


def _state_step(body, state):
    mesh = _mesh()
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))
    sched = jaxsched.schedule(step)
    return sched(sched.init(state), jax.device_put(np.ones((4, 3), np.float32), jax.NamedSharding(mesh, P("data"))))


def _extra_output(state, x):
    g = lax.pmean(jax.grad(lambda w: jnp.sum(jnp.sin(w * x)))(state["w"]), "data")
    return {"w": state["w"] - g, "extra": g}, jnp.zeros(())


def _running_mean(state, x):
    return {"mean": 0.5 * state["mean"] + lax.pmean(x.mean(0), "data")}, jnp.zeros(())


CASES = {
    "unknown strategy": (
        lambda _: jaxsched.schedule(lambda *a: a, strategy="deer"),
        ValueError,
        "strategy='deer' is unknown; choose one of",
    ),
    "not a step": (lambda _: jaxsched.schedule(42), TypeError, "schedule() needs the user's train step, got int"),
    "unknown option": (
        lambda _: jaxsched.schedule(lambda *a: a, strategy="wfbp", layer_profil=None),
        TypeError,
        "schedule() got unknown options ['layer_profil']",
    ),
    "no gradient reduction": (
        lambda _: _custom(_no_reduction),
        jaxsched.UnsupportedStepError,
        "the step has no gradient reduction over mesh axis 'data'",
    ),
    "axis not in the mesh": (
        lambda _: _custom(_foreign_axis),
        jaxsched.UnsupportedStepError,
        "the step reduces over an axis that is not in its mesh",
    ),
    "reduction inside a loop": (
        lambda _: _custom(_nested),
        jaxsched.UnsupportedStepError,
        "the gradients are reduced over 'data' inside a nested scan at",
    ),
    "outputs in another structure": (
        lambda _: _custom(_renamed_output),
        jaxsched.UnsupportedStepError,
        "the step's output params differs from its input params: it has extra leaves v and no leaves w",
    ),
    "parameter split over the data axes twice": (
        _jit_with_sharded_params,
        jaxsched.UnsupportedStepError,
        "state/w is sharded with P('data', 'fsdp'): over the data axes ('data', 'fsdp') along 2 "
        "dimensions; jaxsched splits a parameter over the data axes along one dimension (FSDP)",
    ),
    "step of another arity": (
        lambda _: jaxsched.schedule(lambda batch: batch).init(1),
        TypeError,
        "the step takes 1 positional argument(s); jaxsched.schedule "
        "accepts step(params, opt_state, batch) -> (params, opt_state, aux) or "
        "step(state, batch) -> (state, aux)",
    ),
    "output state in another structure": (
        lambda _: _state_step(_extra_output, {"w": np.ones(3, np.float32)}),
        jaxsched.UnsupportedStepError,
        "the step's output state differs from its input state",
    ),
    "state with nothing trained": (
        lambda _: _state_step(_running_mean, {"mean": np.zeros(3, np.float32)}),
        jaxsched.UnsupportedStepError,
        "found no trained parameter in the state",
    ),
    "not (params, opt_state, aux)": (
        lambda _: _custom(_one_output, P()),
        jaxsched.UnsupportedStepError,
        "the step returned 1 output (dict of 1 leaf); a step(params, opt_state, batch) returns "
        "(params, opt_state, aux), or (params, opt_state) alone",
    ),
    "unknown bucket path": (
        lambda _: _mlp_step(buckets=[["hid"]])[0](*_mlp_step(buckets=[["hid"]])[1:3]),
        ValueError,
        "buckets[0] names unknown parameter 'hid'",
    ),
    "parameter in two buckets": (
        lambda _: (lambda s, st, b, _p: s(st, b))(*_mlp_step(buckets=[["hidden"], ["hidden/0/bias"], ["head"]])),
        ValueError,
        "parameter 'hidden/0/bias' is in buckets[0] and buckets[1]",
    ),
    "unknown bucket plan": (
        lambda _: (lambda s, st, b, _p: s(st, b))(*_mlp_step(buckets="fast")),
        ValueError,
        "buckets='fast' is not understood",
    ),
    "compression on the identity": (
        lambda _: jaxsched.schedule(lambda *a: a, strategy="allreduce", collective=jaxsched.Collective()),
        ValueError,
        "strategy 'allreduce' issues no bucket collectives",
    ),
    "unknown engine": (
        lambda _: jaxsched.schedule(lambda *a: a, engine="gpu"),
        ValueError,
        "engine='gpu' is unknown; choose one of",
    ),
    "host engine without a spare device": (
        lambda _: spare_devices(jax.make_mesh((8,), ("data",))),
        HostEngineError,
        "process 0 has no local cpu device outside the mesh",
    ),
    "K-FAC damping <= 0": (
        lambda _: jaxsched.schedule(lambda *a: a, strategy="kfac", damping=0.0),
        ValueError,
        "damping=0.0 must be a finite number > 0",
    ),
    "K-FAC inverse interval < 1": (
        lambda _: jaxsched.schedule(lambda *a: a, strategy="kfac", inverse_interval=0),
        ValueError,
        "inverse_interval=0 must be an int >= 1",
    ),
    "K-FAC without a dense or conv layer": (
        lambda _: _custom(_elementwise, strategy="kfac"),
        jaxsched.UnsupportedStepError,
        "kfac found no dense or convolution layer in the step",
    ),
    "state leaf of another shape": (
        _wrong_shape,
        ValueError,
        "state leaf params/head/bias has shape (3,); expected the user's",
    ),
    "gradients reduced over a model axis": (
        _grads_over_a_model_axis,
        jaxsched.UnsupportedStepError,
        "gradients are reduced over axes ('data', 'model') at",
    ),
    "K-FAC on a tensor-parallel layer": (
        _kfac_on_model_sharded_params,
        jaxsched.UnsupportedStepError,
        "kfac preconditions whole layers, but params/w is sharded over the model axes ('model',)",
    ),
    "Hierarchical on other axes": (
        _hierarchical_on_one_axis,
        ValueError,
        "Hierarchical(fast='ici', slow='dcn') needs a step whose data-parallel axes are exactly ('dcn', 'ici')",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_the_message_the_readme_quotes(case):
    trigger, error, message = CASES[case]
    with pytest.raises(error, match=re.escape(message)):
        trigger(None)
    row = [line for line in README.splitlines() if line.startswith(f"| {case} |")]
    assert row, f"README's table of bad inputs has no row for {case!r}"
    assert message.replace("|", "\\|") in row[0], f"README quotes another message for {case!r}"


def test_the_readme_table_has_at_least_ten_classes():
    assert len(CASES) >= 10


def test_finalize_refuses_to_drop_carried_state_before_any_trace():
    sched = jaxsched.schedule(lambda *a: a, strategy="approx")
    state = sched.init({"w": np.ones(3, np.float32)}, ())
    assert np.array_equal(sched.finalize(state)[0]["w"], np.ones(3))  # nothing carried yet
    carrying = state._replace(pending=((np.ones((2, 3), np.float32),),), num_pending=1)
    with pytest.raises(ValueError, match="'approx' state carries pending.*sched.init"):
        sched.finalize(carrying)
