"""Re-planning while training: exact across a switch, measured drift, agreement that fails loudly."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jaxsched
import jaxsched.runtime.compress  # noqa: F401  (attribute access below)
from jaxsched.demo import steps
from jaxsched.sim._costmodel import network_preset
from jaxsched.pipeline.replan import (
    Replan,
    ReplanAgreementError,
    agree,
    as_replan,
    bucket_groups,
    drift_between,
    fit_window,
    measured_network,
    plan_key,
    slowest,
    stage_samples,
    update_window,
)
from support.equivalence import assert_trees_close
from support.replan_model import bandwidth_bound, batches, latency_bound, layer_profile, leaves, optimizer, tanh_mlp

from support import SUPPORT_DIR  # noqa: E402

HERE = SUPPORT_DIR


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"every": 0}, "every"),
        ({"every": 2.5}, "every"),
        ({"drift": 0}, "drift"),
        ({"drift": float("nan")}, "drift"),
        ({"min_gain": 1.0}, "min_gain"),
        ({"min_gain": -0.1}, "min_gain"),
        ({"window": 0}, "window"),
        ({"probe_bytes": (4096,)}, "probe_bytes"),
        ({"probe_bytes": (8192, 4096)}, "probe_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"every": True}, "every"),
        ({"monitor": "psychic"}, "monitor"),
    ],
)
def test_replan_refuses_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=f"Replan\\({field}="):
        Replan(**kwargs)


def test_replan_option_forms():
    assert as_replan(None) is None
    assert as_replan("auto") == Replan()
    custom = Replan(every=7)
    assert as_replan(custom) is custom
    with pytest.raises(ValueError, match="replan='sometimes'"):
        as_replan("sometimes")


def _setup(devices: int = 8):
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    params, apply = tanh_mlp()
    tx = optimizer()
    return mesh, params, tx, steps.make_step(apply, tx, mesh)


def test_replan_none_changes_nothing():
    mesh, params, tx, step = _setup(2)
    sched = jaxsched.schedule(step, strategy="wfbp")
    assert sched.buckets_option is None and sched.replans == []
    state = sched.init(params, tx.init(params))
    state, _ = sched(state, steps.shard_batch(next(batches(1, 4)), mesh))
    with pytest.raises(ValueError, match="replan='auto'"):
        sched.replan(network="1gbe")


# -- exactness across a switch ---------------------------------------------------------------


def _plain(step, params, tx, mesh, n, size):
    state = (params, tx.init(params))
    for b in batches(n, size):
        p, o, _ = step(*state, steps.shard_batch(b, mesh))
        state = (p, o)
    return state


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_switch_at_step_10_is_exact_and_switching_back_reuses_the_program(strategy):
    mesh, params, tx, step = _setup(8)
    sched = jaxsched.schedule(
        step,
        strategy=strategy,
        replan=Replan(every=1000),
        layer_profile=layer_profile(),
        network_profile=latency_bound(8),
    )
    state = sched.init(params, tx.init(params))
    seen = []
    for n, b in enumerate(batches(30, 16)):
        if n == 10:
            pending = sched.replan(network=bandwidth_bound(8))
            assert pending is not None and pending.step == 10
            assert sched.replan(network=bandwidth_bound(8)) is not None  # idempotent until the switch
        if n == 20:
            assert sched.replan(network=latency_bound(8)) is not None
        state, aux = sched(state, steps.shard_batch(b, mesh))
        jax.block_until_ready(aux)
        seen.append(tuple(tuple(bk.params) for bk in sched.program.buckets))
    assert seen[9] != seen[10], "the forced switch did not change the buckets"
    assert seen[:10] == [seen[0]] * 10 and seen[10:20] == [seen[10]] * 10 and seen[20] == seen[0]
    assert len(seen[0]) < len(seen[10])  # latency-bound: fewer, larger buckets
    records = sched.replans
    assert [r.step for r in records] == [10, 20]
    assert [r.reused for r in records] == [False, True]
    assert plan_key(records[0].new_buckets) == plan_key(records[1].old_buckets)
    assert all(r.predicted_new_s < r.predicted_old_s for r in records)
    assert_trees_close(_plain(step, params, tx, mesh, 30, 16), sched.finalize(state))


def test_replan_refuses_a_collective_with_state_per_bucket():
    mesh, params, tx, step = _setup(2)
    sched = jaxsched.schedule(
        step,
        strategy="wfbp",
        replan="auto",
        layer_profile=layer_profile(),
        network_profile=latency_bound(2),
        compression=jaxsched.runtime.compress.TopK(0.5),
    )
    state = sched.init(params, tx.init(params))
    with pytest.raises(ValueError, match="carries state per bucket"):
        sched(state, steps.shard_batch(next(batches(1, 4)), mesh))


def test_replan_without_a_network_plans_for_the_measured_one():
    mesh, params, tx, step = _setup(2)
    sched = jaxsched.schedule(
        step,
        strategy="wfbp",
        replan=Replan(every=1000),
        layer_profile=layer_profile(),
        network_profile=latency_bound(2),
    )
    state = sched.init(params, tx.init(params))
    data = [steps.shard_batch(b, mesh) for b in batches(2, 4)]
    state, _ = sched(state, data[0])
    pending = sched.replan()  # probes now: far below the assumed 1 s per collective
    assert pending is not None and pending.network == "measured" and pending.reason == "requested"
    assert pending.alpha_beta["all_reduce"][0] < 0.1
    state, _ = sched(state, data[1])
    assert [r.step for r in sched.replans] == [1]
    assert plan_key(sched.replans[0].new_buckets) == plan_key(
        [[sched.program.planned.paths[i] for i in b.params] for b in sched.program.buckets]
    )


def test_replan_for_the_current_network_changes_nothing():
    mesh, params, tx, step = _setup(2)
    sched = jaxsched.schedule(
        step,
        strategy="wfbp",
        replan=Replan(every=1000),
        layer_profile=layer_profile(),
        network_profile=latency_bound(2),
    )
    state = sched.init(params, tx.init(params))
    state, _ = sched(state, steps.shard_batch(next(batches(1, 4)), mesh))
    assert sched.replan(network=latency_bound(2)) is None
    with pytest.raises(TypeError, match="NetworkProfile or a preset name"):
        sched.replan(network=3)


@pytest.mark.slow  # forty measured steps: make test-slow
def test_measured_drift_switches_at_a_decision_point():
    """Planned for a start-up cost of 1 s per collective; the probe measures this machine's
    (far smaller), so the first decision re-plans, and the result stays exact."""
    mesh, params, tx, step = _setup(8)
    options = Replan(every=4, drift=0.2, min_gain=0.0)
    sched = jaxsched.schedule(
        step, strategy="wfbp", replan=options, layer_profile=layer_profile(), network_profile=latency_bound(8)
    )
    state = sched.init(params, tx.init(params))
    for b in batches(10, 16):
        state, aux = sched(state, steps.shard_batch(b, mesh))
        jax.block_until_ready(aux)
    records = sched.replans
    assert records and records[0].reason == "measured" and records[0].step == 4
    alpha, beta = records[0].alpha_beta["all_reduce"]
    assert 0 <= alpha < 0.1 and beta > 0  # measured here, not the assumed 1 s
    assert records[0].drift > options.drift
    assert len(records[0].new_buckets) > len(records[0].old_buckets)
    decisions = sched.replan_decisions
    assert [d.step for d in decisions] == [4, 8] and decisions[0].switched
    assert decisions[0].drift == records[0].drift and decisions[0].seconds > 0
    assert decisions[0].predicted_gain == records[0].predicted_gain
    assert_trees_close(_plain(step, params, tx, mesh, 10, 16), sched.finalize(state))


# -- the estimate ----------------------------------------------------------------------------


def test_window_fit_and_drift():
    window = update_window({}, {"all_reduce": {1000: [1.1e-3, 5e-3], 9000: [1.9e-3, 2.5e-3]}}, 3, 0.2)
    cost = fit_window(window)["all_reduce"]  # the fastest timings: load only adds time
    assert cost.alpha_s == pytest.approx(1e-3) and cost.beta_s_per_byte == pytest.approx(1e-7)
    # one noisy size does not restart the window ...
    noisy = update_window(window, {"all_reduce": {1000: [1.1e-3], 9000: [4e-3]}}, 3, 0.2)
    assert noisy["all_reduce"][9000] == [1.9e-3, 4e-3]
    # ... a step change does: the estimate follows at once
    window = update_window(window, {"all_reduce": {1000: [1.9e-3] * 3, 9000: [9.1e-3] * 3}}, 3, 0.2)
    assert window["all_reduce"][9000] == [9.1e-3]
    slow = measured_network(network_preset("1gbe", 2), fit_window(window))
    assert slow.cost("all_reduce").beta_s_per_byte == pytest.approx(9e-7)
    assert drift_between(network_preset("1gbe", 2), slow, ["all_reduce"], 1e6) > 50
    assert bucket_groups([["l1/w"], ["l0/w", "l0/b"]], [[0, 1], [2]], ["l0/b", "l0/w", "l1/w"]) == [[0], [1]]


def test_stage_timings_become_samples():
    """The host engine's stage timings, as the monitor reads them: large collectives only,
    compared with the reference window by the ratio of their times."""
    from types import SimpleNamespace as NS
    from jaxsched.runtime.engine._host import StageTiming
    from jaxsched.pipeline.replan import scaled_network, window_ratio

    def eqn(prim, *shapes):
        return NS(primitive=NS(name=prim), invars=[NS(aval=NS(shape=s, dtype=np.float32)) for s in shapes])

    stages = [
        NS(kind="compute", eqns=[eqn("dot_general", (4, 4))]),
        NS(kind="comm", eqns=[eqn("psum", (100_000,))]),
        NS(kind="comm", eqns=[eqn("psum", (3,))]),  # a loss: not a bucket
        NS(kind="comm", eqns=[eqn("reshape", (10, 20_000)), eqn("reduce_scatter", (200_000,))]),
        NS(kind="comm", eqns=[eqn("psum", (50_000,))]),
    ]  # no time resolved: no sample
    timings = [
        StageTiming(s.kind, "", 0.0, start, end)
        for s, (start, end) in zip(stages, [(0, 1), (1.0, 1.5), (1.5, 1.6), (2.0, 2.25), (3.0, 3.0)])
    ]
    samples = stage_samples(stages, timings)
    assert samples == {"all_reduce": {400_000: [0.5]}, "reduce_scatter": {800_000: [0.25]}}
    slower = {"all_reduce": {400_000: [4.0, 6.0]}}
    assert window_ratio(samples, slower) == {"all_reduce": 10.0}
    basis = network_preset("1gbe", 2)
    net = scaled_network(basis, window_ratio(samples, slower))
    assert net.cost("all_reduce").beta_s_per_byte == pytest.approx(10 * basis.cost("all_reduce").beta_s_per_byte)
    assert net.cost("all_reduce").alpha_s == basis.cost("all_reduce").alpha_s


def test_stage_monitor_needs_the_host_engine():
    mesh, params, tx, step = _setup(2)
    sched = jaxsched.schedule(
        step,
        strategy="wfbp",
        replan=Replan(monitor="stages"),
        layer_profile=layer_profile(),
        network_profile=latency_bound(2),
    )
    state = sched.init(params, tx.init(params))
    with pytest.raises(ValueError, match="monitor='probe'"):
        sched(state, steps.shard_batch(next(batches(1, 4)), mesh))


# -- agreement -------------------------------------------------------------------------------


class DictStore:
    """The key-value store's interface, in memory; ``get`` times out like the real one."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key, timeout_s):
        deadline = time.monotonic() + timeout_s
        while key not in self.data:
            if time.monotonic() > deadline:
                raise TimeoutError(f"DEADLINE_EXCEEDED waiting for {key}")
            time.sleep(0.01)
        return self.data[key]


