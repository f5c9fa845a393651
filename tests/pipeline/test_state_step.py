"""``(state, batch) -> (state, aux)`` steps (jaxsched.pipeline._state_step): a Flax ``TrainState``, a
dict and a ``flax.struct`` dataclass state. Every strategy against the plain step on fresh
random inputs (rtol 1e-5), with and without ``check_vma``, on 8 and 2 devices; leaves that
are not trained pass through as the plain step moves them; lazy and eager ``init``,
``finalize`` to the same type, checkpoints, ``verify``, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import struct
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched
from jaxsched.integrations.checkpoint import restore, save
from jaxsched.pipeline._state_step import UnsplitState
from support.equivalence import assert_trees_close

FEATURES, CLASSES = 6, 3
TX = optax.adam(1e-2)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.tanh(nn.Dense(8)(x)))


MODEL = MLP()


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _variables(seed):
    return MODEL.init(jax.random.key(seed), jnp.ones((1, FEATURES)))["params"]


def _train_state(seed=0, tx=TX):
    return TrainState.create(apply_fn=MODEL.apply, params=_variables(seed), tx=tx)


def _batches(mesh, n=3, seed=1):
    rows = 2 * mesh.size
    rng = np.random.default_rng(seed)
    return [
        jax.device_put(
            (rng.standard_normal((rows, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, rows).astype(np.int32)),
            NamedSharding(mesh, P("data")),
        )
        for _ in range(n)
    ]


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _grads(grads, check_vma, n):
    # check_vma=True: JAX psums the gradients of the replicated params in backward itself
    return jax.tree.map(lambda g: g / n, grads) if check_vma else lax.pmean(grads, "data")


def _train_state_step(mesh, check_vma=False):
    n = mesh.size

    def body(state, batch):
        x, y = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return _xent(logits, y), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=_grads(grads, check_vma, n))
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return state, {"loss": lax.pmean(loss, "data"), "accuracy": lax.pmean(accuracy, "data")}

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=check_vma))


def _plain(step, state, batches):
    auxes = []
    for b in batches:
        state, aux = step(state, b)
        auxes.append(jax.device_get(aux))
    return state, auxes


def _scheduled(sched, sstate, batches):
    auxes = []
    for b in batches:
        sstate, aux = sched(sstate, b)
        auxes.append(jax.device_get(jax.block_until_ready(aux)))
    return sstate, auxes


def _assert_same(got, want):
    """Floats within rtol 1e-5; everything else (counters, keys) bitwise."""
    assert type(got) is type(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if jnp.issubdtype(jnp.result_type(b), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if jnp.issubdtype(jnp.result_type(b), jnp.floating):
            assert_trees_close(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- TrainState: every strategy is the plain step ---------------------------------------------
EXACT = {
    "allreduce": {},
    "wfbp": {"buckets": 200},
    "dear": {"buckets": 200},
    "approx": {"staleness": 0, "buckets": 200},
    "auto": {},
}
CASES = [
    pytest.param(strategy, check_vma, devices, marks=[pytest.mark.slow] if devices == 2 or strategy == "auto" else [])
    for devices in (8, 2)
    for check_vma in (False, True)
    for strategy in EXACT
]


@pytest.mark.parametrize("strategy, check_vma, devices", CASES)
def test_train_state_step_equals_the_plain_step(strategy, check_vma, devices):
    mesh = _mesh(devices)
    step = _train_state_step(mesh, check_vma)
    state, batches = _train_state(seed=devices), _batches(mesh, seed=devices + check_vma)
    plain, plain_aux = _plain(step, state, batches)
    sched = jaxsched.schedule(step, strategy=strategy, **EXACT[strategy])
    sstate, sched_aux = _scheduled(sched, sched.init(state), batches)
    _assert_same(sched.finalize(sstate), plain)
    assert_trees_close(sched_aux, plain_aux)
    assert sorted(sched.program.planned.paths) == [
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    ]
    if strategy in ("wfbp", "dear"):
        assert len(sched.program.buckets) > 1


def _params_form_step(mesh, tx=TX):
    """The same training as _train_state_step, written as step(params, opt_state, batch)."""

    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: _xent(MODEL.apply({"params": p}, x), y))(params)
        updates, opt_state = tx.update(lax.pmean(grads, "data"), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("approx", {"staleness": 1, "approx_method": "local"}),
        pytest.param("kfac", {"damping": 1e-2, "inverse_interval": 2}, marks=pytest.mark.slow),
    ],
)
def test_inexact_strategies_run_as_on_the_params_form(strategy, options):
    """approx with staleness and kfac change the numbers by design: the state form gives
    what the same training written as step(params, opt_state, batch) gives."""
    mesh = _mesh(8)
    tx = optax.sgd(0.1, momentum=0.9)
    state, batches = _train_state(tx=tx), _batches(mesh, n=4)
    trees = jaxsched.schedule(_params_form_step(mesh, tx), strategy=strategy, **options)
    tstate, _ = _scheduled(trees, trees.init(state.params, state.opt_state), batches)
    want_params, want_opt = trees.finalize(tstate)
    sched = jaxsched.schedule(_train_state_step(mesh), strategy=strategy, **options)
    sstate, _ = _scheduled(sched, sched.init(state), batches)
    got = sched.finalize(sstate)
    assert_trees_close(got.params, want_params)
    assert_trees_close(got.opt_state, want_opt)
    assert int(got.step) == len(batches)


# -- dict and dataclass states: what is not trained passes through -----------------------------
def _dict_state(seed=0):
    params = _variables(seed)
    return {
        "params": params,
        "opt_state": TX.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key(seed),
    }


def _dict_step(mesh):
    def body(state, batch):
        x, y = batch
        rng, dropout = jax.random.split(state["rng"])
        keep = jax.random.bernoulli(dropout, 0.8, x.shape)
        loss, grads = jax.value_and_grad(lambda p: _xent(MODEL.apply({"params": p}, jnp.where(keep, x / 0.8, 0)), y))(
            state["params"]
        )
        updates, opt_state = TX.update(lax.pmean(grads, "data"), state["opt_state"], state["params"])
        new = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": rng,
        }
        return new, lax.pmean(loss, "data")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))


@struct.dataclass
class Trainer:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array  # returned unchanged
    temperature: jax.Array  # read by forward, never updated
    loss_ema: jax.Array  # an average of the pmean'ed loss: updated, but not trained
    apply_fn: callable = struct.field(pytree_node=False)


def _dataclass_state(seed=0):
    params = _variables(seed)
    return Trainer(
        params,
        TX.init(params),
        jnp.zeros((), jnp.int32),
        jax.random.key(seed),
        jnp.asarray(1.5, jnp.float32),
        jnp.zeros((), jnp.float32),
        MODEL.apply,
    )


def _dataclass_step(mesh):
    def body(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: _xent(state.apply_fn({"params": p}, x) / state.temperature, y))(
            state.params
        )
        updates, opt_state = TX.update(lax.pmean(grads, "data"), state.opt_state, state.params)
        loss = lax.pmean(loss, "data")
        return state.replace(
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            step=state.step + 1,
            loss_ema=0.9 * state.loss_ema + 0.1 * loss,
        ), loss

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))


STATES = {"dict": (_dict_state, _dict_step), "dataclass": (_dataclass_state, _dataclass_step)}


@pytest.mark.parametrize("kind", sorted(STATES))
@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow)])
def test_dict_and_dataclass_states_train_only_their_parameters(kind, strategy):
    make_state, make_step = STATES[kind]
    mesh = _mesh(8)
    step, state, batches = make_step(mesh), make_state(), _batches(mesh)
    plain, plain_aux = _plain(step, state, batches)
    sched = jaxsched.schedule(step, strategy=strategy, buckets=200)
    sstate, sched_aux = _scheduled(sched, sched.init(state), batches)
    _assert_same(sched.finalize(sstate), plain)
    assert_trees_close(sched_aux, plain_aux)
    assert sorted(sched.program.planned.paths) == [
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    ]
    rest = sched.program.captured.opt_tree  # the rest: every other leaf, by path
    names = sorted(jax.tree_util.tree_unflatten(rest, range(rest.num_leaves)))
    assert "step" in names and "rng" in names and "opt_state/0/mu/Dense_0/kernel" in names
    if kind == "dataclass":
        assert {"temperature", "loss_ema"} <= set(names)
        assert float(sched.finalize(sstate).temperature) == 1.5


# -- init, finalize, checkpoints, verify ---------------------------------------------------------
def test_lazy_and_eager_init_give_the_same_training():
    mesh = _mesh(2)
    step, state, batches = _train_state_step(mesh), _train_state(), _batches(mesh)
    sched = jaxsched.schedule(step, strategy="dear")
    lazy = sched.init(state)
    assert isinstance(lazy, UnsplitState) and sched.finalize(lazy) is state
    eager = sched.init(state, batches[0])  # split at once: the strategy's layout
    assert not isinstance(eager, UnsplitState)
    assert eager.params["params/Dense_0/kernel"].shape != state.params["Dense_0"]["kernel"].shape
    assert sched.init(state, batch=batches[0]).params.keys() == eager.params.keys()
    a, _ = _scheduled(sched, lazy, batches)
    b, _ = _scheduled(sched, eager, batches)
    _assert_same(sched.finalize(a), sched.finalize(b))
    assert sched.num_programs == 1
    finalized = sched.finalize(b)
    assert isinstance(finalized, TrainState) and finalized.apply_fn is state.apply_fn
    assert finalized.tx is state.tx and int(finalized.step) == 3
    assert "reduce_scatter" in sched.lower(b, batches[0]).as_text()


def test_a_pmap_train_state_step():
    devices = jax.devices()[:4]
    n = len(devices)

    def body(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: _xent(state.apply_fn({"params": p}, x), y))(state.params)
        return state.apply_gradients(grads=lax.pmean(grads, "data")), lax.pmean(loss, "data")

    step = jax.pmap(body, axis_name="data", devices=devices)
    state = jax.tree.map(lambda a: np.stack([np.asarray(a)] * n), _train_state())
    rng = np.random.default_rng(5)
    batches = [
        (rng.standard_normal((n, 2, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, (n, 2)).astype(np.int32))
        for _ in range(3)
    ]
    plain, plain_aux = _plain(step, state, batches)
    sched = jaxsched.schedule(step, strategy="dear", buckets=200)
    sstate, sched_aux = _scheduled(sched, sched.init(state), batches)
    _assert_same(sched.finalize(sstate), plain)
    assert_trees_close(sched_aux, plain_aux)


def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    mesh = _mesh(2)
    step, state, batches = _train_state_step(mesh), _train_state(), _batches(mesh, n=4)
    sched = jaxsched.schedule(step, strategy="dear", buckets=200)
    straight, _ = _scheduled(sched, sched.init(state), batches)
    half, _ = _scheduled(sched, sched.init(state), batches[:2])
    save(tmp_path / "ckpt", half)
    # a new process: a fresh schedule, its restore target from init(state, batch)
    resumed_sched = jaxsched.schedule(step, strategy="dear", buckets=200)
    target = resumed_sched.init(state, batches[0])
    resumed = restore(tmp_path / "ckpt", target)
    resumed, _ = _scheduled(resumed_sched, resumed, batches[2:])
    got, want = resumed_sched.finalize(resumed), sched.finalize(straight)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_verify_compares_with_the_users_step():
    mesh = _mesh(2)
    step, state = _train_state_step(mesh), _train_state()
    sched = jaxsched.schedule(step, strategy="dear", buckets=200)
    report = sched.verify(sched.init(state), _batches(mesh, n=3), steps=3)
    assert report.ok, str(report)
    assert report.precision == "float64"
    assert any("params/Dense_0/kernel" in name for name in report.leaf_gap)


# -- errors ----------------------------------------------------------------------------------------
def test_an_output_state_of_another_structure_names_both():
    mesh = _mesh(2)

    def body(state, batch):
        x, y = batch
        grads = lax.pmean(jax.grad(lambda p: _xent(MODEL.apply({"params": p}, x), y))(state["params"]), "data")
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params, "extra": jnp.zeros(())}, jnp.zeros(())

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))
    sched = jaxsched.schedule(step)
    with pytest.raises(
        jaxsched.UnsupportedStepError,
        match=r"the step's output state differs from its input state: .*has extra leaves extra of",
    ):
        sched(sched.init({"params": _variables(0)}), _batches(mesh, n=1)[0])


def test_a_state_with_nothing_trained_names_each_leaf():
    mesh = _mesh(2)

    def body(state, batch):  # a running mean of the batch, averaged over devices: no parameter
        x, _ = batch
        return {"mean": 0.5 * state["mean"] + lax.pmean(x.mean(0), "data")}, jnp.zeros(())

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))
    sched = jaxsched.schedule(step)
    with pytest.raises(
        jaxsched.UnsupportedStepError,
        match=r"found no trained parameter in the state.*mean \(forward and backward never",
    ):
        sched.init({"mean": jnp.zeros(FEATURES)}, _batches(mesh, n=1)[0])


def test_wrong_arity_states_both_signatures():
    both = r"step\(params, opt_state, batch\) -> \(params, opt_state, aux\) or step\(state, batch\)"
    with pytest.raises(TypeError, match=r"the step takes 1 positional argument\(s\); .*" + both):
        jaxsched.schedule(lambda batch: None).init(1)
    state_step = jaxsched.schedule(lambda state, batch: None)
    with pytest.raises(TypeError, match=r"but the step takes \(state, batch\): call sched.init\(state\)"):
        state_step.init(1, 2, 3)
    with pytest.raises(TypeError, match="sched.init got 4 positional argument"):
        jaxsched.schedule(lambda *a: a).init(1, 2, 3, 4)


def test_extra_inputs_before_the_batch_are_read_from_the_signature():
    from jaxsched.pipeline._state_step import inputs_of

    assert step_form_of(lambda model, optimizer, metrics, batch: None, 3) == "trees"
    assert step_form_of(lambda train_state, rng, batch: None, 1) == "state"
    assert inputs_of(lambda train_state, rng, batch: None, 1) == 2
    assert inputs_of(lambda params, opt_state, rng, batch: None, 2) == 2
    assert inputs_of(lambda *a: None, 1) is None


def step_form_of(step, n_args):
    from jaxsched.pipeline._state_step import step_form

    return step_form(step, (0,) * n_args, False)


def test_the_form_is_read_from_the_step_signature_and_else_from_init():
    from jaxsched.pipeline._state_step import step_form

    assert step_form(lambda state, batch: 0, (0, 0), False) == "state"
    assert step_form(lambda params, opt_state, batch: 0, (0, 0), False) == "trees"
    assert step_form(lambda *a: 0, (0,), False) == "state"
    assert step_form(lambda *a: 0, (0,), True) == "state"
    assert step_form(lambda *a: 0, (0, 0), False) == "trees"  # as before: (params, opt_state)
    assert step_form(lambda *a: 0, (0, 0, 0), False) == "trees"
    jitted = jax.jit(
        jax.shard_map(
            lambda state, batch: (state, batch), mesh=_mesh(2), in_specs=(P(), P("data")), out_specs=(P(), P())
        )
    )
    assert step_form(jitted, (0, 0), False) == "state"


def test_the_form_is_read_from_what_the_arguments_are():
    """EasyLM's step(train_state, rng, batch): a TrainState first, a key second, is the state
    form whatever the count, never (params=TrainState, opt_state=rng)."""
    from jaxsched.pipeline._state_step import step_form

    state, rng = _train_state(), jax.random.key(0)
    easylm = lambda train_state, rng, batch: None
    assert step_form(easylm, (state, rng), False) == "state"
    assert step_form(easylm, (state, rng, _batches(_mesh(2), n=1)[0]), False) == "state"
    assert step_form(easylm, (state.params, rng), False) == "state"  # a key is an input
    assert step_form(easylm, (state.params, state.opt_state), False) == "trees"
    assert step_form(lambda p, o, b: 0, ({"w": jnp.ones(2)}, {"w": jnp.zeros(2)}), False) == "trees"
    with pytest.warns(UserWarning, match=r"fit both forms; jaxsched read them as \(params, opt_state\)"):
        assert step_form(lambda p, o, b: 0, ({"w": jnp.ones(2)}, jnp.ones(3)), False) == "trees"


def _easylm_step(mesh):
    """EasyLM's train_step as written: (train_state, rng, batch) -> (train_state, rng, metrics),
    the batch placed replicated and split inside the step, dropout from the carried key."""

    def train_step(train_state, rng, batch):
        rng, dropout = jax.random.split(rng)
        x, y = batch
        keep = jax.random.bernoulli(dropout, 0.9, x.shape)

        def loss_fn(params):
            logits = train_state.apply_fn({"params": params}, jnp.where(keep, x / 0.9, 0))
            return _xent(logits, y)

        loss, grads = jax.value_and_grad(loss_fn)(train_state.params)
        return train_state.apply_gradients(grads=grads), rng, {"loss": loss}

    return jax.jit(train_step)


@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow), "allreduce"])
def test_a_step_that_carries_its_key_out_returns_what_the_plain_step_does(strategy):
    """EasyLM's mesh ('dp', 'fsdp', 'mp') = (8, 1, 1), the batch over ('dp', 'fsdp'):
    sched(state, rng, batch) returns (state, rng, metrics); every leaf comes back in the
    plain step's shape, dtype and sharding."""
    mesh = jax.make_mesh((8, 1, 1), ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    step = _easylm_step(mesh)
    rng, state = jax.random.key(3), _train_state(seed=4)
    batches = [jax.device_put(b, jax.NamedSharding(mesh, P(("dp", "fsdp")))) for b in _batches(_mesh(8), n=3, seed=5)]
    plain, plain_rng, plain_aux = state, rng, []
    for b in batches:
        plain, plain_rng, aux = step(plain, plain_rng, b)
        plain_aux.append(aux)
    sched = jaxsched.schedule(step, strategy=strategy)
    sstate, srng, sched_aux = sched.init(state, rng), rng, []
    for b in batches:
        sstate, srng, aux = sched(sstate, srng, b)
        sched_aux.append(aux)
    got = sched.finalize(sstate)
    assert type(got) is TrainState
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        if isinstance(b, jax.Array) and isinstance(a, jax.Array):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    _assert_same(got, plain)
    assert_trees_close(sched_aux, plain_aux)
    np.testing.assert_array_equal(jax.random.key_data(srng), jax.random.key_data(plain_rng))


def test_a_step_that_returns_the_wrong_outputs_gets_a_short_message():
    mesh = _mesh(2)
    step = jax.jit(lambda state, rng, batch: (state, rng, {"loss": 0.0}, 7))
    sched = jaxsched.schedule(step)
    with pytest.raises(jaxsched.UnsupportedStepError) as err:
        sched(sched.init(_train_state()), jax.random.key(0), _batches(mesh, n=1)[0])
    message = str(err.value).split("\n")[0]
    assert "PyTreeDef" not in message and len(message) < 400
    assert "4 outputs (TrainState of" in message


# -- re-planning a step(state, batch): the inner schedule's plans, read through the one object --


def test_replan_of_a_state_step_reads_the_inner_schedule():
    from jaxsched.demo import steps
    from support.replan_model import bandwidth_bound, batches, latency_bound, optimizer, tanh_mlp

    mesh = _mesh(2)
    params, apply = tanh_mlp()
    tx = optimizer()
    trees_step = steps.make_step(apply, tx, mesh)

    def train_step(state, batch):
        new_params, new_opt_state, aux = trees_step(state["params"], state["opt_state"], batch)
        return {"params": new_params, "opt_state": new_opt_state}, aux

    sched = jaxsched.schedule(train_step, replan=jaxsched.Replan(every=1000), network_profile=latency_bound(2))
    with pytest.raises(RuntimeError, match="traced first"):
        sched.replan("1gbe")  # the form is known only once a state was split
    data = [steps.shard_batch(b, mesh) for b in batches(2, 4)]
    state, _ = sched(sched.init({"params": params, "opt_state": tx.init(params)}), data[0])
    before = sched.program
    pending = sched.replan(bandwidth_bound(2))
    state, _ = sched(state, data[1])
    assert pending is not None and pending.reason == "requested"
    assert [r.step for r in sched.replans] == [1] and sched.replan_decisions == []
    assert sched.program is not before and sched.num_programs == 1  # the new plan's cache
