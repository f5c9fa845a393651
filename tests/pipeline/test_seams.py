"""The three seams: a strategy, a collective and an engine defined outside the package plug
in through the public registries; programs are cached per batch signature."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.core import _replay as replay
from jaxsched.demo import steps
from jaxsched.runtime.engine import XlaEngine, make_engine, register_engine
from jaxsched.strategies import UserLayoutStrategy, register_strategy, unregister_strategy
from support.equivalence import assert_trees_close, build, random_batches

ROOT = Path(__file__).resolve().parents[2]


class Bf16AllReduce(UserLayoutStrategy):
    """A toy strategy: the user's step with every gradient reduction carried in bfloat16."""

    name = "toy_bf16_allreduce"
    cost = jaxsched.sim._costmodel.CommPattern(in_backward=False, packs_buckets=False)

    def per_device(self, planned, values, collective_state):
        body = planned.captured.body
        reducing = {id(body.eqns[r.eqn_index]) for r in planned.analysis.reductions}

        def run(eqn, operands):
            if id(eqn) not in reducing:
                return replay.bind(eqn, operands)
            return [lax.psum(x.astype(jnp.bfloat16), planned.axis_name).astype(x.dtype) for x in operands]

        return replay.eval_inline(body, [], values, run=run), collective_state


@pytest.fixture
def toy_strategy():
    register_strategy(Bf16AllReduce)
    yield Bf16AllReduce.name
    unregister_strategy(Bf16AllReduce.name)


def _bf16_reference_step(apply_fn, tx, mesh):
    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, x), y))(params)
        grads = jax.tree.map(
            lambda g: lax.psum(g.astype(jnp.bfloat16), "data").astype(g.dtype) / lax.axis_size("data"), grads
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )


def test_a_strategy_defined_outside_the_package_registers_and_runs_exactly(toy_strategy):
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1, momentum=0.9)
    mesh = jax.make_mesh((8,), ("data",))
    user_step = steps.make_step(apply_fn, tx, mesh)  # reduces in float32
    reference = _bf16_reference_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(user_step, strategy=toy_strategy)
    assert toy_strategy in jaxsched.STRATEGIES
    state, ref = sched.init(params, tx.init(params)), (params, tx.init(params))
    full = (params, tx.init(params))
    for batch in random_batches("mlp", 8, 16, seed=3):
        batch = steps.shard_batch(batch, mesh)
        state, _ = sched(state, batch)
        *ref, _ = reference(*ref, batch)
        *full, _ = user_step(*full, batch)
        jax.block_until_ready(state)
    assert_trees_close(sched.finalize(state), tuple(ref))
    # and it really reduced in bf16: the float32 step ends elsewhere
    gap = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(full[0]), jax.tree.leaves(sched.finalize(state)[0]))
    )
    assert gap > 1e-6
    # the simulator knows it by name through its cost description
    layers = jaxsched.LayerProfile([jaxsched.Layer("l", 10, 40, 1e-3, 2e-3)])
    assert jaxsched.simulate(layers, jaxsched.network_preset("10gbe", 8), toy_strategy).iteration_s > 0


def test_the_registry_refuses_a_taken_name_and_unknown_names(toy_strategy):
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(Bf16AllReduce)

    class Other(Bf16AllReduce):
        name = "dear"

    with pytest.raises(ValueError, match="'dear' is already registered"):
        register_strategy(Other)
    with pytest.raises(ValueError, match="strategy='deer' is unknown.*dear"):
        jaxsched.schedule(lambda *a: a, strategy="deer")
    with pytest.raises(TypeError, match="Strategy subclass"):
        register_strategy(object)
    with pytest.raises(ValueError, match="engine='host2' is unknown"):
        jaxsched.schedule(lambda *a: a, strategy="wfbp", engine="host2")


