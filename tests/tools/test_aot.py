"""Ahead of time: every strategy compiled for GPU and TPU clusters without the hardware.

The structure checked here is the compiled, scheduled program's (jaxsched.check._inspection), not a
lowering: which collectives XLA kept async and what compute it put in their windows.
Without the `aot` extra these tests skip, naming it; `make test` installs it.
"""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsched
import jaxsched.tools.aot
from jaxsched.zoo import models
from jaxsched.demo import steps
from jaxsched.runtime.collectives import Collective
from support.equivalence import assert_trees_close
from support.toolchains import needs_gpu, needs_tpu


LAYERS = 4
WIDTH = 512


def _experiment(target: str, layers: int = LAYERS, width: int = WIDTH, per_device: int = 128):
    """A plain MLP step over the compile-only mesh of ``target``, all inputs abstract."""
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    from jaxsched.demo.config import OptimizerConfig

    spec = ModelSpec(
        "mlp",
        (width,),
        10,
        {"hidden": (width,) * layers},
        per_device,
        OptimizerConfig(name="momentum", learning_rate=0.1),
    )
    return abstract_experiment(spec, target=target)


def _per_layer(exp):
    from jaxsched.core._bucketing import param_paths

    paths = param_paths(exp.params)
    return [[p for p in paths if p.startswith(f"hidden/{i}/")] for i in range(LAYERS)] + [
        [p for p in paths if p.startswith("head/")]
    ]


def _inspect(exp, strategy, **options):
    sched = jaxsched.schedule(exp.step, strategy=strategy, **options)
    state = sched.init(exp.params, exp.opt_state)
    return sched.inspect(state, exp.batch)


def _gradient_windows(report, kind, min_bytes):
    return [w for w in report.collectives if w.kind == kind and w.bytes >= min_bytes]


# -- devices and abstract state ------------------------------------------------------------
def test_unknown_target_and_bad_topology_say_what_to_write():
    with pytest.raises(jaxsched.tools.aot.AotUnavailableError, match="unknown target 'k80'"):
        jaxsched.tools.aot.devices("k80", "1x1x1")
    with pytest.raises(ValueError, match="SLICESxHOSTSxGPUS"):
        jaxsched.tools.aot.devices("h100", "8")
    with pytest.raises(ValueError, match="slices=N"):
        jaxsched.tools.aot.parse_target("v5p:2x2x2:three")


def test_a_missing_toolchain_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    reason = jaxsched.tools.aot.toolchain_missing("tpu")
    assert "jaxsched[aot]" in reason and "libtpu" in reason
    jaxsched.tools.aot._tpu_devices.cache_clear()
    with pytest.raises(jaxsched.tools.aot.AotUnavailableError, match=r"jaxsched\[aot\]"):
        jaxsched.tools.aot.devices("v5p", "2x2x2")


