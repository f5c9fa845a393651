"""jaxsched.check._inspection reads compiled (scheduled) HLO and XLA's latency-hiding schedule estimate.

Hand-written programs check the arithmetic exactly; real programs (H100 compile-only devices
in-process, committed TPU v5p output, a TPU compile in a subprocess) check that the parser
understands what the compilers actually write."""

import doctest
import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsched.check import _inspection as ins

DATA = Path(__file__).resolve().parents[1] / "data" / "inspect"
ROOT = Path(__file__).resolve().parents[2]


def _read(name: str) -> str:
    path = DATA / name
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


# ---------------------------------------------------------------------------------------
# (1) hand-made program and schedule with a known answer


def test_handmade_program_and_schedule_give_the_known_answer():
    r = ins.report(_read("handmade.hlo"), _read("handmade.schedule.txt"), None, label="hand", target="none")
    assert r.label == "hand" and r.target == "none"
    assert len(r.collectives) == 1
    w = r.collectives[0]
    assert w.name == "ar-start"
    assert w.kind == "all-reduce"
    assert w.bytes == 1024 * 4
    assert w.is_async
    assert w.compute_ops == 2  # compute_b (dot) and compute_c; not the bitcast, not A or D
    assert w.compute_flops == 2 * 64 * 32 * 128  # the dot; the tanh fusion has none
    # cycles_per_microsecond 2: start 10 cycles, done ends at 92, compute 40 + 10 cycles
    assert w.start_s == pytest.approx(5e-6, rel=1e-12)
    assert w.end_s == pytest.approx(46e-6, rel=1e-12)
    assert w.compute_s == pytest.approx(25e-6, rel=1e-12)
    # the schedule's own length (100 cycles) and the time the all-reduce (cycles 10..92) is
    # in flight while no compute runs (10..11 and 61..92: 32 cycles); XLA's own summary
    # statistics (total 200, wasted 30 cycles) are kept beside them
    assert r.step_s == pytest.approx(50e-6, rel=1e-12)
    assert r.exposed_comm_s == pytest.approx(16e-6, rel=1e-12)
    assert r.xla_total_s == pytest.approx(100e-6, rel=1e-12)
    assert r.xla_wasted_s == pytest.approx(15e-6, rel=1e-12)
    assert r.num_async == 1 and r.num_sync == 0
    assert [c[0] for c in r.compute] == ["compute_a", "compute_b", "compute_c", "compute_d"]
    name, s, e = r.compute[1]
    assert (s, e) == pytest.approx((5.5e-6, 25.5e-6), rel=1e-12)
    assert r.estimator == ins.ESTIMATOR and "not measured" in r.estimator


def test_a_collective_made_synchronous_after_scheduling_costs_its_own_time():
    """XLA:TPU schedules before forming its async collective fusions and runs a collective
    it could not fuse synchronously: the schedule's window (here 41 us, 25 of them beside
    compute) is what was planned, not what runs. The report charges its own time, to the
    step and to the exposed communication; without one, its whole window."""
    made_sync = _read("handmade.hlo").replace('"is_sync":false', '"is_sync":true')
    schedule = _read("handmade.schedule.txt")
    priced = ins.report(made_sync, schedule, None, label="made sync", collective_seconds=lambda k, b, a: 3e-6)
    assert not priced.collectives[0].is_async
    assert priced.exposed_comm_s == pytest.approx(3e-6, rel=1e-9)
    assert priced.step_s == pytest.approx(53e-6, rel=1e-9)  # the schedule's 50 us, then the all-reduce
    assert priced.made_sync_s == pytest.approx(3e-6, rel=1e-9)
    assert "of which 3.0 us: collectives XLA scheduled beside compute" in ins.format_table([priced])
    unpriced = ins.report(made_sync, schedule, None, label="made sync", collective_seconds=lambda k, b, a: None)
    assert unpriced.exposed_comm_s == pytest.approx(41e-6, rel=1e-9)
    assert unpriced.step_s == pytest.approx(50e-6, rel=1e-9)
    # run asynchronously as scheduled, nothing changes
    asynchronous = ins.report(_read("handmade.hlo"), schedule, None, label="a", collective_seconds=lambda k, b, a: 3e-6)
    assert (asynchronous.step_s, asynchronous.exposed_comm_s) == pytest.approx((50e-6, 16e-6), rel=1e-9)