class CountingCollective(jaxsched.CollectiveWrapper):
    """Counts, per device and bucket, how often each operation ran: carried state."""

    def init_own(self, bucket):
        return jnp.zeros((3,), jnp.int32)

    def _count(self, state, op):
        own, inner = state
        return own.at[op].add(1), inner

    def all_reduce(self, buffer, axis_name, bucket, state):
        out, state = super().all_reduce(buffer, axis_name, bucket, state)
        return out, self._count(state, 0)

    def reduce_scatter(self, buffer, axis_name, bucket, state):
        out, state = super().reduce_scatter(buffer, axis_name, bucket, state)
        return out, self._count(state, 1)

    def all_gather(self, shard, axis_name, bucket, state):
        out, state = super().all_gather(shard, axis_name, bucket, state)
        return out, self._count(state, 2)


@pytest.mark.parametrize(
    "strategy, expected", [pytest.param("wfbp", [5, 0, 0], marks=pytest.mark.slow), ("dear", [0, 5, 5])]
)
def test_a_collective_wrapper_carries_per_device_state_through_any_strategy(strategy, expected):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    step = steps.make_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(step, strategy=strategy, collective=CountingCollective(), buckets=1)
    state = plain = sched.init(params, tx.init(params))
    plain = (params, tx.init(params))
    for batch in random_batches("mlp", 5, 8, seed=1):
        batch = steps.shard_batch(batch, mesh)
        state, _ = sched(state, batch)
        *plain, _ = step(*plain, batch)
        jax.block_until_ready(state)
    counts = jax.tree.leaves(state.collective_state)
    assert len(counts) == len(sched.program.buckets) == 6
    for leaf in counts:
        assert leaf.shape == (4, 3)  # one row per device
        np.testing.assert_array_equal(np.asarray(leaf), np.tile(expected, (4, 1)))
    assert_trees_close(sched.finalize(state), tuple(plain))  # counting changes no number


def test_allreduce_cannot_carry_a_collective():
    with pytest.raises(ValueError, match="allreduce.*cannot carry CountingCollective"):
        jaxsched.schedule(lambda *a: a, strategy="allreduce", collective=CountingCollective())


@pytest.mark.parametrize(
    "strategy",
    [pytest.param("allreduce", marks=pytest.mark.slow), pytest.param("wfbp", marks=pytest.mark.slow), "dear"],
)
def test_each_batch_shape_gets_its_own_program_and_matches_the_plain_step(strategy):
    params, apply_fn = build("mlp", 0)
    tx = optax.adamw(1e-2)
    mesh = jax.make_mesh((8,), ("data",))
    step = steps.make_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(step, strategy=strategy)
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    rng = np.random.default_rng(7)
    for rows in (32, 32, 16, 32):
        x = rng.standard_normal((rows, 8, 8, 1)).astype(np.float32)
        y = rng.integers(0, 10, rows).astype(np.int32)
        batch = steps.shard_batch((x, y), mesh)
        state, aux = sched(state, batch)
        *plain, plain_aux = step(*plain, batch)
        assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux))
    assert sched.num_programs == 2
    assert_trees_close(sched.finalize(state), tuple(plain))


class CountingEngine(XlaEngine):
    name = "counting_xla"
    compiled = 0

    def compile(self, program):
        type(self).compiled += 1
        assert program.in_specs[-1] == P("data")  # the batch, as the user's step shards it
        return super().compile(program)


def test_an_engine_plugs_in_by_name_and_as_an_instance():
    register_engine("counting_xla", CountingEngine)
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    batch = steps.shard_batch(next(random_batches("mlp", 1, 4, 0)), mesh)
    for engine in ("counting_xla", CountingEngine()):
        sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp", engine=engine)
        state, aux = sched(sched.init(params, tx.init(params)), batch)
        assert np.isfinite(float(aux["loss"]))
    assert CountingEngine.compiled == 2
    with pytest.raises(ValueError, match="already registered"):
        register_engine("counting_xla", CountingEngine)
    with pytest.raises(TypeError, match="does not take options"):
        make_engine("counting_xla", compiler_option={})


