"""FSDP layer stacks as MaxText writes them (jaxsched.zoo.stacked_lm): every schedule equals the
plain jit step, each layer's gradient is reduce-scattered in its own layer, a scanned stack is
double-buffered (the next layer gathered during the current one), and, compiled for GPU
clusters (XLA's estimates), the gathers overlap compute within the memory bound."""

import re

import jax
import numpy as np
import optax
import pytest

import jaxsched
from jaxsched.core._replay import nested_eqns
from jaxsched.zoo import stacked_lm
from support.toolchains import needs_gpu, needs_tpu

SMALL = dict(dim=32, mlp=64, layers=2, heads=2, vocab=64, seq=8)


def _mesh(shape=(8,), names=("fsdp",)):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def _copy(tree):
    return jax.tree.map(lambda a: a.copy(), tree)


@pytest.mark.parametrize(
    "scan, strategy, mesh_shape",
    [
        (True, "wfbp", (8,)),
        (False, "dear", (2, 4)),
        pytest.param(True, "dear", (2, 4), marks=pytest.mark.slow),
        pytest.param(False, "wfbp", (8,), marks=pytest.mark.slow),
        pytest.param(True, "allreduce", (8,), marks=pytest.mark.slow),
    ],
)
def test_a_stacked_fsdp_transformer_equals_the_plain_step(scan, strategy, mesh_shape):
    mesh = _mesh(mesh_shape, ("data", "fsdp")[-len(mesh_shape) :])
    config = stacked_lm.StackedLM(**SMALL, scan=scan, remat=True)
    tx = optax.sgd(0.05, momentum=0.9)  # linear in the gradient: rounding stays rounding
    step = stacked_lm.make_step(config, tx, mesh)
    params = stacked_lm.init(config, mesh, seed=1)
    batches = [stacked_lm.synthetic_batch(config, mesh, rows=16, seed=k) for k in range(3)]
    plain = (_copy(params), tx.init(params))
    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(_copy(params), tx.init(params))
    for b in batches:
        *plain, plain_aux = step(*plain, b)
        state, aux = sched(state, b)
        np.testing.assert_allclose(float(aux["loss"]), float(plain_aux["loss"]), rtol=1e-5)
    got = sched.finalize(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tuple(plain))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("scan", [True, False])
def test_each_layers_gradient_is_reduce_scattered_in_its_own_layer(scan):
    """In the scan's body when the stack is scanned, beside each layer's backward when it is
    unrolled; never one reduce-scatter of the whole stack after backward."""
    mesh = _mesh()
    config = stacked_lm.StackedLM(**SMALL, scan=scan, remat=True)
    tx = optax.sgd(0.1)
    params = stacked_lm.init(config, mesh)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy="wfbp")
    sched(sched.init(params, tx.init(params)), stacked_lm.synthetic_batch(config, mesh, rows=16))
    body = sched.program.captured.body
    stacked = (config.layers, config.dim // 8, config.mlp)  # the block of the stacked w1
    if scan:
        loops = [e for e in body.eqns if e.primitive.name == "scan"]
        inside = [e for loop in loops for e in nested_eqns(loop.params["jaxpr"].jaxpr)]
        assert sum(e.primitive.name == "reduce_scatter" for e in inside) >= 4  # a layer's matrices
    else:
        scatters = [e for e in body.eqns if e.primitive.name == "reduce_scatter"]
        assert len(scatters) >= 4 * config.layers
    assert not any(
        e.primitive.name == "reduce_scatter" and tuple(e.outvars[0].aval.shape) == stacked for e in body.eqns
    )


def test_an_unrolled_layers_gradient_is_reduce_scattered_without_its_stack_dimension():
    """An unrolled layer's weight gradient is a ``[1, rows, cols]`` slice of the stacked one;
    it is sent as ``[rows, cols]``. With the unit dimension XLA:TPU computed the gradient's
    matmul into a ``[1, rows, cols]`` fusion, which it priced at 1.6x the plain step's
    (benchmarks/fsdp_compiled.py: the unrolled two-slice ``wfbp`` step 47.0 ms, 39.8 without)."""
    mesh = _mesh()
    config = stacked_lm.StackedLM(**SMALL, scan=False, remat=True)
    tx = optax.sgd(0.1)
    params = stacked_lm.init(config, mesh)
    batch = stacked_lm.synthetic_batch(config, mesh, rows=16)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy="wfbp")
    state, _ = sched(sched.init(params, tx.init(params)), batch)
    program = sched.program
    jaxpr = program.per_device.jaxpr(*program.inputs(state, batch))
    scatters = [e for e in nested_eqns(jaxpr) if e.primitive.name == "reduce_scatter"]
    shapes = [tuple(e.invars[0].aval.shape) for e in scatters]
    assert (config.dim, config.mlp) in shapes and (config.mlp, config.dim) in shapes, shapes  # w1, w2
    assert not [s for s in shapes if 1 in s], shapes


