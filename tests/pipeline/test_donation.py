"""A step jitted with ``donate_argnums`` over its whole state is scheduled to update that
state in place, as XLA updates the plain step's: the scheduled program donates its state,
each call frees the state it was given, and its memory is judged against the plain step
compiled with the same donation. A step that donates nothing, or part of its state, keeps
every state it was given. Every case against the plain step on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxsched
from support.equivalence import assert_placed_like, assert_trees_close

TX = optax.adam(1e-2)
FSDP = {"w1": P("fsdp", None), "b": P(), "w2": P("fsdp", None)}


def _mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"] - y) ** 2)


def _raw_step(p, o, batch):
    loss, grads = jax.value_and_grad(_loss)(p, *batch)
    updates, o = TX.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss


def _state(mesh, seed):
    rng = np.random.default_rng(seed)
    p = {
        "w1": rng.standard_normal((16, 32)).astype(np.float32) * 0.3,
        "b": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((32, 8)).astype(np.float32) * 0.3,
    }
    p = {k: jax.device_put(v, NamedSharding(mesh, FSDP[k])) for k, v in p.items()}
    return p, TX.init(p)


def _batches(mesh, seed, n=3):
    rng = np.random.default_rng(seed)
    return [
        tuple(
            jax.device_put(rng.standard_normal(shape).astype(np.float32), NamedSharding(mesh, P("fsdp")))
            for shape in ((64, 16), (64, 8))
        )
        for _ in range(n)
    ]


def _plain(step, state, batches):
    losses = []
    for b in batches:
        *state, loss = step(*state, b)
        losses.append(loss)
    return tuple(state), losses


def _array_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "dear", "auto"])
def test_a_step_that_donates_its_state_is_scheduled_to_update_it_in_place(strategy):
    mesh = _mesh()
    step = jax.jit(_raw_step, donate_argnums=(0, 1))
    seed = np.random.default_rng().integers(1 << 30)
    batches = _batches(mesh, seed + 1)
    want, want_losses = _plain(step, _state(mesh, seed), batches)

    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(*_state(mesh, seed))
    losses, given = [], []
    for b in batches:
        given.append(state)
        state, loss = sched(state, b)
        losses.append(loss)
    assert sched.program.per_device.donated_inputs == len(jax.tree.leaves(state))
    # every state a call returned and the next call was given is freed, as the plain step's
    for old in given[1:]:
        assert all(x.is_deleted() for x in _array_leaves(old))
    got = sched.finalize(state)
    assert_trees_close(got, want)
    assert_placed_like(want, got)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(want_losses), rtol=1e-5)
    # XLA writes the new state over the old one: the program's outputs alias its state inputs
    memory = sched.lower(state, batches[0]).compile().memory_analysis()
    state_bytes = sum(x.addressable_shards[0].data.nbytes for x in _array_leaves(state))
    assert memory.alias_size_in_bytes >= 0.9 * state_bytes


def test_a_step_that_donates_part_of_its_state_or_none_keeps_every_state_it_is_given():
    mesh = _mesh()
    seed = np.random.default_rng().integers(1 << 30)
    batches = _batches(mesh, seed + 1)
    for donate in [(), (1,)]:
        step = jax.jit(_raw_step, donate_argnums=donate)
        want, _ = _plain(step, _state(mesh, seed), batches)
        sched = jaxsched.schedule(step, strategy="wfbp")
        first = sched.init(*_state(mesh, seed))
        state = first
        for b in batches:
            state, _ = sched(state, b)
        assert sched.program.per_device.donated_inputs == 0
        assert not any(x.is_deleted() for x in _array_leaves(first))
        assert_trees_close(sched.finalize(state), want)


def test_approx_keeps_the_state_it_is_given_where_donating_would_only_copy_it():
    mesh = _mesh()
    seed = np.random.default_rng().integers(1 << 30)
    batches = _batches(mesh, seed + 1)
    finals = []
    for donate in [(0, 1), ()]:
        sched = jaxsched.schedule(jax.jit(_raw_step, donate_argnums=donate), strategy="approx", staleness=1)
        first = sched.init(*_state(mesh, seed))
        state = first
        for b in batches:
            state, _ = sched(state, b)
        assert sched.program.per_device.donated_inputs == 0
        assert not any(x.is_deleted() for x in _array_leaves(first))
        finals.append(sched.finalize(state))
    assert_trees_close(finals[0], finals[1])


def test_a_donating_step_runs_from_a_state_whose_leaves_share_one_array():
    """XLA refuses to donate one buffer twice: a state given to the scheduled step that holds
    the same array in two leaves (here adam's two moments of a leaf, one zeros array) goes
    in with a copy of it, as the plain step's caller would have to pass it."""
    mesh = _mesh()
    step = jax.jit(_raw_step, donate_argnums=(0, 1))
    seed = np.random.default_rng().integers(1 << 30)
    params, opt_state = _state(mesh, seed)
    zeros = jax.device_put(np.zeros((16, 32), np.float32), NamedSharding(mesh, FSDP["w1"]))
    adam = opt_state[0]
    opt_state = (adam._replace(mu={**adam.mu, "w1": zeros}, nu={**adam.nu, "w1": zeros}), *opt_state[1:])
    batches = _batches(mesh, seed + 1, n=2)
    want, _ = _plain(step, jax.tree.map(lambda x: x.copy(), (params, opt_state)), batches)
    sched = jaxsched.schedule(step, strategy="allreduce")
    state = sched.init(params, opt_state)
    moments = state.opt_state[0]
    assert moments.mu["w1"] is moments.nu["w1"]
    for b in batches:
        state, _ = sched(state, b)
    assert_trees_close(sched.finalize(state), want)


def test_a_state_step_jitted_with_its_state_donated_updates_it_in_place():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    seed = np.random.default_rng().integers(1 << 30)
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((6, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    @jax.jit
    def _undonated(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, *batch)
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(_undonated.__wrapped__, donate_argnums=0)
    batches = [
        jax.device_put(
            (rng.standard_normal((16, 6)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)),
            NamedSharding(mesh, P("data")),
        )
        for _ in range(3)
    ]
    make = lambda: TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, params), tx=TX)  # noqa: E731
    plain = make()
    for b in batches:
        plain, _ = step(plain, b)
    sched = jaxsched.schedule(step, strategy="wfbp")
    state = sched.init(make())
    given = []
    for b in batches:
        given.append(state)
        state, _ = sched(state, b)
    assert all(x.is_deleted() for x in _array_leaves(given[-1]))
    assert_trees_close(sched.finalize(state).params, plain.params)
    assert_trees_close(sched.finalize(state).opt_state, plain.opt_state)


def test_inspect_judges_a_donating_step_against_the_plain_step_donating_too():
    mesh = _mesh()
    params, opt_state = _state(mesh, 0)
    batch = _batches(mesh, 1, n=1)[0]

    def abstract(tree):  # a leaf on one device (adam's count) replicated, as jit would place it
        def leaf(x):
            sharding = x.sharding if len(x.sharding.device_set) > 1 else NamedSharding(mesh, P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return jax.tree.map(leaf, tree)

    def inspected(donate):
        sched = jaxsched.schedule(jax.jit(_raw_step, donate_argnums=donate), strategy="wfbp")
        return sched.inspect(sched.init(abstract(params), abstract(opt_state)), abstract(batch))

    donating, keeping = inspected((0, 1)), inspected(())
    # the plain step as the user jitted it: its new state written over the old one
    assert donating.baseline.peak_memory_bytes < keeping.baseline.peak_memory_bytes
    assert donating.report.peak_memory_bytes < keeping.report.peak_memory_bytes
    assert donating.report.peak_memory_bytes <= donating.baseline.peak_memory_bytes * 1.5
