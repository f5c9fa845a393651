"""The simulator's host-engine terms against a two-layer case computed by hand."""

from __future__ import annotations

from fractions import Fraction as F

import pytest

from jaxsched.sim._costmodel import CollectiveCost, Layer, LayerProfile, NetworkProfile
from jaxsched.sim import HostCosts, SimulationError, comm_slowdown_from_ceiling, simulate


def _case():
    # two layers: forward 1 s, backward 2 s, update 1/2 s each; 4 gradient bytes each, and an
    # all-reduce of 4 bytes takes 3 s
    layers = LayerProfile([Layer(f"l{i}", 1, 4, F(1), F(2), F(1, 2)) for i in range(2)])
    cost = CollectiveCost(F(0), F(3, 4))
    network = NetworkProfile(2, {"all_reduce": cost, "reduce_scatter": cost, "all_gather": cost})
    return layers, network


def test_host_terms_reproduce_a_hand_computed_two_layer_wfbp_step():
    layers, network = _case()
    host = HostCosts(stage_s=F(1), copy_s_per_byte=F(1, 4), comm_slowdown=F(2))
    result = simulate(layers, network, "wfbp", [[0], [1]], host=host)
    # By hand, one iteration from t = 0:
    #   fwd l0 [0, 1], fwd l1 [1, 2], bwd l1 [2, 4]
    #   to spare b1: stage 1 s + copy 4 B * 1/4 s = 2 s   [4, 6]
    #   all_reduce b1 [6, 9]
    #   bwd l0 starts at 6 under the collective: 2 s of work at half speed until 9 (1.5 done),
    #     the last 0.5 at full speed                    [6, 9.5]
    #   to spare b0 [9.5, 11.5], all_reduce b0 [11.5, 14.5]
    #   from spare b1 (1 s of copy) under all_reduce b0, at half speed   [11.5, 13.5]
    #   from spare b0 after all_reduce b0 [14.5, 15.5], update (1 s) [15.5, 16.5]
    assert result.iteration_s == F(33, 2)
    first = {s.name: (s.start, s.end) for s in result.spans if s.iteration == 0}
    assert first["bwd l0"] == (6, F(19, 2))
    assert first["to spare b1"] == (4, 6) and first["to spare b0"] == (F(19, 2), F(23, 2))
    assert first["all_reduce b1"] == (6, 9) and first["all_reduce b0"] == (F(23, 2), F(29, 2))
    assert first["from spare b1"] == (F(23, 2), F(27, 2)) and first["from spare b0"] == (F(29, 2), F(31, 2))
    assert first["update"] == (F(31, 2), F(33, 2))
    assert result.options["host"]["stage_s"] == 1


def test_no_host_terms_change_nothing():
    layers, network = _case()
    for strategy in ("allreduce", "wfbp", "dear", "approx"):
        plain = simulate(layers, network, strategy)
        assert simulate(layers, network, strategy, host=HostCosts()).iteration_s == plain.iteration_s
    # without the terms: fwd 2 + bwd l1 2, all_reduce b1 [4, 7] under bwd l0 [4, 6],
    # all_reduce b0 [7, 10], update [10, 11]
    assert simulate(layers, network, "wfbp", [[0], [1]]).iteration_s == 11


def test_each_host_term_only_slows_a_strategy_down():
    layers, network = _case()
    for strategy in ("allreduce", "wfbp", "dear", "approx"):
        base = simulate(layers, network, strategy).iteration_s
        for host in (HostCosts(stage_s=F(1, 2)), HostCosts(copy_s_per_byte=F(1, 8)), HostCosts(comm_slowdown=F(3, 2))):
            assert simulate(layers, network, strategy, host=host).iteration_s >= base, (strategy, host)


def test_slowdown_from_a_measured_ceiling():
    assert comm_slowdown_from_ceiling(0.3, 0.3, 0.3) == 1.0  # at the bound: nothing lost
    assert comm_slowdown_from_ceiling(0.2, 0.3, 0.25) == 1.0
    assert comm_slowdown_from_ceiling(0.3, 0.3, 0.6) == 100.0  # nothing overlapped
    # compute 0.2, comm 0.3, ceiling 0.4: 0.1 s of compute was done during the 0.3 s collective
    assert comm_slowdown_from_ceiling(0.2, 0.3, 0.4) == pytest.approx(3.0)
    with pytest.raises(SimulationError, match="comm_slowdown=0.5 must be >= 1"):
        HostCosts(comm_slowdown=0.5)