@needs_gpu
@pytest.mark.parametrize(
    "strategy",
    ["wfbp", "approx", pytest.param("allreduce", marks=pytest.mark.slow), pytest.param("dear", marks=pytest.mark.slow)],
)
def test_init_and_lower_are_abstract_on_compile_only_devices(strategy):
    exp = _experiment("h100:1x2x4")
    sched = jaxsched.schedule(exp.step, strategy=strategy)
    state = sched.init(exp.params, exp.opt_state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    lowered = sched.lower(state, exp.batch)
    assert "stablehlo" in lowered.as_text()
    assert "HloModule" in lowered.compile().as_text()
    with pytest.raises(TypeError, match="abstract"):
        sched(state, exp.batch)


@needs_gpu
def test_devices_are_cached_and_describe_the_cluster():
    a = jaxsched.tools.aot.devices("h100", "1x2x4")
    assert a == jaxsched.tools.aot.devices("h100", "1x2x4") and len(a) == 8
    assert {d.process_index for d in a} == {0, 1} and a[0].platform == "gpu"
    from jaxsched.check._inspection import describe_mesh

    assert describe_mesh(Mesh(np.array(a), ("data",))) == "gpu: 8 x NVIDIA H100 80GB HBM3 over 2 hosts"


# -- compiled structure on GPU (XLA:GPU, H100, 2 hosts x 4) --------------------------------
@needs_gpu
def test_allreduce_is_the_users_step_as_xla_compiles_it_alone():
    inspection = _inspect(_experiment("h100:1x2x4"), "allreduce")
    report, plain = inspection.report, inspection.baseline
    assert [(w.kind, w.bytes, w.is_async) for w in report.collectives] == [
        (w.kind, w.bytes, w.is_async) for w in plain.collectives
    ]
    assert report.step_s == pytest.approx(plain.step_s)


@needs_gpu
def test_wfbp_all_reduces_are_async_with_backward_compute_inside_on_gpu():
    exp = _experiment("h100:1x2x4")
    report = _inspect(exp, "wfbp", buckets=_per_layer(exp)).report
    layer_bytes = WIDTH * WIDTH * 4
    grads = _gradient_windows(report, "all-reduce", layer_bytes)
    assert len(grads) >= LAYERS - 1, report.collectives  # the buckets stay separate
    assert all(w.is_async for w in grads)
    # every bucket but the first layer's (whose gradient is backward's last) overlaps a matmul
    assert sum(1 for w in grads if w.compute_flops > 0) >= LAYERS - 2


@needs_gpu
def test_gpu_combiners_merge_collectives_up_to_the_bucket_size_and_no_further():
    """The engine caps XLA:GPU's combiners at the plan's bucket size: the tensors of one
    bucket travel as one collective, separate buckets stay separate."""
    exp = _experiment("h100:1x2x4")
    total = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(exp.params))
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4
    for threshold, buckets in [(None, 1), (2 * layer_bytes + 1, 3), (layer_bytes + 1, LAYERS + 1)]:
        sched = jaxsched.schedule(exp.step, strategy="wfbp", buckets=threshold)
        report = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=False).report
        grads = [w for w in report.collectives if w.kind == "all-reduce" and w.bytes > 64]
        # every gradient once (plus at most the loss's scalars, combined into a bucket)
        assert total <= sum(w.bytes for w in grads) <= total + 64, report.collectives
        cap = threshold or jaxsched.core._bucketing.DEFAULT_BUCKET_BYTES
        assert all(w.bytes <= cap for w in grads), (threshold, report.collectives)
        assert len(sched.program.buckets) == buckets
        assert len(grads) == buckets, (threshold, report.collectives)


@needs_gpu
@pytest.mark.parametrize("strategy", ["wfbp", "approx"])
def test_default_buckets_are_not_estimated_slower_than_the_plain_step_on_a_multi_host_gpu_mesh(strategy):
    """Each tensor its own collective (combiners off) made a many-leaf step several times
    slower on 8 hosts x 8 GPUs; capped combiners keep it near or below the plain step.
    (dear pays two collectives' latency where the plain step pays one: on a model this
    small it is slower, and ``buckets="auto"`` / ``strategy="auto"`` see that.)"""
    exp = _experiment("h100:1x8x8", layers=8, width=256, per_device=64)
    inspection = _inspect(exp, strategy)
    assert inspection.report.step_s <= 1.05 * inspection.baseline.step_s, (
        inspection.report.step_s,
        inspection.baseline.step_s,
    )


@needs_gpu
def test_dear_reduce_scatters_in_backward_and_all_gathers_in_forward_are_async_on_gpu():
    exp = _experiment("h100:1x2x4")
    report = _inspect(exp, "dear", buckets=_per_layer(exp)).report
    scatters = [w for w in report.collectives if w.kind == "reduce-scatter"]
    gathers = [w for w in report.collectives if w.kind == "all-gather"]
    assert scatters and gathers
    assert any(w.is_async and w.compute_flops > 0 for w in scatters)
    assert any(w.is_async and w.compute_flops > 0 for w in gathers)
    assert not any(w.kind == "all-reduce" and w.bytes >= WIDTH * WIDTH * 4 for w in report.collectives)


@needs_gpu
def test_approx_reduction_spans_forward_and_backward_on_gpu():
    """And without a conditional: XLA:GPU would read its predicate on the host every step."""
    exp = _experiment("h100:1x2x4")
    sched = jaxsched.schedule(exp.step, strategy="approx", collective=Collective(forms={"all_reduce": "packed"}))
    state = sched.init(exp.params, exp.opt_state)
    report = sched.inspect(state, exp.batch, baseline=False).report
    grads = _gradient_windows(report, "all-reduce", LAYERS * WIDTH * WIDTH * 4)
    assert len(grads) == 1 and grads[0].is_async
    # forward and backward of every hidden layer: 3 matmuls each, 2 * rows * W^2 flops
    rows = 128
    assert grads[0].compute_flops >= 0.5 * 3 * 2 * rows * WIDTH * WIDTH * LAYERS
    assert " conditional(" not in sched.lower(state, exp.batch).compile().as_text()