LOOP_HLO = """HloModule loop, is_scheduled=true, num_partitions=4

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %c = (s32[], f32[1024]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

%fb_computation (pb: f32[1024]) -> f32[1024] {
  %pb = f32[1024]{0} parameter(0)
  ROOT %tb = f32[1024]{0} tanh(%pb)
}

%body (b: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %b = (s32[], f32[1024]{0}) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  %bx = f32[1024]{0} get-tuple-element(%b), index=1
  %ar = f32[1024]{0} all-reduce(%bx), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%sum, frontend_attributes={async_collective_name="all-reduce-start.1"}
  %fb = f32[1024]{0} fusion(%ar), kind=kLoop, calls=%fb_computation
  ROOT %bt = (s32[], f32[1024]{0}) tuple(%bi, %fb)
}

ENTRY %main (g: f32[1024]) -> f32[1024] {
  %g = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %g)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def _loop_schedule() -> str:
    """XLA:TPU's form: the body scheduled on its own (50 us, its all-reduce async beside the
    fusion), the loop 200 us in the entry's schedule, no trip count in the final program."""

    def instr(name, opcode, i, *operands):
        ops = "".join(f" operand_ids: {o}" for o in operands)
        return f'instructions {{ name: "{name}" opcode: "{opcode}" id: {i}{ops} }}'

    def timed(i, start, end):
        return f"instructions {{ id: {i} start_timestamp_cycles: {start} end_timestamp_cycles: {end} }}"

    entry = [
        instr("g", "parameter", 1),
        instr("init", "tuple", 2, 1),
        instr("w", "while", 3, 2),
        instr("out", "get-tuple-element", 4, 3),
    ]
    body = [instr("b", "parameter", 11), instr("ar-start", "all-reduce-start", 12, 11), instr("fb", "fusion", 13, 11)]
    body.append(instr("ar-done", "all-reduce-done", 14, 12))
    return (
        'hlo_module { name: "loop" entry_computation_name: "main" '
        f'computations {{ name: "main" {" ".join(entry)} id: 1 root_id: 4 }} '
        f'computations {{ name: "body" {" ".join(body)} id: 2 root_id: 14 }} '
        "entry_computation_id: 1 } "
        f"computation_schedules {{ computation_id: 1 {timed(1, 0, 0)} {timed(2, 0, 0)} {timed(3, 0, 400)} "
        f"{timed(4, 400, 400)} cycles_per_microsecond: 2 }} "
        f"computation_schedules {{ computation_id: 2 {timed(11, 0, 0)} {timed(12, 0, 1)} {timed(13, 1, 99)} "
        f"{timed(14, 99, 100)} cycles_per_microsecond: 2 }}"
    )


def test_a_loop_body_collective_made_synchronous_costs_its_own_time_every_iteration():
    """The body's all-reduce was scheduled async beside its fusion but runs synchronously
    (XLA:TPU marks it ``async_collective_name``); XLA prices the loop from the body's
    schedule (50 us a trip, 4 trips: 200 us). Each trip adds the all-reduce's own 3 us."""
    schedule = _loop_schedule()
    priced = ins.report(LOOP_HLO, schedule, None, label="loop", collective_seconds=lambda k, b, a: 3e-6)
    assert priced.step_s == pytest.approx(212e-6, rel=1e-9)
    assert priced.exposed_comm_s == pytest.approx(12e-6, rel=1e-9)
    assert priced.made_sync_s == pytest.approx(12e-6, rel=1e-9)
    kept_async = LOOP_HLO.replace(', frontend_attributes={async_collective_name="all-reduce-start.1"}', "")
    plain = ins.report(kept_async, schedule, None, label="loop", collective_seconds=lambda k, b, a: 3e-6)
    # kept async, the all-reduce exposes what the body's own schedule leaves uncovered (its
    # start and done, 1 us a trip), every iteration: the trips are read from the counter
    assert (plain.step_s, plain.exposed_comm_s) == pytest.approx((200e-6, 4e-6), abs=1e-12)
    assert [(loop.trips, loop.exposed_s) for loop in plain.loops] == [(4, pytest.approx(4e-6, abs=1e-12))]


