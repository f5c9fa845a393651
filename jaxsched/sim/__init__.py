"""Iteration simulator: strategies, closed forms, timelines. See `jaxsched.sim.core`."""

from jaxsched.sim.closed_form import allreduce_time, wfbp_time
from jaxsched.sim.core import (
    COMPRESSIONS,
    SIMULATED,
    Compression,
    HostCosts,
    SimResult,
    comm_slowdown_from_ceiling,
    SimulationError,
    Span,
    check_buckets,
    default_buckets,
    gradient_comm_time,
    lower_bound,
    simulate,
)

__all__ = [
    "COMPRESSIONS",
    "SIMULATED",
    "Compression",
    "HostCosts",
    "SimResult",
    "comm_slowdown_from_ceiling",
    "SimulationError",
    "Span",
    "allreduce_time",
    "check_buckets",
    "default_buckets",
    "gradient_comm_time",
    "lower_bound",
    "simulate",
    "wfbp_time",
]


def __getattr__(name: str) -> object:
    if name == "STRATEGIES":  # deprecated: jaxsched.STRATEGIES is the one strategy table
        from jaxsched.sim import core

        return core.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