@pytest.mark.parametrize("scan", [True, False])
def test_no_per_device_value_spans_the_global_batch(scan):
    """A causal mask broadcast to the batch's shape, built outside the layer and read inside
    its rematerialised body (or a scan's loop-invariant operand), is computed as the device's
    rows: a per-device program holding a global-batch tensor would cost memory that FSDP is
    there to save."""
    mesh = _mesh()
    config = stacked_lm.StackedLM(**SMALL, scan=scan, remat=True)
    tx = optax.sgd(0.1)
    params = stacked_lm.init(config, mesh)
    rows = 24  # 3 per device: no other dimension of the model has this size
    batch = stacked_lm.synthetic_batch(config, mesh, rows=rows)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy="wfbp")
    lowered = sched.lower(sched.init(params, tx.init(params)), batch).as_text()
    inputs = {f"tensor<{rows}x{config.seq}xi32>"}  # the step's own global-batch arguments
    whole = set(re.findall(rf"tensor<{rows}x[0-9x]*\w+>", lowered)) - inputs
    assert not whole, whole


def _compiled(target: str, scan: bool, strategy: str):
    import jaxsched.tools.aot as aot
    from jax.sharding import Mesh

    name, topology, _ = aot.parse_target(target)
    mesh = Mesh(np.array(aot.devices(name, topology)), ("fsdp",))
    config = stacked_lm.StackedLM(dim=512, mlp=2048, layers=6, heads=8, vocab=4096, seq=256, scan=scan, remat=True)
    tx = optax.adamw(1e-4)
    params, opt_state, batch = stacked_lm.abstract(config, mesh, tx, rows_per_device=4)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy=strategy)
    return config, sched.inspect(sched.init(params, opt_state), batch)


@needs_gpu
@pytest.mark.parametrize("scan", [True, False])
def test_compiled_gathers_overlap_compute_within_the_memory_bound(scan):
    config, inspection = _compiled("h100:1x2x4", scan, "wfbp")
    report, plain = inspection.report, inspection.baseline
    layer = config.layer_bytes
    if scan:  # each iteration gathers the next layer while it computes with the current one
        loops = [loop for loop in report.loops if loop.trips >= config.layers - 2]
        assert len(loops) == 2  # forward, and backward's recomputation and transposes
        for loop in loops:
            # distance one: the next layer gathered in the body, the current one carried
            assert 0.9 * layer <= loop.peak_gathered_bytes <= layer
            assert loop.exposed_s <= 0.2 * loop.seconds
    else:  # unrolled: every layer's gathers are in the entry's schedule, each under compute
        gathers = [w for w in report.collectives if w.kind == "all-gather" and w.bytes >= layer // 8]
        assert len(gathers) >= config.layers
        assert sum(w.is_async and (w.compute_s or 0) > 0 for w in gathers) >= config.layers - 1
        assert report.peak_gathered_bytes <= plain.peak_gathered_bytes
    # memory: no more than the plain step's plus one prefetched layer (unrolled, where XLA's
    # scheduler places every gather and buffer, within 5% of a layer more)
    assert report.peak_memory_bytes <= plain.peak_memory_bytes + layer * (1.0 if scan else 1.05)
    assert report.step_s <= plain.step_s
    # scanned, XLA alone hides none of a layer's gathers; unrolled, it hides some itself
    assert report.exposed_comm_s <= (0.5 if scan else 0.7) * plain.exposed_comm_s


@needs_tpu
def test_a_scanned_layers_prefetched_gathers_all_run_async_on_tpu():
    """XLA:TPU runs a collective async only inside an async collective fusion with compute.
    With the engine's TPU options every gather the forward loop prefetches for the next layer
    is one; with ``xla_max_concurrent_async_all_gathers=4`` three of them ran synchronously
    in every iteration."""
    import jaxsched.tools.aot as aot
    from jax.sharding import Mesh

    from jaxsched.check._hlo_text import _parse_hlo

    name, topology, _ = aot.parse_target("v5p:2x2x2")
    mesh = Mesh(np.array(aot.devices(name, topology)), ("fsdp",))
    config = stacked_lm.StackedLM(dim=512, mlp=2048, layers=4, heads=8, vocab=4096, seq=256, scan=True, remat=True)
    tx = optax.adamw(1e-4)
    params, opt_state, batch = stacked_lm.abstract(config, mesh, tx, rows_per_device=4)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy="wfbp")
    mod = _parse_hlo(sched.lower(sched.init(params, opt_state), batch).compile().as_text())

    def gathers(body: str) -> tuple[int, int]:
        """(synchronous, async-fused) all-gathers of a loop body."""
        found = [
            (i.opcode, {o.opcode for c in i.calls() for o in mod.computations.get(c, [])})
            for i in mod.computations[body]
        ]
        return sum(op == "all-gather" for op, _ in found), sum(
            "all-gather" in inner for op, inner in found if op != "all-gather"
        )

    bodies = [
        re.search(r"body=%?([\w.\-]+)", i.attrs).group(1)
        for c in mod.computations.values()
        for i in c
        if i.opcode == "while"
    ]
    counts = [gathers(b) for b in bodies]
    assert (0, 4) in [(sync, min(fused, 4)) for sync, fused in counts], counts  # forward: a layer's four matrices