def test_without_a_schedule_the_structure_is_reported_and_times_are_none():
    r = ins.report(_read("handmade.hlo"), None, None, label="hand")
    w = r.collectives[0]
    assert (w.compute_ops, w.compute_flops) == (2, 2 * 64 * 32 * 128)
    assert (w.start_s, w.end_s, w.compute_s, r.step_s, r.exposed_comm_s) == (None,) * 5
    assert r.compute == ()


def test_the_module_docstring_example_runs():
    result = doctest.testmod(ins, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------
# (2) synchronous collectives, tuple results, wrapped async forms

FORMS = """
HloModule forms, is_scheduled=true

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%rs_wrapped (w0: f32[1024,16]) -> f32[256,16] {
  %w0 = f32[1024,16]{1,0} parameter(0)
  ROOT %rs = f32[256,16]{1,0} reduce-scatter(%w0), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%sum
}

%mm (m0: bf16[32,64], m1: bf16[64,8]) -> bf16[32,8] {
  %m0 = bf16[32,64]{1,0} parameter(0)
  %m1 = bf16[64,8]{1,0} parameter(1)
  ROOT %dd = bf16[32,8]{1,0} dot(%m0, %m1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[100], b: bf16[8,8], c: f32[1024,16], m0: bf16[32,64], m1: bf16[64,8]) -> f32[4] {
  %a = f32[100]{0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %c = f32[1024,16]{1,0} parameter(2)
  %m0 = bf16[32,64]{1,0} parameter(3)
  %m1 = bf16[64,8]{1,0} parameter(4)
  %ar = (f32[100]{0}, bf16[8,8]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%sum
  %ars = f32[100]{0} all-reduce-start(%a), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%sum, backend_config={"collective_backend_config":{"is_sync":true}}
  %ard = f32[100]{0} all-reduce-done(%ars)
  %cps = ((f32[100]{0}, bf16[8,8]{1,0}), (f32[100]{0}, bf16[8,8]{1,0})) collective-permute-start(%a, %b), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %rss = ((f32[1024,16]{1,0}), f32[256,16]{1,0}) async-start(%c), calls=%rs_wrapped
  %mmf = bf16[32,8]{1,0} fusion(%m0, %m1), kind=kCustom, calls=%mm
  %scalar = f32[] constant(1)
  %rsd = f32[256,16]{1,0} async-done(%rss), calls=%rs_wrapped
  %cpd = (f32[100]{0}, bf16[8,8]{1,0}) collective-permute-done(%cps)
  %tok = token[] after-all()
  %snd = (f32[100]{0}, u32[], token[]) send(%a, %tok), channel_id=6
  %snd-done = token[] send-done(%snd), channel_id=6
  %ag = f32[400]{0} all-gather(%ard), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %r = f32[4]{0} slice(%ag), slice={[0:4]}
}
"""


def test_sync_collectives_tuples_and_wrapped_async_forms():
    r = ins.report(FORMS, None, None, label="forms")
    by = {c.name: c for c in r.collectives}
    assert list(by) == ["ar", "ars", "cps", "rss", "snd", "ag"]  # program order, one per pair
    assert by["ar"].kind == "all-reduce" and not by["ar"].is_async
    assert by["ar"].bytes == 100 * 4 + 8 * 8 * 2  # tuple: summed, bf16 counts 2 bytes
    assert by["ars"].kind == "all-reduce" and not by["ars"].is_async  # "is_sync":true
    assert by["ars"].compute_ops == 0
    assert by["cps"].kind == "collective-permute" and by["cps"].is_async
    assert by["cps"].bytes == 100 * 4 + 8 * 8 * 2  # the done's tuple, not the start's
    assert by["rss"].kind == "reduce-scatter" and by["rss"].is_async
    assert by["rss"].bytes == 256 * 16 * 4
    assert by["rss"].compute_ops == 1  # the dot fusion; not the scalar constant
    assert by["rss"].compute_flops == 2 * 32 * 8 * 64
    assert by["cps"].compute_ops == 1 and by["cps"].compute_flops == 2 * 32 * 8 * 64
    assert by["ag"].kind == "all-gather" and not by["ag"].is_async and by["ag"].bytes == 1600
    assert by["snd"].kind == "send" and by["snd"].is_async and by["snd"].bytes == 400
    assert (r.num_async, r.num_sync) == (3, 3)
    assert r.platform == "cpu"


# ---------------------------------------------------------------------------------------
# (3) mesh axes from replica groups


def test_replica_group_forms():
    assert ins._replica_groups("replica_groups={{0,4},{1,5}}, x=1") == [[0, 4], [1, 5]]
    assert ins._replica_groups("replica_groups=[2,4]<=[8], dimensions={0}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ins._replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ins._replica_groups("replica_groups={}, to_apply=%s") == []
    assert ins._replica_groups("source_target_pairs={{0,1},{1,0}}") == [[0, 1], [1, 0]]
    assert ins._replica_groups("to_apply=%s") is None


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("{{0,4},{1,5},{2,6},{3,7}}", ("a",)),
        ("[2,4]<=[8]", ("b",)),
        ("[4,2]<=[2,4]T(1,0)", ("a",)),
        ("{{0,1},{2,3},{4,5},{6,7}}", ("b",)),
        ("{{0,1,2,3,4,5,6,7}}", ("a", "b")),
        ("{}", ("a", "b")),
    ],
)
def test_mesh_axes_on_a_two_axis_mesh(groups, axes):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    text = FORMS.replace(
        "replica_groups={{0,1,2,3}}, to_apply=%sum\n  %ars", f"replica_groups={groups}, to_apply=%sum\n  %ars"
    )
    r = ins.report(text, None, mesh, label="m")
    assert r.collectives[0].mesh_axes == axes
    assert r.collectives[2].mesh_axes == ("b",)  # permute pairs 0->1->2->3->0 move along b