def _string_comparisons(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                elts = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                found |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return found


def test_the_pipeline_compares_against_no_strategy_name():
    # "auto" is also the value of buckets= and engine=, which the pipeline does compare
    names = (set(jaxsched.STRATEGIES) | {"approx", "mgwfbp"}) - {"auto"}
    for module in (
        "_schedule.py",
        "pipeline/_program.py",
        "pipeline/_selection.py",
        "plan/_planned_step.py",
        "runtime/engine/_base.py",
        "runtime/engine/_xla.py",
        "plan/__init__.py",
        "plan/_common.py",
        "plan/_from_step.py",
        "sim/_core.py",
    ):
        assert not _string_comparisons(ROOT / "jaxsched" / module) & names, module


@pytest.mark.parametrize("wrapped", [False, True])
def test_all_reduce_tensors_sums_each_tensor_whatever_its_size(wrapped):
    """Large tensors go as they are, small ones share a buffer, a wrapper gets the flat
    bucket: every way gives each tensor's own psum, in its own shape and dtype."""
    from jaxsched.runtime.collectives._base import SMALL_TENSOR_BYTES, BucketSpec, Collective, CollectiveWrapper

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    rng = np.random.default_rng(7)
    big = SMALL_TENSOR_BYTES // 4 + 1
    shapes = [(big,), (3, 5), (2,), (big // 8 + 1, 8), ()]
    tensors = [rng.standard_normal((4,) + s).astype(np.float32) for s in shapes]
    collective = CollectiveWrapper() if wrapped else Collective()
    spec = BucketSpec(
        index=0, size=sum(int(np.prod(s)) for s in shapes), dtype=np.dtype("float32"), axis_size=4, shapes=tuple(shapes)
    )

    def body(*blocks):
        sums, _ = collective.all_reduce_tensors([b[0] for b in blocks], "data", spec, collective.init([spec])[0])
        return [s[None] for s in sums]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    placed = [jax.device_put(t, jax.NamedSharding(mesh, P("data"))) for t in tensors]
    outs = f(*placed)
    for t, out in zip(tensors, outs, strict=True):
        assert out.shape == t.shape and out.dtype == t.dtype
        np.testing.assert_allclose(np.asarray(out)[0], t.sum(0), rtol=1e-5, atol=1e-5)
    psums = [e for e in replay.nested_eqns(jax.make_jaxpr(f)(*placed).jaxpr) if e.primitive.name == "psum"]
    # plain: two large tensors as they are + one buffer for the three small ones; wrapped: one
    assert len(psums) == (1 if wrapped else 3)


def test_a_known_signature_skips_the_checks_and_a_new_one_is_checked(monkeypatch):
    """The training loop's call (state the last step returned, batch of a known signature)
    runs without the checked path; a batch of a new signature, or a bad one, still takes it."""
    from jaxsched.pipeline._program import Program

    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((4, 2))}

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.sum(grads["w"])

    sched = jaxsched.schedule(step, strategy="wfbp")
    checked = []
    run = Program.run
    monkeypatch.setattr(Program, "run", lambda self, *a: checked.append(1) or run(self, *a))
    state = sched.init(params, tx.init(params))
    state, _ = sched(state, jnp.ones((8, 4)))
    assert len(checked) == 1
    for _ in range(3):
        state, _ = sched(state, jnp.ones((8, 4)))
    assert len(checked) == 1  # validated and flattened once per signature
    state, _ = sched(state, jnp.ones((6, 4)))  # a new signature: checked, its own program
    assert len(checked) == 2 and sched.num_programs == 2
    with pytest.raises(TypeError):  # a bad batch still meets the checked path's errors
        sched(state, (jnp.ones((6, 4)), jnp.ones(6)))


@pytest.mark.parametrize("strategy", ["wfbp", "approx"])
def test_the_loops_batch_goes_to_the_jitted_core_unchecked_and_a_changed_one_finds_its_program(strategy, monkeypatch):
    """On the xla engine a training loop's batch goes to the core without Python checks
    (its jit compares the signature in C++); a batch of another shape or dtype trips the
    core's guard instead of running the program of another signature, and is stepped by
    its own program, every step equal to the plain step's."""
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.ones((4, 2)) * 0.1, "b": jnp.zeros(2)}

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        grads = jax.grad(lambda p: jnp.mean((x.astype(jnp.float32) @ p["w"] + p["b"] - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.sum(grads["w"])

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)

    def batch(rows, dtype=np.float32):
        arrays = (rng.standard_normal((rows, 4)).astype(dtype), rng.standard_normal((rows, 2)).astype(np.float32))
        return jax.device_put(arrays, jax.sharding.NamedSharding(mesh, P("data")))

    sched = jaxsched.schedule(step, strategy=strategy, **({"staleness": 0} if strategy == "approx" else {}))
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    for b in [batch(8), batch(8), batch(4), batch(8), batch(8, jnp.bfloat16), batch(8), batch(12), batch(8)]:
        state, aux = sched(state, b)
        *plain, plain_aux = step(*plain, b)
        assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)
        assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux), rtol=1e-5, atol=1e-6)
    assert sched.num_programs == 4
    from jaxsched.pipeline._program import Program

    checked = []
    for name in ("run", "run_again"):  # a training loop's calls go straight to the core
        original = getattr(Program, name)
        monkeypatch.setattr(Program, name, lambda self, *a, _f=original: checked.append(1) or _f(self, *a))
    for _ in range(3):
        b = batch(8)
        state, aux = sched(state, b)
        *plain, plain_aux = step(*plain, b)
    assert not checked and sched.num_programs == 4
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)
    assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["wfbp", "approx"])
