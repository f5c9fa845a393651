"""Simulator: closed forms, lower bound, determinism, timelines."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest

from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
from jaxsched.sim import SIMULATED, Compression, SimulationError, allreduce_time, lower_bound, simulate, wfbp_time
from jaxsched.sim._timeline import chrome_trace, save_gantt_png
from support.profiles import random_layers, random_network


def _random_buckets(rng: random.Random, num: int) -> list[list[int]]:
    buckets, current = [], [0]
    for i in range(1, num):
        if rng.random() < 0.4:
            buckets.append(current)
            current = []
        current.append(i)
    return buckets + [current]


@pytest.mark.parametrize("seed", range(40))
def test_allreduce_and_wfbp_match_closed_forms_exactly(seed):
    rng = random.Random(seed)
    layers = random_layers(rng, rng.randint(1, 20), exact=True)
    net = random_network(rng, exact=True)
    buckets = _random_buckets(rng, len(layers))
    assert simulate(layers, net, "allreduce").iteration_s == allreduce_time(layers, net)
    assert simulate(layers, net, "allreduce", buckets).iteration_s == allreduce_time(layers, net, buckets)
    assert simulate(layers, net, "wfbp").iteration_s == wfbp_time(layers, net)
    assert simulate(layers, net, "wfbp", buckets).iteration_s == wfbp_time(layers, net, buckets)


@pytest.mark.parametrize("seed", range(10))
def test_closed_forms_hold_in_floats(seed):
    rng = random.Random(100 + seed)
    layers, net = random_layers(rng, rng.randint(1, 60)), random_network(rng)
    assert math.isclose(simulate(layers, net, "wfbp").iteration_s, wfbp_time(layers, net), rel_tol=1e-12)
    assert math.isclose(simulate(layers, net, "allreduce").iteration_s, allreduce_time(layers, net), rel_tol=1e-12)


def test_wfbp_closed_form_by_hand():
    # Two layers, forward 1 each, backward 2 each, all-reduce 3 each (alpha=3, beta=0).
    # Backward: layer1 ready at F+2=4, layer0 at 6. Comm: [4,7], [7,10]. Update 1 -> 11.
    layers = LayerProfile([Layer("a", 1, 4, 1, 2, 0), Layer("b", 1, 4, 1, 2, 1)])
    net = random_network(random.Random(0), exact=True)
    net = type(net)(2, {k: type(v)(3, 0) for k, v in net.collectives.items()})
    assert simulate(layers, net, "wfbp").iteration_s == 11
    assert simulate(layers, net, "allreduce").iteration_s == 1 + 1 + 2 + 2 + 3 + 1


@pytest.mark.parametrize("seed", range(25))
def test_no_strategy_beats_the_lower_bound(seed):
    rng = random.Random(200 + seed)
    layers, net = random_layers(rng, rng.randint(1, 15), exact=True), random_network(rng, exact=True)
    buckets = _random_buckets(rng, len(layers))
    for strategy in SIMULATED:
        result = simulate(
            layers,
            net,
            strategy,
            buckets if strategy != "allreduce" else None,
            partition_bytes=rng.choice([1 << 16, 1 << 20, 1 << 24]),
        )
        assert result.iteration_s >= result.bound_s, strategy
        assert result.compute_busy_s >= result.compute_min_s
        assert result.comm_busy_s >= result.comm_min_s, strategy
    compression = Compression(
        rng.choice(["topk", "gtopk"]),
        rng.choice([Fraction(1, 1000), Fraction(1, 100), Fraction(1, 2)]),
        selection_s_per_byte=Fraction(1, 10**11),
    )
    for strategy in ("allreduce", "wfbp", "approx"):
        result = simulate(layers, net, strategy, compression=compression)
        assert result.iteration_s >= result.bound_s


def test_overlap_strategies_beat_allreduce_when_comm_and_compute_are_balanced():
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 2e-3, 4e-3) for i in range(20)])
    net = network_preset("10gbe", 16)
    base = simulate(layers, net, "allreduce").iteration_s
    for strategy in ("wfbp", "bytescheduler", "dear", "approx"):
        assert simulate(layers, net, strategy).iteration_s < base, strategy
    # approx overlaps the whole next iteration: with comm < compute it reaches the bound.
    approx = simulate(layers, net, "approx", [list(range(20))])
    assert math.isclose(approx.iteration_s, max(approx.compute_busy_s, approx.comm_busy_s))


def test_results_are_deterministic():
    rng = random.Random(7)
    layers, net = random_layers(rng, 30), random_network(rng)
    for strategy in SIMULATED:
        first, second = simulate(layers, net, strategy), simulate(layers, net, strategy)
        assert first.iteration_s == second.iteration_s
        assert first.spans == second.spans


def test_gaps_and_idle_are_consistent():
    rng = random.Random(3)
    layers, net = random_layers(rng, 12, exact=True), random_network(rng, exact=True)
    result = simulate(layers, net, "wfbp")
    assert result.compute_idle_s == sum(b - a for a, b in result.gaps)
    assert result.compute_idle_s == result.iteration_s - result.compute_busy_s


def test_bad_inputs_name_the_problem():
    layers = LayerProfile([Layer("a", 1, 4, 1e-3, 1e-3)] * 3)
    net = network_preset("10gbe", 4)
    with pytest.raises(SimulationError, match="strategy 'nope'"):
        simulate(layers, net, "nope")
    with pytest.raises(SimulationError, match="contiguous"):
        simulate(layers, net, "wfbp", [[0, 2], [1]])
    with pytest.raises(SimulationError, match="dear"):
        simulate(layers, net, "dear", compression=Compression("topk", 0.01))


def test_compression_cuts_communication():
    layers = LayerProfile([Layer(f"l{i}", 10**7, 4 * 10**7, 1e-3, 2e-3) for i in range(5)])
    net = network_preset("1gbe", 32)
    dense = simulate(layers, net, "wfbp")
    for kind in ("topk", "gtopk"):
        sparse = simulate(layers, net, "wfbp", compression=Compression(kind, 0.001))
        assert sparse.comm_busy_s < dense.comm_busy_s / 10
    # gTop-k's log P rounds beat top-k's all-gather of P * k elements at 32 workers.
    assert (
        simulate(layers, net, "wfbp", compression=Compression("gtopk", 0.01)).comm_busy_s
        < simulate(layers, net, "wfbp", compression=Compression("topk", 0.01)).comm_busy_s
    )


def test_lower_bound_uses_cheapest_collective():
    layers = LayerProfile([Layer("a", 10**6, 4 * 10**6, 1e-3, 1e-3, 8e-3)])
    net = network_preset("100gbib", 8)
    bound, compute_min, comm_min = lower_bound(layers, net)
    assert compute_min == pytest.approx(2e-3 + 8e-3 / 8)
    assert comm_min == pytest.approx(
        min(net.time("all_reduce", 4e6), net.time("reduce_scatter", 4e6) + net.time("all_gather", 4e6))
    )
    assert bound == max(compute_min, comm_min)


def test_chrome_trace_is_valid_and_png_is_written(tmp_path):
    rng = random.Random(5)
    layers, net = random_layers(rng, 6), random_network(rng)
    results = [simulate(layers, net, s) for s in ("allreduce", "dear")]
    trace = json.loads(json.dumps(chrome_trace(results)))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(r.spans) for r in results)
    for event in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(event)
        assert event["dur"] >= 0 and event["ts"] >= 0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"allreduce", "dear"}
    png = tmp_path / "gantt.png"
    save_gantt_png(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


from hypothesis import given, settings, strategies as st  # noqa: E402

_times = st.fractions(min_value=0, max_value=10, max_denominator=1000)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(_times, _times, _times, st.integers(0, 10**8)), min_size=1, max_size=8),
    st.fractions(min_value=0, max_value=1, max_denominator=1000),
    st.fractions(min_value=0, max_value=Fraction(1, 10**6), max_denominator=10**9),
    st.integers(1, 64),
    st.sampled_from(SIMULATED),
)
def test_bound_and_closed_forms_hold_for_any_profile(rows, alpha, beta, workers, strategy):
    from jaxsched.sim._costmodel import CollectiveCost, NetworkProfile

    layers = LayerProfile([Layer(f"l{i}", b // 4, b, f, bw, u) for i, (f, bw, u, b) in enumerate(rows)])
    net = NetworkProfile(
        workers, {k: CollectiveCost(alpha, beta) for k in ("all_reduce", "reduce_scatter", "all_gather", "ppermute")}
    )
    result = simulate(layers, net, strategy, partition_bytes=1 << 22)
    assert result.iteration_s >= result.bound_s
    if strategy == "wfbp":
        assert result.iteration_s == wfbp_time(layers, net)
    if strategy == "allreduce":
        assert result.iteration_s == allreduce_time(layers, net)


@pytest.mark.parametrize("seed", range(10))
def test_shared_stream_serialises_everything(seed):
    # XLA:CPU runs collectives inline: a step costs all its compute plus all its collectives.
    rng = random.Random(300 + seed)
    layers, net = random_layers(rng, rng.randint(1, 12), exact=True), random_network(rng, exact=True)
    buckets = _random_buckets(rng, len(layers))
    shared = simulate(layers, net, "wfbp", buckets, shared_stream=True)
    assert shared.iteration_s == allreduce_time(layers, net, buckets)
    for strategy in SIMULATED:
        both = simulate(layers, net, strategy, buckets if strategy != "bytescheduler" else None)
        one = simulate(layers, net, strategy, buckets if strategy != "bytescheduler" else None, shared_stream=True)
        assert one.iteration_s >= both.iteration_s
        assert one.iteration_s == one.compute_busy_s and one.comm_busy_s == 0


@pytest.mark.parametrize("seed", range(6))
def test_dispatch_cost_is_added_exactly_once_per_iteration(seed):
    import dataclasses

    rng = random.Random(500 + seed)
    layers, net = random_layers(rng, rng.randint(1, 10), exact=True), random_network(rng, exact=True)
    buckets = _random_buckets(rng, len(layers))
    dispatch = Fraction(rng.randint(1, 50), 10_000)
    with_dispatch = dataclasses.replace(net, dispatch_s=dispatch)
    for strategy in ("allreduce", "wfbp", "mgwfbp", "dear", "approx"):
        plain = simulate(layers, net, strategy, buckets, shared_stream=True)
        more = simulate(layers, with_dispatch, strategy, buckets, shared_stream=True)
        assert more.iteration_s - plain.iteration_s == dispatch
        launches = [s for s in more.spans if s.kind == "dispatch"]
        assert sorted(s.iteration for s in launches) == list(range(more.options["iterations"]))
        assert lower_bound(layers, with_dispatch)[1] == lower_bound(layers, net)[1] + dispatch
    # two streams: launching the step still delays the compute stream by exactly that much
    # when compute dominates (no collective waits)
    compute_bound = dataclasses.replace(net, collectives={k: type(c)(0, 0) for k, c in net.collectives.items()})
    assert (
        simulate(layers, dataclasses.replace(compute_bound, dispatch_s=dispatch), "wfbp").iteration_s
        - simulate(layers, compute_bound, "wfbp").iteration_s
    ) == dispatch


@pytest.mark.parametrize("seed", range(6))
def test_bucket_copies_cost_pack_and_unpack_of_every_bucketed_byte(seed):
    import dataclasses

    rng = random.Random(600 + seed)
    layers, net = random_layers(rng, rng.randint(1, 10), exact=True), random_network(rng, exact=True)
    buckets = _random_buckets(rng, len(layers))
    copy = Fraction(1, rng.randint(10**9, 10**10))
    with_copy = dataclasses.replace(net, copy_s_per_byte=copy)
    for strategy in ("wfbp", "mgwfbp", "dear"):
        plain = simulate(layers, net, strategy, buckets, shared_stream=True)
        more = simulate(layers, with_copy, strategy, buckets, shared_stream=True)
        assert more.iteration_s - plain.iteration_s == 2 * copy * layers.total_bytes
        kinds = [s.kind for s in more.spans if s.iteration == 4]
        assert kinds.count("pack") == kinds.count("unpack") == len(buckets)
    for strategy in ("allreduce", "approx"):  # no bucket buffers in these programs
        assert (
            simulate(layers, with_copy, strategy, buckets, shared_stream=True).iteration_s
            == simulate(layers, net, strategy, buckets, shared_stream=True).iteration_s
        )


# -- FSDP: per-layer gathers with a prefetch distance -----------------------------------------
def _fsdp(gathers_ahead):
    import dataclasses

    from jaxsched.sim._costmodel import FSDP_PATTERN

    return dataclasses.replace(FSDP_PATTERN, gathers_ahead=gathers_ahead)


@pytest.mark.parametrize("preset", ["1gbe", "10gbe", "100gbib"])
def test_fsdp_gathers_every_layer_twice_and_prefetching_hides_them(preset):
    """Each layer's parameters are gathered before its forward and before its backward, and
    each bucket's gradients reduce-scattered; gathering one layer ahead overlaps them with the
    layer before, so it is never slower than gathering on demand, and with compute per layer
    longer than a gather it hides them."""
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 4e-3, 8e-3) for i in range(6)])
    net = network_preset(preset, 8)
    on_demand = simulate(layers, net, _fsdp(0))
    ahead = simulate(layers, net, _fsdp(1))
    gathers = [s for s in ahead.spans if s.kind == "all_gather" and s.iteration == 3]
    assert len(gathers) == 2 * 6
    assert sum(s.kind == "reduce_scatter" and s.iteration == 3 for s in ahead.spans) == len(ahead.buckets)
    assert ahead.iteration_s <= on_demand.iteration_s + 1e-12
    gather_s = net.time("all_gather", 4 * 10**6)
    if gather_s < 4e-3:  # fits in a layer's forward: only the first gather of each pass shows
        assert ahead.iteration_s < on_demand.iteration_s
    assert ahead.iteration_s >= ahead.bound_s - 1e-12


def test_fsdp_keeps_at_most_the_prefetch_distance_plus_one_layers_gathered():
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(8)])
    net = network_preset("100gbib", 8)
    for ahead in (0, 1, 2):
        result = simulate(layers, net, _fsdp(ahead))
        forward = {s.name.split()[-1]: s for s in result.spans if s.iteration == 4 and s.kind == "forward"}
        gathers = [s for s in result.spans if s.iteration == 4 and s.name.startswith("gather fwd")]
        # a layer's gathered parameters live from its gather's start to its forward's end
        lives = [(g.start, forward[g.name.split()[-1]].end) for g in gathers]
        for t, _ in lives:
            assert sum(a <= t < b for a, b in lives) <= ahead + 1


def test_the_fsdp_pattern_is_a_strategy_the_simulator_and_the_planners_know():
    from jaxsched.plan import plan_buckets

    assert "fsdp" in SIMULATED
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(6)])
    groups = plan_buckets(layers, network_preset("10gbe", 8), "optimal", strategy=_fsdp(1))
    assert sorted(i for g in groups for i in g) == list(range(6))