def test_replica_group_ids_are_positions_in_the_mesh_not_device_ids():
    """A real CPU compile on a mesh whose devices are permuted: XLA's replica groups are
    positions in mesh.devices.flat; reading them as device ids would give other groups."""
    devs = jax.devices()
    order = [3, 0, 6, 1, 7, 2, 5, 4]
    mesh = Mesh(np.array([devs[i] for i in order]).reshape(2, 4), ("a", "b"))

    def body(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))(w)
        return [lax.psum(g[0], "a"), lax.psum(g[1], "b")]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(("a", "b"))), out_specs=P(), check_vma=False))
    w = [jnp.ones((64, 64)), jnp.ones((64, 32))]
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(("a", "b"))))
    compiled, schedule = ins.compile_with_schedule(f.lower(w, x))
    assert schedule is None  # XLA:CPU writes no latency-hiding schedule
    text = compiled.as_text()
    assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}" in text
    r = ins.report(compiled, schedule, mesh, label="cpu", target="cpu:8")
    assert r.platform == "cpu"
    assert sorted(c.mesh_axes for c in r.collectives) == [("a",), ("b",)]
    assert all(not c.is_async and c.kind == "all-reduce" for c in r.collectives)
    assert sorted(c.bytes for c in r.collectives) == [64 * 32 * 4, 64 * 64 * 4]
    assert r.step_s is None and r.exposed_comm_s is None
    assert all(c.start_s is None for c in r.collectives)


