"""The fragment schedule of Streaming DiLoCo, on host integers alone."""

from __future__ import annotations

import pytest

from jaxsched.strategies._diloco import DiLoCo
from jaxsched.strategies._diloco_fragments import FragmentSchedule


@pytest.mark.parametrize("inner_steps,fragments,tau", [(8, 4, 0), (8, 4, 1), (10, 2, 3), (6, 1, 2), (12, 3, 2)])
def test_each_fragment_sends_once_per_cycle_and_arrives_tau_steps_later(inner_steps, fragments, tau):
    schedule = FragmentSchedule(inner_steps, fragments, tau)
    cycle = range(inner_steps + 1, 2 * inner_steps + 1)  # one full cycle of steps taken
    sends = [schedule.fragment_at(s) for s in cycle]
    assert sorted(p for p in sends if p is not None) == list(range(fragments))
    for step in range(3 * inner_steps):
        sender, arriver = schedule.phase_key(step)
        assert sender == (schedule.fragment_at(step) if tau >= 1 else None)
        assert arriver == schedule.fragment_at(step + 1 - tau)
        if arriver is not None and tau >= 1:  # sent tau programs before it arrives
            assert schedule.phase_key(step - tau + 1)[0] == arriver


def test_the_fragment_in_flight_is_the_last_sent_within_tau():
    schedule = FragmentSchedule(inner_steps=12, fragments=3, overlap_steps=2)
    assert schedule.offsets == (4, 8, 0)
    assert [schedule.in_flight_after(t) for t in (4, 5, 6, 9, 13)] == [None, 0, None, 1, 2]
    assert FragmentSchedule(12, 3, 1).in_flight_after(5) is None  # tau = 1: sent and applied in one program


def test_the_strategy_runs_its_schedule():
    strategy = DiLoCo(inner_steps=8, fragments=4, overlap_steps=1)
    assert strategy.schedule == FragmentSchedule(8, 4, 1)
    assert [strategy.phase_key(s) for s in range(10)] == [strategy.schedule.phase_key(s) for s in range(10)]
