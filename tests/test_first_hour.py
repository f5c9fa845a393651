"""What a new user meets in the first hour: each mistake gets a warning or an error that
names the fix, from the call that made it, in a few lines."""

from __future__ import annotations

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched

TX = optax.sgd(0.1, momentum=0.9)


def _loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) - y) ** 2)


@jax.jit
def _step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


@jax.jit
def _dropout_step(params, opt_state, batch, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    loss, grads = jax.value_and_grad(_loss)(params, (jnp.where(keep, x, 0.0), y))
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
    batch = (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32))
    return params, batch


def _sharded(batch):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def test_an_unsharded_batch_on_several_devices_warns_with_the_fix():
    params, batch = _inputs()
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.warns(
        jaxsched.UnshardedStepWarning, match=r"jax.device_put\(batch, NamedSharding\(mesh, P\('data'\)\)\)"
    ):
        state, _ = sched(sched.init(params, TX.init(params)), batch)
    # the step still runs, and gives the plain step's numbers
    want, _, _ = _step(params, TX.init(params), batch)
    got, _ = sched.finalize(state)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


def test_a_sharded_batch_does_not_warn():
    params, batch = _inputs()
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.UnshardedStepWarning)
        sched(sched.init(params, TX.init(params)), _sharded(batch))


def test_an_unsharded_batch_on_one_device_stays_silent():
    code = (
        "import warnings, jax, numpy as np, optax, jaxsched\n"
        "tx = optax.sgd(0.1)\n"
        "def step(p, o, b):\n"
        "    g = jax.grad(lambda p: ((b @ p) ** 2).mean())(p)\n"
        "    u, o = tx.update(g, o, p)\n"
        "    return optax.apply_updates(p, u), o, {}\n"
        "p = np.ones((3, 2), np.float32)\n"
        "s = jaxsched.schedule(jax.jit(step), strategy='wfbp')\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error', jaxsched.UnshardedStepWarning)\n"
        "    s(s.init(p, tx.init(p)), np.ones((4, 3), np.float32))\n"
        "print(jax.device_count(), 'ok')\n"
    )
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "ok"]


def test_the_documented_diloco_simulation_runs_in_a_fresh_process():
    """The command docs/diloco.md shows; its cost pattern must not depend on an import of the
    strategies that the command line never makes."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxsched", "simulate", "--model", "gpt2", "--workers", "16", "--network",
         "nvlink4+10gbe", "--per-node", "8", "--device", "h100", "--strategy", "diloco", "--inner-steps",
         "10", "--fragments", "4", "--overlap-steps", "1", "--outer-bits", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "diloco: inner step" in out.stdout


def test_init_without_the_optimizer_state_says_so_at_init():
    params, _ = _inputs()
    sched = jaxsched.schedule(_step, strategy="wfbp")
    with pytest.raises(jaxsched.JaxschedError, match=r"sched.init\(params, opt_state\)") as info:
        sched.init(params)
    assert isinstance(info.value, TypeError)
    assert len(str(info.value)) < 300


def test_verify_raises_the_steps_own_error_without_a_float64_warning():
    """Batches without the step's extra input (a dropout key): the step's own error, not a
    warning that float64 failed followed by it."""
    params, batch = _inputs()
    sched = jaxsched.schedule(_dropout_step, strategy="wfbp")
    state = sched.init(params, TX.init(params))
    batch = _sharded(batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="unpack"):
            sched.verify(state, [batch, batch], steps=2)
    assert not [w for w in caught if "float64" in str(w.message)]


def test_verify_checks_the_number_of_inputs_as_the_call_does():
    params, batch = _inputs()
    sched = jaxsched.schedule(_dropout_step, strategy="wfbp")
    state = sched.init(params, TX.init(params))
    x = _sharded(batch[0])
    with pytest.raises(jaxsched.JaxschedError, match=r"takes 2 inputs after its state.*\(input, batch\)"):
        sched.verify(state, [x, x], steps=2)
    with pytest.raises(TypeError, match="takes 2"):
        sched(state, x)


def test_verify_accepts_the_inputs_as_a_call_takes_them():
    params, batch = _inputs()
    sched = jaxsched.schedule(_dropout_step, strategy="wfbp")
    state = sched.init(params, TX.init(params))
    batch = _sharded(batch)
    inputs = [(batch, jax.random.key(k)) for k in range(2)]
    assert sched.verify(state, inputs, steps=2).ok


def test_a_state_of_another_structure_is_named_in_a_short_paragraph():
    params, batch = _inputs()
    tx = optax.adam(1e-2)

    @jax.jit
    def step(state, batch):
        params, opt_state = state["params"], state["opt_state"]
        grads = jax.grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, {}

    sched = jaxsched.schedule(step, strategy="wfbp")
    batch = _sharded(batch)
    state, _ = sched(sched.init({"params": params, "opt_state": tx.init(params)}), batch)
    other = {"params": {"w": params["w"], "b": jnp.zeros(2)}, "opt_state": tx.init(params)}
    with pytest.raises(jaxsched.JaxschedError) as info:
        sched(other, batch)
    message = str(info.value)
    assert "PyTreeDef" not in message and len(message) < 500, message


def test_every_error_and_warning_class_derives_from_jaxscheds_own():
    import inspect as pyinspect
    import pkgutil

    import jaxsched as package

    found, found_warnings = [], []
    for module_info in pkgutil.walk_packages(package.__path__, "jaxsched."):
        if module_info.name.endswith("__main__") or module_info.name.startswith("jaxsched.tools.aot"):
            continue
        module = __import__(module_info.name, fromlist=["_"])
        for name, value in vars(module).items():
            if (
                pyinspect.isclass(value)
                and issubclass(value, Exception)
                and not issubclass(value, Warning)
                and value.__module__.startswith("jaxsched")
                and not name.startswith("_")
            ):
                found.append(value)
            elif pyinspect.isclass(value) and issubclass(value, Warning) and value.__module__.startswith("jaxsched"):
                found_warnings.append(value)
    warning_classes = [w for w in found_warnings]
    assert len(found) >= 15 and len(warning_classes) >= 5
    assert all(issubclass(w, jaxsched.JaxschedWarning) for w in warning_classes), warning_classes
    assert all(issubclass(cls, jaxsched.JaxschedError) for cls in found), [
        c for c in found if not issubclass(c, jaxsched.JaxschedError)
    ]


def test_a_bad_strategy_name_is_a_jaxsched_error_and_a_value_error():
    with pytest.raises(jaxsched.JaxschedError) as info:
        jaxsched.schedule(_step, strategy="no-such-strategy")
    assert isinstance(info.value, ValueError)


def test_the_demo_trains_the_jit_form_the_readme_leads_with():
    import tomllib
    from importlib import resources

    from jaxsched.demo.config import parse

    text = resources.files("jaxsched.demo").joinpath("configs/demo.toml").read_text()
    assert parse(tomllib.loads(text), "demo.toml").train.api == "jit"
