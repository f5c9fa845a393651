"""Iteration simulator: strategies, closed forms, timelines. See `jaxsched.sim.core`."""

from jaxsched.sim.closed_form import allreduce_time, wfbp_time
from jaxsched.sim.core import (
    COMPRESSIONS,
    STRATEGIES,
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
    "STRATEGIES",
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