# ---------------------------------------------------------------------------------------
# (4) real GPU compiles on compile-only H100 devices


def _h100_devices(topology: str = "1x2x4"):
    pytest.importorskip(
        "jax_plugins.xla_cuda12",
        reason="jax-cuda12-plugin is not installed (needed to compile for compile-only H100 devices)",
    )
    from jax.experimental import topologies

    # installed, the plugin must build the topology: a failure here is a failure
    return topologies.get_topology_desc(
        "h100", "cuda", target_config=(DATA / "h100.pbtxt").read_text(), topology=topology
    ).devices


def _mlp_step(mesh, layers: int, reduce):
    axes = tuple(mesh.axis_names)

    def body(w, x):
        def loss(w):
            h = x
            for wi in w:
                h = jnp.tanh(h @ wi)
            return jnp.sum(h**2)

        g = jax.grad(loss)(w)
        return [wi - 0.1 * gi for wi, gi in zip(w, reduce(g))]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(), check_vma=False))
    w = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P())) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((8 * 256, 1024), jnp.float32, sharding=NamedSharding(mesh, P(axes)))
    return f.trace(w, x).lower()


def test_h100_two_layer_step_with_per_leaf_psums():
    mesh = Mesh(np.array(_h100_devices()), ("data",))
    lowered = _mlp_step(mesh, 2, lambda g: [lax.psum(gi, "data") for gi in g])

    # XLA's defaults combine the two psums into one all-reduce that it runs synchronously
    compiled, schedule = ins.compile_with_schedule(lowered)
    assert schedule is not None and "scheduler_statistics" in schedule
    plain = ins.report(compiled, schedule, mesh, label="plain (XLA defaults)", target="h100:1x2x4")
    assert plain.platform == "gpu"
    assert sum(c.bytes for c in plain.collectives) == 2 * 1024 * 1024 * 4
    assert all(c.kind == "all-reduce" and c.mesh_axes == ("data",) for c in plain.collectives)
    assert 0 < plain.exposed_comm_s < plain.step_s

    # without combining, each gradient's all-reduce is async; the first overlaps backward
    compiled, schedule = ins.compile_with_schedule(lowered, {"xla_gpu_all_reduce_combine_threshold_bytes": 1})
    r = ins.report(compiled, schedule, mesh, label="per-leaf", target="h100:1x2x4")
    text = compiled.as_text()
    assert text.count("all-reduce-start(") == 2 and r.num_async == 2 and r.num_sync == 0
    assert [c.bytes for c in r.collectives] == [1024 * 1024 * 4] * 2
    first = r.collectives[0]
    assert first.compute_ops >= 1
    # the window holds the remaining backward matmuls: 256x1024 @ 1024x1024 = 2*256*2^20 flops each
    assert first.compute_flops > 0 and first.compute_flops % (2 * 256 * 1024 * 1024) == 0
    assert 0 < first.compute_s <= first.end_s - first.start_s
    assert all(c.start_s < c.end_s <= r.step_s for c in r.collectives)
    assert r.compute and all(s <= e for _, s, e in r.compute)
    table = ins.format_table([plain, r], baseline=plain)
    assert "1.00x" in table and "XLA" in table and "per-leaf" in table


def test_h100_two_axis_mesh_axes():
    mesh = Mesh(np.array(_h100_devices()).reshape(2, 4), ("a", "b"))
    lowered = _mlp_step(mesh, 2, lambda g: [lax.psum(g[0], "a"), lax.psum(g[1], "b")])
    compiled, schedule = ins.compile_with_schedule(lowered, {"xla_gpu_all_reduce_combine_threshold_bytes": 1})
    r = ins.report(compiled, schedule, mesh, label="2d")
    assert sorted(c.mesh_axes for c in r.collectives) == [("a",), ("b",)]