def test_a_weakly_typed_batch_leaf_gets_its_own_program_as_jax_jit_gives_it(strategy):
    """A Python scalar or ``jnp.asarray(0.5)`` in the batch is weakly typed: ``x.astype(bf16)
    * scale`` stays bfloat16 in the plain step, where a float32 scale makes it float32. The
    weak type is part of the signature (a training loop's call and the checked path), so
    every call returns the plain step's dtypes and values."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax.sgd(0.1)
    rng = np.random.default_rng(11)
    params = {"w": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)}

    @jax.jit
    def step(params, opt_state, batch):
        x, scale = batch
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] * scale) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        # elementwise, no reduction: the same bfloat16 rounding on any CPU and any partitioning
        return optax.apply_updates(params, updates), opt_state, x[:2].astype(jnp.bfloat16) * scale

    sched = jaxsched.schedule(step, strategy=strategy, **({"staleness": 0} if strategy == "approx" else {}))
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    scales = [np.float32(0.5), 0.5, 0.5, jnp.asarray(0.5), jnp.asarray(0.5), np.float32(0.5), jnp.float32(0.5), 2, 0.5]
    for scale in scales:
        x = jax.device_put(jnp.asarray(rng.standard_normal((16, 4)), jnp.float32), jax.NamedSharding(mesh, P("data")))
        state, aux = sched(state, (x, scale))
        *plain, plain_aux = step(*plain, (x, scale))
        assert aux.dtype == plain_aux.dtype, (scale, aux.dtype, plain_aux.dtype)
        np.testing.assert_array_equal(np.asarray(aux, np.float32), np.asarray(plain_aux, np.float32))
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)


def _linear_step(tx: optax.GradientTransformation):
    """A jitted ``step(params, opt_state, (x, y))`` of a linear least-squares model whose aux
    is its weight gradient's sum."""

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.sum(grads["w"])

    return step