def _message(step, alpha=1e-4, beta=1e-8):
    return {"step": step, "kind": "measured", "plan": "abc", "costs": {"all_reduce": [alpha, beta]}}


def test_agreement_takes_the_slowest_process():
    store = DictStore()
    store.set("t/1/1", json.dumps({**_message(5, 2e-4, 5e-9), "round": 1, "process": 1}))
    got = agree(store, "t", 1, _message(5), 2, 0, 1.0)
    agreed = slowest([{n: tuple(v) for n, v in m["costs"].items()} for m in got])
    assert agreed["all_reduce"].alpha_s == 2e-4 and agreed["all_reduce"].beta_s_per_byte == 1e-8


def test_agreement_lost_message_is_a_clear_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(ReplanAgreementError, match="no re-planning message from process 1"):
        agree(DictStore(), "t", 1, _message(5), 2, 0, 0.5)
    assert time.monotonic() - start < 5


def test_agreement_corrupt_or_other_step_is_a_clear_error():
    store = DictStore()
    store.set("t/1/1", '{"step": 5, "rou')
    with pytest.raises(ReplanAgreementError, match="unreadable"):
        agree(store, "t", 1, _message(5), 2, 0, 0.5)
    store.set("t/2/1", json.dumps({**_message(4), "round": 2, "process": 1}))
    with pytest.raises(ReplanAgreementError, match="process 1 is at step 4"):
        agree(store, "t", 2, _message(5), 2, 0, 0.5)


