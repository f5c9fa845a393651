"""Every inspected report has an estimate, says where it comes from, and shows the XLA
options it was compiled with.

XLA:TPU writes no schedule for a single slice with its default options: the plain step is
then estimated from XLA's cost of each instruction (``estimated_cycles`` in the compiled
HLO). The options a scheduled program reports are the ones the ``xla`` engine passes, and
XLA's own dump of the compile shows them in effect."""

import dataclasses
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsched
from jaxsched.check import _inspection as ins
from jaxsched.runtime.engine._xla import XlaEngine
from support.toolchains import needs_gpu, needs_tpu

# the module header and the reducer every hand-made program below uses
HEADER = """
HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

# a hand-made TPU-like program: two costed fusions around a synchronous all-reduce
TPU_TEXT = (
    HEADER
    + """
%f1 (p: f32[256,256]) -> f32[256,256] {
  %p = f32[256,256]{1,0:T(8,128)} parameter(0)
  ROOT %t = f32[256,256]{1,0:T(8,128)} tanh(%p)
}

ENTRY %main (p: f32[256,256]) -> f32[256,256] {
  %p = f32[256,256]{1,0:T(8,128)} parameter(0)
  %c1 = f32[256,256]{1,0:T(8,128)} fusion(%p), kind=kLoop, calls=%f1, backend_config={"estimated_cycles":"3000"}
  %ar = f32[256,256]{1,0:T(8,128)} all-reduce(%c1), replica_groups=mesh['axis_0'=2,'axis_1'=1] {'axis_0'}, to_apply=%add
  ROOT %c2 = f32[256,256]{1,0:T(8,128)} fusion(%ar), kind=kLoop, calls=%f1, backend_config={"estimated_cycles":"1000"}
}
"""
)


STAGED_TEXT = (
    HEADER
    + """
%neg (q: f32[2048]) -> f32[2048] {
  %q = f32[2048]{0} parameter(0)
  ROOT %n = f32[2048]{0} negate(%q)
}