@pytest.mark.parametrize("strategy", ["wfbp", "dear", "approx"])
def test_a_learning_rate_set_in_place_in_the_returned_state_is_the_one_the_next_step_uses(strategy):
    """``optax.inject_hyperparams``'s way of changing the learning rate: set it in the state's
    ``hyperparams`` dict between steps. The plain jit step reads its arguments on every call,
    so the scheduled step does too: the next step uses the new rate, whichever path runs it."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    rng = np.random.default_rng(13)
    params = {"w": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32), "b": jnp.zeros(2)}

    step = _linear_step(tx)

    sched = jaxsched.schedule(step, strategy=strategy, **({"staleness": 0} if strategy == "approx" else {}))
    state, plain = sched.init(params, tx.init(params)), [params, tx.init(params)]
    for i, rate in enumerate([None, None, 0.01, None, 0.5, None]):
        if rate is not None:  # in place, in both loops' states
            state.opt_state.hyperparams["learning_rate"] = jnp.asarray(rate)
            plain[1].hyperparams["learning_rate"] = jnp.asarray(rate)
        arrays = (rng.standard_normal((16, 4)).astype(np.float32), rng.standard_normal((16, 2)).astype(np.float32))
        b = jax.device_put(arrays, jax.sharding.NamedSharding(mesh, P("data")))
        state, aux = sched(state, b)
        *plain, plain_aux = step(*plain, b)
        assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux), rtol=1e-5, atol=1e-6)
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("detour", ["refused", "lowered"])
def test_after_a_refused_or_lowered_batch_the_loop_goes_on_and_finalize_reads_the_program_that_ran(detour):
    """A call refused (a ``dear`` batch on one device, its state laid out over 8) or a
    ``lower`` of another signature makes another program the last; the training loop's next
    calls run their own program, which ``sched.program`` and ``finalize`` then read again."""
    tx = optax.sgd(0.1, momentum=0.9)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(7)
    params = {"w": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32), "b": jnp.zeros(2)}

    step = _linear_step(tx)

    def batch(rows=16):
        arrays = (rng.standard_normal((rows, 4)).astype(np.float32), rng.standard_normal((rows, 2)).astype(np.float32))
        return jax.device_put(arrays, jax.sharding.NamedSharding(mesh, P("data")))

    sched = jaxsched.schedule(step, strategy="dear")
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    for i in range(6):
        if i == 3 and detour == "refused":
            with pytest.raises(ValueError, match=r"mesh \{'data': 1\} \(1 device\).*mesh \{'data': 8\} \(8 devices\)"):
                sched(state, tuple(jnp.asarray(np.asarray(a)) for a in batch()))
        elif i == 3:
            sched.lower(state, batch(32))
        b = batch()
        state, aux = sched(state, b)
        if i < 3:
            ran = sched.program  # the program of this signature, before the detour
        *plain, plain_aux = step(*plain, b)
        assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux), rtol=1e-5, atol=1e-6)
    assert sched.program is ran and sched.program.returned is state
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["state", "state_key", "no_aux"])
def test_each_step_forms_loop_calls_go_straight_to_the_core_and_return_what_the_step_returns(form, monkeypatch):
    """A ``step(state, batch)``, a ``step(state, key, batch)`` returning one output per input,
    and a step returning its state alone: a training loop's calls skip the checked path
    and return the plain step's outputs, in its structure, every step equal to it."""
    from jaxsched.pipeline._program import Program

    tx = optax.adam(0.05)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(5)

    def loss_fn(w, x, noise):
        return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] + noise) ** 2)

    def update(state, x, noise):
        grads = jax.grad(loss_fn)(state["w"], x, noise)
        updates, opt_state = tx.update(grads, state["opt_state"], state["w"])
        return {"w": optax.apply_updates(state["w"], updates), "opt_state": opt_state}, loss_fn(state["w"], x, noise)

    if form == "state_key":

        @jax.jit
        def step(state, key, batch):
            key, sub = jax.random.split(key)
            new, loss = update(state, batch, 0.01 * jax.random.normal(sub, (batch.shape[0], 2)))
            return new, key, loss

    else:

        @jax.jit
        def step(state, batch):
            new, loss = update(state, batch, 0.0)
            return new if form == "no_aux" else (new, loss)

    w = {"a": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)}
    w["b"] = jnp.asarray(rng.standard_normal((5, 2)), jnp.float32)
    state = {"w": w, "opt_state": tx.init(w)}
    sched = jaxsched.schedule(step)
    sstate, plain, key = sched.init(state), state, jax.random.key(1)
    skey = key  # the key the scheduled step returns, given back to it
    checked = []
    for i in range(5):
        if i == 2:  # the first call and the second (the state now the program's) were checked
            for name in ("run", "run_again"):
                original = getattr(Program, name)
                monkeypatch.setattr(Program, name, lambda self, *a, _f=original: checked.append(1) or _f(self, *a))
        b = jax.device_put(jnp.asarray(rng.standard_normal((8, 3)), jnp.float32), jax.NamedSharding(mesh, P("data")))
        if form == "state_key":
            sstate, skey, aux = sched(sstate, skey, b)
            plain, key, plain_aux = step(plain, key, b)
            assert jnp.array_equal(jax.random.key_data(skey), jax.random.key_data(key))
        elif form == "no_aux":
            sstate, aux, plain_aux = sched(sstate, b), None, None
            plain = step(plain, b)
        else:
            sstate, aux = sched(sstate, b)
            plain, plain_aux = step(plain, b)
        assert_trees_close(jax.device_get(sched.finalize(sstate)), jax.device_get(plain), rtol=1e-5, atol=1e-6)
        assert_trees_close(jax.device_get(aux), jax.device_get(plain_aux), rtol=1e-5, atol=1e-6)
    assert not checked
    # a key made on the default device, then the one the program returns: at most 2 signatures
    assert sched.num_programs == (2 if form == "state_key" else 1)