@needs_gpu
@pytest.mark.slow
def test_auto_is_never_estimated_slower_than_the_plain_step_on_gpu():
    exp = _experiment("h100:1x2x4", layers=2)
    sched = jaxsched.schedule(exp.step, strategy="auto")
    inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch)
    choice = sched.strategy.last_choice
    assert choice.estimated_s["allreduce, buckets=None"] == pytest.approx(inspection.baseline.step_s)
    assert min(choice.estimated_s.values()) == pytest.approx(inspection.report.step_s)
    assert inspection.report.step_s <= inspection.baseline.step_s


@needs_tpu
@pytest.mark.slow
def test_auto_on_one_tpu_slice_judges_every_candidate_by_the_same_estimate():
    """XLA:TPU writes no schedule for the plain step on one slice: every candidate is then
    judged by XLA's instruction costs, the plain step among them, and the choice is the
    smallest of those."""
    exp = _experiment("v5p:2x2x2", layers=2)
    sched = jaxsched.schedule(exp.step, strategy="auto")
    sched.init(exp.params, exp.opt_state)
    sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=False)
    choice = sched.strategy.last_choice
    estimates = choice.estimated_s
    assert estimates and all(v is not None for v in estimates.values()), estimates
    assert "allreduce, buckets=None" in estimates
    best = min(estimates, key=estimates.get)
    assert choice.chosen == best.split(",")[0]