ENTRY %main (p: f32[2048]) -> f32[256] {
  %p = f32[2048]{0} parameter(0)
  %f = f32[2048]{0} fusion(%p), kind=kLoop, calls=%neg, backend_config={"estimated_cycles":"100"}
  %line = f32[1024]{0} reduce-scatter(%f), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%add
  ROOT %plane = f32[256]{0} reduce-scatter(%line), replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}, to_apply=%add
}
"""
)


def test_a_collective_over_part_of_its_axes_is_priced_at_its_own_traffic():
    """XLA:TPU's two-stage reduce-scatter over 8 chips: a line of 2, then 4. Over the whole
    axis, a ring reduce-scatter with result ``b`` moves 7b per device; the line moves 1 x
    4096 bytes and the plane 3 x 1024, so they are priced as results of 4096/7 and 3072/7."""
    priced = []

    def price(kind, nbytes, axes):
        priced.append((kind, nbytes, axes))
        return 1e-6

    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    r = ins.report(STAGED_TEXT, None, mesh, label="staged")
    assert [w.mesh_axes for w in r.collectives] == [("data",), ("data",)]
    ins.estimate_from_instruction_costs(r, STAGED_TEXT, mesh, cycles_per_us=1000.0, collective_seconds=price)
    assert priced == [("reduce-scatter", 4096 // 7, ("data",)), ("reduce-scatter", 3072 // 7, ("data",))]


def test_instruction_costs_add_up_serially_and_say_so():
    r = ins.report(TPU_TEXT, None, None, label="plain")
    assert r.step_s is None and r.estimate_source is None
    priced = []

    def price(kind, nbytes, axes):
        priced.append((kind, nbytes, axes))
        return 5e-6

    mesh = jax.sharding.AbstractMesh((2, 1), ("axis_0", "axis_1"))
    r = ins.report(TPU_TEXT, None, mesh, label="plain")
    assert r.collectives[0].mesh_axes == ("axis_0",)  # XLA:TPU's mesh-axes replica groups
    e = ins.estimate_from_instruction_costs(r, TPU_TEXT, mesh, cycles_per_us=1000.0, collective_seconds=price)
    assert priced == [("all-reduce", 256 * 256 * 4, ("axis_0",))]
    assert e.estimate_source == ins.ESTIMATE_FROM_INSTRUCTIONS
    assert e.step_s == pytest.approx(4e-6 + 5e-6)  # 4000 cycles at 1000 per us, then the all-reduce
    assert e.exposed_comm_s == pytest.approx(5e-6)
    assert e.no_estimate_reason is None
    table = ins.format_table([e])
    assert "estimated from XLA's instruction costs" in table and "step 9.0 us" in table
    assert "compiler options: XLA defaults" in table
    assert ins.CompiledReport.from_json(e.to_json()) == e


# the same program with a conditional between the two fusions: XLA:TPU costs the
# conditional at nothing, and its branches (here 2000 and 500 cycles) not at all
TPU_COND_TEXT = TPU_TEXT.replace(
    """ENTRY %main (p: f32[256,256]) -> f32[256,256] {""",
    """%heavy (q: f32[256,256]) -> f32[256,256] {
  %q = f32[256,256]{1,0:T(8,128)} parameter(0)
  ROOT %h = f32[256,256]{1,0:T(8,128)} fusion(%q), kind=kLoop, calls=%f1, backend_config={"estimated_cycles":"2000"}
}

%light (r: f32[256,256]) -> f32[256,256] {
  %r = f32[256,256]{1,0:T(8,128)} parameter(0)
  ROOT %l = f32[256,256]{1,0:T(8,128)} fusion(%r), kind=kLoop, calls=%f1, backend_config={"estimated_cycles":"500"}
}

ENTRY %main (p: f32[256,256]) -> f32[256,256] {
  %pred = pred[] constant(true)""",
).replace(
    """  ROOT %c2 = f32[256,256]{1,0:T(8,128)} fusion(%ar)""",
    """  %cond = f32[256,256]{1,0:T(8,128)} conditional(%pred, %ar, %ar), branch_computations={%heavy, %light}
  ROOT %c2 = f32[256,256]{1,0:T(8,128)} fusion(%cond)""",
)


def test_a_conditional_costs_its_costliest_branch():
    mesh = jax.sharding.AbstractMesh((2, 1), ("axis_0", "axis_1"))
    r = ins.report(TPU_COND_TEXT, None, mesh, label="plain")
    e = ins.estimate_from_instruction_costs(
        r, TPU_COND_TEXT, mesh, cycles_per_us=1000.0, collective_seconds=lambda *a: 5e-6
    )
    assert e.step_s == pytest.approx((3000 + 1000 + 2000) / 1000 * 1e-6 + 5e-6)
    # a branch that communicates cannot be priced: no estimate, as for a loop
    light = 'fusion(%r), kind=kLoop, calls=%f1, backend_config={"estimated_cycles":"500"}'
    reduce = "all-reduce(%r), replica_groups=mesh['axis_0'=2,'axis_1'=1] {'axis_0'}, to_apply=%add"
    assert light in TPU_COND_TEXT
    talking = TPU_COND_TEXT.replace(light, reduce)
    r = ins.report(talking, None, mesh, label="plain")
    assert (
        ins.estimate_from_instruction_costs(r, talking, mesh, cycles_per_us=1000.0, collective_seconds=lambda *a: 5e-6)
        is r
    )


def test_no_costs_no_estimate():
    r = ins.report(TPU_TEXT.replace("estimated_cycles", "other"), None, None, label="plain")
    e = ins.estimate_from_instruction_costs(
        r, TPU_TEXT.replace("estimated_cycles", "other"), None, cycles_per_us=1.0, collective_seconds=lambda *a: 1.0
    )
    assert e is r and e.step_s is None


def test_a_schedule_estimate_says_its_source_and_options_show():
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data" / "inspect"
    r = ins.report(
        (data / "handmade.hlo").read_text(),
        (data / "handmade.schedule.txt").read_text(),
        None,
        label="hand",
        compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True},
    )
    assert r.estimate_source == ins.ESTIMATE_FROM_SCHEDULE
    assert r.compiler_options == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert "compiler options: xla_gpu_enable_latency_hiding_scheduler=True" in ins.format_table([r])
    # a ratio against an estimate of the other kind says so
    base = dataclasses.replace(r, label="base", estimate_source=ins.ESTIMATE_FROM_INSTRUCTIONS, compiler_options={})
    assert "(1.00x against an estimate from instruction costs)" in ins.format_table([base, r], baseline=base)
    assert "against" not in ins.format_table([r], baseline=r)


def test_an_inspection_compares_the_scheduled_step_by_the_baselines_own_estimator():
    sched = ins.CompiledReport("wfbp", "v5p", "tpu", 6e-6, 2e-6, (), (), estimate_source=ins.ESTIMATE_FROM_SCHEDULE)
    by_costs = dataclasses.replace(
        sched,
        label="wfbp, by instruction costs",
        step_s=4e-6,
        exposed_comm_s=1e-6,
        estimate_source=ins.ESTIMATE_FROM_INSTRUCTIONS,
    )
    plain = dataclasses.replace(sched, label="plain", step_s=5e-6, estimate_source=ins.ESTIMATE_FROM_INSTRUCTIONS)
    inspection = ins.Inspection(sched, plain, by_costs)
    assert inspection.compared is by_costs
    assert inspection.ratios() == pytest.approx({"step": 0.8, "exposed_comm": 0.5})
    lines = inspection.table().splitlines()
    assert any(line.startswith("wfbp, by instruction costs [v5p, tpu]: step 4.0 us (0.80x)") for line in lines)
    assert any(line.startswith("wfbp [v5p, tpu]: step 6.0 us (1.20x against an estimate") for line in lines)
    # a baseline from a schedule, or no cost estimate of the scheduled step: the report itself
    scheduled_plain = dataclasses.replace(plain, estimate_source=ins.ESTIMATE_FROM_SCHEDULE)
    assert ins.Inspection(sched, scheduled_plain, by_costs).compared is sched
    assert ins.Inspection(sched, plain).ratios()["step"] == pytest.approx(1.2)


def _mlp_jit_step(mesh, layers=8, width=1024, rows_per_device=512):
    """An 8x1024 tanh MLP, sgd with momentum, as a jax.jit step on global arrays."""
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(params, x, y):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value}

    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = [jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=replicated) for _ in range(layers)]
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), jax.eval_shape(tx.init, params)
    )
    rows = rows_per_device * mesh.devices.size
    batch = tuple(jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=sharded) for _ in range(2))
    return step, params, opt_state, batch


def _dumped_options(sched, state, batch, tmp_path) -> set[str]:
    """What XLA recorded of the options of one compile of the scheduled program, as
    ``name: value`` lines (XLA:GPU's debug options, XLA:TPU's compilation environment)."""
    sched.lower(state, batch).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    files = glob.glob(os.path.join(tmp_path, "*.debug_options")) + glob.glob(
        os.path.join(tmp_path, "*tpu_comp_env.txt")
    )
    assert files, os.listdir(tmp_path)
    return {line.strip() for f in files for line in open(f)}


def _as_dumped(name, value) -> set[str]:
    """How XLA writes ``name=value`` in those dumps (a tri-state TPU flag set True: ENABLED)."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return {f"{name}: {text}"} | ({f"{name}: ENABLED"} if value is True else set())


@needs_tpu
def test_plain_step_on_one_v5p_slice_gets_an_estimate_from_instruction_costs(tmp_path):
    from jaxsched.tools import aot

    mesh = Mesh(np.array(aot.devices("v5p", "2x2x2")), ("data",))
    step, params, opt_state, batch = _mlp_jit_step(mesh)
    sched = jaxsched.schedule(step, strategy="wfbp")
    state = sched.init(params, opt_state)
    inspection = sched.inspect(state, batch)
    plain, report = inspection.baseline, inspection.report

    # XLA wrote no schedule for the plain step; its estimate comes from instruction costs
    assert plain.estimate_source == ins.ESTIMATE_FROM_INSTRUCTIONS
    assert plain.step_s is not None and 0 < plain.exposed_comm_s < plain.step_s
    assert plain.no_estimate_reason is None
    assert [(c.kind, c.mesh_axes, c.is_async) for c in plain.collectives] == [("all-reduce", ("data",), False)]
    assert plain.compiler_options == {}
    assert report.estimate_source == ins.ESTIMATE_FROM_SCHEDULE
    # the ratios set the scheduled step's own instruction-cost estimate against the plain
    # step's, not one estimator against another
    by_costs = inspection.report_by_instruction_costs
    assert by_costs is not None and by_costs.estimate_source == ins.ESTIMATE_FROM_INSTRUCTIONS
    assert by_costs.step_s != report.step_s and by_costs.compiler_options == report.compiler_options
    assert inspection.compared is by_costs
    ratios = inspection.ratios()
    assert ratios["step"] == pytest.approx(by_costs.step_s / plain.step_s)
    assert ratios["exposed_comm"] == pytest.approx(by_costs.exposed_comm_s / plain.exposed_comm_s)
    assert inspection.to_json()["report_by_instruction_costs"]["step_s"] == by_costs.step_s
    text = str(inspection)
    assert "estimated from XLA's instruction costs" in text
    assert "against an estimate from instruction costs" in text
    assert "compiler options: XLA defaults" in text

    # the scheduled program reports the options the engine passes, and XLA compiled with them
    program = sched.program
    expected = XlaEngine().options_for(program.per_device)
    assert expected and report.compiler_options == expected == program.compiler_options
    assert "compiler options: xla_enable_async_all_gather=True, xla_enable_async_all_reduce=True" in text
    dumped = _dumped_options(sched, state, batch, tmp_path)
    for name, value in expected.items():
        assert _as_dumped(name, value) & dumped, name


@needs_gpu
def test_gpu_program_reports_the_options_the_engine_passes(tmp_path):
    from jaxsched.tools import aot

    mesh = Mesh(np.array(aot.devices("h100", "1x2x4")), ("data",))
    step, params, opt_state, batch = _mlp_jit_step(mesh, layers=2, width=256, rows_per_device=32)
    sched = jaxsched.schedule(step, strategy="wfbp")
    state = sched.init(params, opt_state)
    inspection = sched.inspect(state, batch)
    expected = XlaEngine().options_for(sched.program.per_device)
    assert expected["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert inspection.report.compiler_options == expected
    assert inspection.baseline.compiler_options == {}
    assert inspection.report.estimate_source == inspection.baseline.estimate_source == ins.ESTIMATE_FROM_SCHEDULE
    assert "xla_gpu_enable_latency_hiding_scheduler=True" in str(inspection)
    # XLA's dump of the compile's debug options holds each of them
    dumped = _dumped_options(sched, state, batch, tmp_path)
    for name, value in expected.items():
        assert _as_dumped(name, value) & dumped, name