@pytest.mark.parametrize("given", ["auto", "dear"])
def test_scheduling_never_changes_the_users_strategy(given):
    """Selection records its choices on the schedule's own copy: the instance the user passed
    keeps every attribute it had, while ``sched.strategy.last_choice`` shows the choice."""
    import copy

    from jaxsched.demo import steps
    from jaxsched.strategies import make_strategy
    from jaxsched.zoo import models

    params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = optax.sgd(0.1)
    strategy = make_strategy(given)
    before = copy.copy(vars(strategy))
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy, buckets="auto")
    batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    state, _ = sched(sched.init(params, tx.init(params)), batch)
    assert vars(strategy).keys() == before.keys()
    assert all(vars(strategy)[k] is v for k, v in before.items())
    if given == "auto":
        assert sched.strategy.last_choice is not None


def test_fresh_per_device_state_on_a_one_device_mesh_is_placed_with_its_spec():
    """A per-device state leaf (TopK's residual, P("data")) starts as a one-device array:
    the same layout on a one-device mesh, but not the same type on an Explicit mesh, whose
    shard_map refuses it; so it is placed, not passed as is."""
    from jax.sharding import AxisType, NamedSharding

    from jaxsched.plan import takes_as_is
    from jaxsched.runtime.compress import TopK

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(AxisType.Explicit,))
    x = jnp.zeros((1, 4))
    assert not takes_as_is(x.sharding, NamedSharding(mesh, P("data")), 2)
    placed = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    assert takes_as_is(placed.sharding, NamedSharding(mesh, P("data")), 2)
    auto = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(AxisType.Auto,))
    assert takes_as_is(x.sharding, NamedSharding(auto, P("data")), 2)  # untyped: the layout is enough

    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    plain = steps.make_step(apply_fn, tx, mesh)
    batch = steps.shard_batch(next(random_batches("mlp", 1, 8, 0)), mesh)
    sched = jaxsched.schedule(plain, strategy="wfbp", compression=TopK(0.5))
    p0, o0 = steps.place_replicated((params, tx.init(params)), mesh)
    state, aux = sched(sched.init(p0, o0), batch)
    state, aux = sched(state, batch)
    assert np.isfinite(float(aux["loss"]))