def test_compiled_planner_candidates_per_platform():
    """GPU: the engine's options, packed, XLA's defaults, each at 25 MB and in one bucket;
    TPU: the engine's options and XLA's defaults (bucket size changes nothing per tensor),
    and on a mesh of several slices also the devices' own DCN reduction."""
    from types import SimpleNamespace

    from jaxsched.pipeline._compiled_planner import DEVICE_DCN_REDUCTION, ONE_BUCKET, candidates_for
    from jaxsched.strategies import make_strategy

    def described(platform, mesh=None):
        return sorted(
            (
                dict(v.collective.forms).get("all_reduce", "engine"),
                v.compiler_defaults,
                bool(v.compiler_overrides),
                b or 0,
            )
            for v, b in candidates_for(make_strategy("approx"), platform, "auto", mesh=mesh)
        )

    assert described("gpu") == sorted(
        (form, defaults, False, b)
        for form, defaults in [("engine", False), ("packed", False), ("engine", True)]
        for b in (0, ONE_BUCKET)
    )
    one_slice = SimpleNamespace(devices=np.array([SimpleNamespace(slice_index=0)] * 8))
    two_slices = SimpleNamespace(devices=np.array([SimpleNamespace(slice_index=i // 8) for i in range(16)]))
    assert described("tpu") == described("tpu", one_slice) == [("engine", False, False, 0), ("engine", True, False, 0)]
    assert described("tpu", two_slices) == [
        ("engine", False, False, 0),
        ("engine", False, True, 0),
        ("engine", True, False, 0),
    ]
    # the plain step twice: as XLA compiles it alone, and under the engine's options
    plain = candidates_for(make_strategy("allreduce"), "gpu", "auto")
    assert [v.compiler_defaults for v, _ in plain] == [True, False]
    assert make_strategy("allreduce").compiler_defaults  # the variant is a copy
    variant = [
        v for v, _ in candidates_for(make_strategy("approx"), "tpu", "auto", mesh=two_slices) if v.compiler_overrides
    ]
    assert variant[0].compiler_overrides == DEVICE_DCN_REDUCTION
    assert make_strategy("approx").compiler_overrides == {}  # the variant is a copy
    identity = make_strategy("allreduce")  # the user's step: no collective to vary, only its options
    assert [v.compiler_defaults for v, _ in candidates_for(identity, "tpu", "auto", mesh=two_slices)] == [True, False]


# -- TPU (XLA:TPU, v5p 2x2x2) ---------------------------------------------------------------
@needs_tpu
def test_wfbp_per_tensor_all_reduces_are_async_collective_fusions_on_tpu():
    exp = _experiment("v5p:2x2x2")
    inspection = _inspect(exp, "wfbp", buckets=_per_layer(exp))
    grads = _gradient_windows(inspection.report, "all-reduce", WIDTH * WIDTH * 4)
    # every one, also those XLA's scheduler placed beside another layer's elementwise update
    # (synchronous without the engine's fuse_kloop_fusions: 2 of the 4)
    assert len(grads) == LAYERS and all(w.is_async and w.compute_ops > 0 for w in grads), grads
    # XLA's defaults: every gradient in one synchronous all-reduce after backward
    plain = _gradient_windows(inspection.baseline, "all-reduce", WIDTH * WIDTH * 4)
    assert plain and not any(w.is_async for w in plain)


def _compiled_collectives(text: str) -> list[tuple[str, int]]:
    """``(kind, elements of the result)`` of every reduce-scatter and all-reduce in compiled
    HLO text (fusion bodies included; tuple-shaped all-reduces count each element)."""
    found = []
    for match in re.finditer(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter)(?:-start)?\(", text):
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match.group(1)):
            found.append((match.group(2), int(np.prod([int(d) for d in dims.split(",") if d]))))
    return found


@needs_tpu
def test_dear_keeps_its_reduce_scatters_on_a_3d_tpu_slice():
    """XLA:TPU turns one reduce-scatter over every chip of a 3-D slice (v5p 2x2x2) into an
    all-reduce of the whole gradient; dear sends each one in two stages, an exchange of
    halves over a line of two chips (an async collective-permute) and a reduce-scatter over
    a plane (jaxsched.runtime.collectives._torus), which it keeps."""
    width, layers = 1024, 8
    exp = _experiment("v5p:2x2x2", layers=layers, width=width, per_device=512)
    sched = jaxsched.schedule(exp.step, strategy="dear")
    state = sched.init(exp.params, exp.opt_state)
    text = sched.lower(state, exp.batch).compile().as_text()
    ops = _compiled_collectives(text)
    full = width * width
    assert not [n for kind, n in ops if kind == "all-reduce" and n >= full // 8], ops  # no whole gradient
    shards = [n for kind, n in ops if kind == "reduce-scatter" and n == full // 8]
    assert len(shards) >= layers - 1, ops  # every hidden layer's weight ends in its own 1/8
    assert len(re.findall(r"collective-permute-start\(", text)) >= layers - 1  # the line stage
    report = sched.inspect(state, exp.batch, baseline=False).report
    assert {"reduce-scatter", "all-gather"} <= {w.kind for w in report.collectives}


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize("strategy,at_least", [("dear", 1), ("approx", LAYERS)])
def test_dear_and_approx_collectives_are_async_on_tpu(strategy, at_least):
    """dear: a deferred all-gather overlaps compute; its reduce-scatters over a plane of
    chips (the second stage on a 3-D slice) run synchronously: libtpu 0.0.42.1 fuses no reduce-scatter into
    an async collective fusion, whatever the options (the whole-gradient all-reduces it
    made of them before were async). approx: every weight's reduction is async, fused with
    compute (XLA's scheduler places most beside elementwise updates, which the engine's
    fuse_kloop_fusions lets them fuse with; without it 3 of the 4 were synchronous)."""
    exp = _experiment("v5p:2x2x2")
    report = _inspect(exp, strategy, buckets=_per_layer(exp)).report
    big = [w for w in report.collectives if w.bytes >= WIDTH * WIDTH * 4 // 8]
    assert sum(1 for w in big if w.is_async and w.compute_ops > 0) >= at_least, report.collectives


@needs_tpu
@pytest.mark.slow
def test_two_slices_compile_and_report_cross_slice_traffic():
    exp = _experiment("v5p:2x2x2:slices=2", layers=2)
    report = _inspect(exp, "wfbp").report
    assert exp.mesh.devices.size == 16
    assert report.collectives and report.step_s is not None


@needs_tpu
@pytest.mark.slow
def test_the_device_dcn_reduction_variant_keeps_cross_slice_sums_off_the_hosts():
    """The variant's option reaches the compiled program: without it XLA:TPU has the hosts'
    megascale runtime sum the cross-slice shares; with it the hosts only move them and the
    devices sum."""
    from jaxsched.pipeline._compiled_planner import DEVICE_DCN_REDUCTION

    exp = _experiment("v5p:2x2x2:slices=2", layers=2)
    texts = {}
    for name, overrides in (("engine", {}), ("device", DEVICE_DCN_REDUCTION)):
        sched = jaxsched.schedule(exp.step, strategy="wfbp")
        sched.strategy.compiler_overrides = dict(overrides)
        lowered = sched.lower(sched.init(exp.params, exp.opt_state), exp.batch)
        texts[name] = lowered.compile().as_text()
    host_sum = '_xla_megascale_transfer_type="ALL_REDUCE"'
    assert host_sum in texts["engine"]
    assert host_sum not in texts["device"] and "_xla_megascale_transfer_type" in texts["device"]


# -- the new collective forms are exact on CPU --------------------------------------------
@pytest.mark.parametrize(
    "strategy,form",
    [
        ("wfbp", "per_tensor"),
        ("dear", "per_tensor"),
        pytest.param("wfbp", "packed", marks=pytest.mark.slow),
        pytest.param("approx", "packed", marks=pytest.mark.slow),
    ],
)
def test_collective_forms_give_the_plain_steps_numbers(strategy, form):
    from support.equivalence import run_both

    forms = {"all_reduce": form, "reduce_scatter": form, "all_gather": form}
    options = {"staleness": 0} if strategy == "approx" else {}
    plain, scheduled, plain_aux, sched_aux, _ = run_both(
        "mlp", optax.adam(1e-2), strategy, devices=4, n_steps=6, collective=Collective(forms=forms), **options
    )
    assert_trees_close(plain, scheduled)
    np.testing.assert_allclose([a["loss"] for a in sched_aux], [a["loss"] for a in plain_aux], rtol=1e-5)


def test_collective_forms_are_validated():
    with pytest.raises(ValueError, match="'all_sum' is not an operation"):
        Collective(forms={"all_sum": "packed"})
    with pytest.raises(ValueError, match="choose from mixed, per_tensor, packed"):
        Collective(forms={"all_reduce": "flat"})


# -- the command line ------------------------------------------------------------------------
@needs_gpu
@pytest.mark.slow
def test_inspect_command_writes_json_and_png(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxsched",
            "inspect",
            "--config",
            "configs/tiny_lm.toml",
            "--target",
            "h100:1x2x4",
            "--strategies",
            "allreduce,wfbp",
            "--json",
            str(out),
            "--png",
            str(png),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    data = json.loads(out.read_text())
    assert data["baseline"]["label"] == "plain (XLA defaults)"
    assert set(data["strategies"]) == {"allreduce", "wfbp"}
    assert "not measured" in data["estimator"] and png.stat().st_size > 10_000
    assert "plain (XLA defaults)" in proc.stdout


_TPU_INSPECT = """
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxsched.tools.aot
from jaxsched.check import _inspection as inspection

mesh = Mesh(np.array(jaxsched.tools.aot.devices("v5p", "2x2x1")), ("data",))
x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
report = inspection.inspect_jitted(lambda x: (x * 2).sum(), (x,), mesh)
print(report.platform, "TPU_WORKER_HOSTNAMES" in os.environ)
"""


@needs_tpu
def test_compiling_for_a_tpu_target_logs_no_worker_hostname_error_and_leaves_the_environment():
    """libtpu, off a Cloud TPU VM, logs an ``E0000 ... TPU_WORKER_HOSTNAMES`` error when it
    starts unless told its workers: the compile-only devices tell it, for that start only."""
    env = {k: v for k, v in os.environ.items() if k != "TPU_WORKER_HOSTNAMES"}
    proc = subprocess.run([sys.executable, "-c", _TPU_INSPECT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["tpu", "False"]
    assert "TPU_WORKER_HOSTNAMES" not in proc.stderr and "E0000" not in proc.stderr, proc.stderr[-2000:]


def test_inspect_command_rejects_a_bad_target_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxsched", "inspect", "--model", "mlp", "--target", "h100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "TARGET:TOPOLOGY" in proc.stderr and "Traceback" not in proc.stderr


@needs_gpu
def test_nnx_steps_lower_and_inspect_ahead_of_time():
    from flax import nnx

    from jaxsched.tools.aot._experiment import mesh_for
    import jaxsched.integrations.nnx

    mesh = mesh_for("h100:1x2x4")
    build = lambda: models.MLP(64, 10, hidden=(64,), rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build)
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(build(), optax.adam(1e-3), wrt=nnx.Param))

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
    def train_step(model, optimizer, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: steps.cross_entropy(m(x), y))(model)
        optimizer.update(model, jax.lax.pmean(grads, "data"))
        return jax.lax.pmean(loss, "data")

    sharded = NamedSharding(mesh, P("data"))
    batch = (
        jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=sharded),
        jax.ShapeDtypeStruct((16,), jnp.int32, sharding=sharded),
    )
    sched = jaxsched.integrations.nnx.schedule(train_step, strategy="dear")
    assert "reduce-scatter" in sched.lower(model, optimizer, batch).compile().as_text()
    inspection = sched.inspect(model, optimizer, batch)
    assert {w.kind for w in inspection.report.collectives} >= {"reduce-scatter", "all-gather"}
    assert inspection.baseline.label == "plain (XLA defaults)"
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))