# -- two processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, strategy: str, mode: str, timeout: float = 240):
    port, out = _free_port(), tmp_path / "result.npz"
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "JAX_PLATFORMS": "cpu",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "replan_worker.py"), str(port), str(r), str(out), strategy, mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    start = time.monotonic()
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0])
    finally:
        for p in procs:
            if p.poll() is None:  # a dead peer must not hang the suite
                p.kill()
    return procs, logs, out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_two_processes_switch_at_step_10_exactly(tmp_path, strategy):
    procs, logs, out = _two_processes(tmp_path, strategy, "switch")
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)[-4000:]
    got = np.load(out)
    before, after = got["counts"]
    assert after > before and list(got["steps"]) == [10]
    mesh, params, tx, step = _setup(2)
    expected = leaves(_plain(step, params, tx, mesh, 30, 8)[0])
    for k, leaf in enumerate(expected):
        np.testing.assert_allclose(got[f"arr_{k}"], leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_processes_on_the_host_engine_time_its_stages_and_stay_exact(tmp_path):
    """Each process with a spare device: the host engine runs the step, and the monitor
    reads its collective stages (no probe); a forced switch at step 10 stays exact."""
    procs, logs, out = _two_processes(tmp_path, "wfbp", "stages")
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)[-4000:]
    got = np.load(out)
    before, after = got["counts"]
    assert after > before and 10 in list(got["steps"])
    assert list(got["decisions"]) == [8, 16, 24]  # a decision every 8 steps, from stage timings
    mesh, params, tx, step = _setup(2)
    expected = leaves(_plain(step, params, tx, mesh, 30, 8)[0])
    for k, leaf in enumerate(expected):
        np.testing.assert_allclose(got[f"arr_{k}"], leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["lost", "corrupt"])
