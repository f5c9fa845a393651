"""One strategy table: ``jaxsched.STRATEGIES``. The simulator accepts each of its strategies
(or says where each one is simulated instead), plus the baselines it models."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxsched
from jaxsched import sim
from jaxsched.sim import _costmodel as costmodel
from jaxsched.sim._zoo_profiles import zoo_profile


def test_every_strategy_is_simulated_or_sent_where_it_is():
    layers = zoo_profile("resnet50", "v100")
    network = costmodel.network_preset("10gbe", 4)
    for name in jaxsched.STRATEGIES:
        if name in sim.SIMULATED:
            assert sim.simulate(layers, network, name).iteration_s > 0
            continue
        with pytest.raises(sim.SimulationError, match=name):
            sim.simulate(layers, network, name)
    assert {"allreduce", "wfbp", "dear", "approx", "kfac"} <= set(sim.SIMULATED)


def test_the_simulators_own_table_is_deprecated():
    with pytest.warns(DeprecationWarning, match="jaxsched.STRATEGIES"):
        names = sim.STRATEGIES
    assert list(names) == list(sim.SIMULATED)


def test_the_built_in_patterns_are_known_without_importing_the_strategies():
    code = (
        "import sys\n"
        "from jaxsched.sim._costmodel import comm_pattern_names\n"
        "assert 'jaxsched.strategies' not in sys.modules\n"
        "print(' '.join(sorted(comm_pattern_names())))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    known = set(out.stdout.split())
    assert set(jaxsched.STRATEGIES) - {"auto"} <= known