# ---------------------------------------------------------------------------------------
# TPU: committed compiler output (fast) and a real compile (slow)


def test_tpu_async_collective_fusion_all_reduce():
    r = ins.report(_read("v5p_ar.hlo.gz"), _read("v5p_ar.schedule.txt.gz"), None, label="v5p")
    assert r.platform == "tpu"
    assert [(c.name, c.kind, c.is_async) for c in r.collectives] == [
        ("async-collective-start", "all-reduce", True),
        ("async-collective-start.1", "all-reduce", True),
        ("all-reduce.26", "all-reduce", False),
    ]  # the last gradient's cannot overlap
    assert [c.bytes for c in r.collectives] == [1024 * 1024 * 4] * 3
    mm = 2 * 256 * 1024 * 1024  # one backward matmul per device
    assert [c.compute_ops for c in r.collectives] == [2, 1, 0]  # fused continuation fusions
    assert [c.compute_flops for c in r.collectives] == [2 * mm, 2 * mm, 0]
    # TPU schedules before fusing: all-reduce-start.2 / .1 are the fused pairs (kind, operand,
    # order); the sync one is named by its async_collective_name="all-reduce-start"
    cpu = 1750.0
    first, second, last = r.collectives
    assert first.start_s == pytest.approx(54801.300765189575 / cpu * 1e-6)
    assert first.end_s == pytest.approx(107221.74015101354 / cpu * 1e-6)
    assert first.compute_s == pytest.approx(
        (94432.878970109014 - 79649.017789204489 + 107220.74015101354 - 94432.878970109014) / cpu * 1e-6
    )
    assert second.start_s == pytest.approx(107221.74015101354 / cpu * 1e-6)
    assert last.start_s == pytest.approx(159642.1795368375 / cpu * 1e-6)
    assert last.compute_s == 0.0
    assert r.xla_total_s == pytest.approx(406143.7748557874 / cpu * 1e-6)
    assert r.xla_wasted_s == pytest.approx(157254.45226270845 / cpu * 1e-6)
    # the schedule's own times: it ends after the last collective, and the synchronous one
    # is exposed whole (nothing computes while it runs)
    assert r.step_s >= last.end_s
    assert last.end_s - last.start_s <= r.exposed_comm_s + 1e-12 <= r.step_s


def test_tpu_async_all_gather_fusions_and_sync_default():
    r = ins.report(_read("v5p_fsdp.hlo.gz"), _read("v5p_fsdp.schedule.txt.gz"), None, label="fsdp")
    kinds = [(c.kind, c.is_async, c.bytes) for c in r.collectives]
    ag = 1024 * 1024 * 2  # bf16 all-gathered weights
    assert kinds == [("all-gather", False, ag)] * 2 + [("all-gather", True, ag)] * 2 + [
        ("all-reduce", True, 1024 * 1024 * 4)
    ] * 3 + [("all-reduce", False, 1024 * 1024 * 4)]
    assert all(c.compute_ops >= 1 and c.compute_flops > 0 for c in r.collectives if c.is_async)
    assert all(c.start_s is not None and c.compute_s is not None for c in r.collectives)
    starts = [c.start_s for c in r.collectives if c.is_async]
    assert len(set(starts)) == len(starts)  # each fused pair got its own scheduled window

    d = ins.report(_read("v5p_default.hlo.gz"), None, None, label="default")
    assert [(c.kind, c.is_async, c.bytes) for c in d.collectives] == [("all-reduce", False, 3 * 1024 * 1024 * 4)]
    assert d.step_s is None