def test_two_processes_fail_loudly_when_the_agreement_message_is_lost(tmp_path, fault):
    start = time.monotonic()
    procs, logs, _ = _two_processes(tmp_path, "wfbp", fault, timeout=120)
    assert time.monotonic() - start < 110, "a process hung"
    for p, log in zip(procs, logs):
        assert p.returncode not in (0, None), log[-2000:]
        assert "ReplanAgreementError" in log, log[-2000:]


# -- changing the emulated cluster's links while it runs ---------------------------------------


def test_delay_parses():
    from jaxsched.tools.cluster import parse_delay

    assert parse_delay("5ms") == 0.005 and parse_delay(None) is None and parse_delay("none") is None
    with pytest.raises(ValueError, match="'5 parsecs'"):
        parse_delay("5 parsecs")


def _have_net_admin() -> bool:
    from jaxsched.tools import cluster

    return cluster._have_net_admin()


@pytest.mark.skipif(not _have_net_admin(), reason="network namespaces and tc need root")
def test_cluster_set_changes_the_links_of_a_running_cluster(capsys):
    from jaxsched.tools import cluster
    from jaxsched.tools.cli._cluster import run_cluster

    with cluster.Cluster.up(2, "1gbit", prefix="jxrt", subnet="10.197.1.0/24") as up:
        assert run_cluster(["set", "--bandwidth", "100mbit", "--prefix", "jxrt"]) == 0
        assert cluster.Cluster.attach("jxrt").bandwidth == 100_000_000
        assert "100mbit" in capsys.readouterr().out
        assert cluster.set_links("jxrt", "none").bandwidth is None
        assert cluster.Cluster.attach("jxrt").bandwidth is None
        assert run_cluster(["set", "--bandwidth", "fast", "--prefix", "jxrt"]) == 2
        assert up.hosts[1].address == "10.197.1.2"
    assert not cluster.list_namespaces("jxrt")