TPU_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_platforms", "cpu")
    from jax import lax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    from jaxsched.check import _inspection as ins
    devs = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2",
                                        chip_config_name="megachip_tccontrol").devices
    mesh = Mesh(np.array(devs), ("data",))
    def body(w, x):
        def loss(w):
            h = x
            for wi in w:
                h = jnp.tanh(h @ wi)
            return jnp.sum(h ** 2)
        g = [lax.psum(gi, "data") for gi in jax.grad(loss)(w)]
        return [wi - 0.1 * gi for wi, gi in zip(w, g)]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False))
    w = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P())) for _ in range(3)]
    x = jax.ShapeDtypeStruct((8 * 256, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    lowered = f.trace(w, x).lower()
    opts = {"xla_tpu_enable_async_collective_fusion": True,
            "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
            "xla_enable_async_all_reduce": True, "xla_jf_crs_combiner_threshold_in_bytes": 0}
    out = {}
    for label, o in (("async", opts), ("default", {})):
        compiled, schedule = ins.compile_with_schedule(lowered, o)
        out[label] = ins.report(compiled, schedule, mesh, label=label, target="v5p:2x2x2").to_json()
    print("JSON" + json.dumps(out))
""")


@pytest.mark.slow
def test_tpu_v5p_real_compile(tmp_path):
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is not installed")
    script = tmp_path / "tpu.py"
    script.write_text(TPU_SCRIPT)
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_ACCELERATOR_TYPE="v4-16")
    done = subprocess.run(
        [sys.executable, str(script), str(ROOT)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("JSON")][-1]
    out = {k: ins.CompiledReport.from_json(v) for k, v in json.loads(line[4:]).items()}
    a, d = out["async"], out["default"]
    assert a.platform == d.platform == "tpu"
    assert a.num_async == 2 and a.num_sync == 1
    assert all(c.kind == "all-reduce" and c.mesh_axes == ("data",) for c in a.collectives)
    assert all(c.compute_ops >= 1 and c.compute_flops > 0 and c.compute_s > 0 for c in a.collectives if c.is_async)
    assert 0 < a.exposed_comm_s < a.step_s
    assert d.step_s is None  # no schedule file with default options
    assert [(c.kind, c.is_async, c.bytes) for c in d.collectives] == [("all-reduce", False, 3 * 1024 * 1024 * 4)]


# ---------------------------------------------------------------------------------------
# (6) presenting


def _reports():
    a = ins.report(_read("v5p_ar.hlo.gz"), _read("v5p_ar.schedule.txt.gz"), None, label="async", target="v5p:2x2x2")
    h = ins.report(_read("handmade.hlo"), _read("handmade.schedule.txt"), None, label="hand")
    d = ins.report(_read("v5p_default.hlo.gz"), None, None, label="default")
    return a, h, d


def test_json_round_trip():
    for r in _reports():
        d = r.to_json()
        again = ins.CompiledReport.from_json(json.loads(json.dumps(d)))
        assert again == r
        assert d["estimator"] == ins.ESTIMATOR


def test_format_table_ratios_and_rows():
    a, h, d = _reports()
    table = ins.format_table([a, d], baseline=a)
    assert "XLA latency-hiding scheduler estimate" in table
    assert f"step {a.step_s * 1e6:.1f} us (1.00x)" in table
    assert f"[XLA statistics: total {a.xla_total_s * 1e6:.1f} us" in table
    assert "async 2/3 collectives" in table and "async 0/1 collectives" in table
    assert table.count("all-reduce ") == 4
    assert "async-collective-start.1" in table and "all-reduce.26" in table


def test_plot_writes_a_png(tmp_path):
    path = ins.plot(list(_reports()), str(tmp_path / "t.png"))
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_streams_put_overlapping_windows_on_separate_rows():
    def w(s, e):
        return ins.CollectiveWindow("x", "all-reduce", 1, (), True, 0, 0.0, s, e, 0.0)

    assert ins._streams([w(0, 10), w(5, 15), w(10, 20), w(12, 13)]) == [0, 1, 0, 2]
