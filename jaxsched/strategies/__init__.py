"""Strategies: one module each, registered by name.

Adding one is one new module (a `Strategy` subclass with ``name``, ``cost``, its
state conversions and its rewrite) plus ``@register_strategy``; see
docs/architecture.md.
"""

from jaxsched.strategies.base import BucketReport, RewrittenBody, SchedState, Strategy, UserLayoutStrategy
from jaxsched.strategies.registry import (
    STRATEGIES,
    make_strategy,
    register_strategy,
    strategy_names,
    unregister_strategy,
)

# Built-in strategies register themselves on import.
from jaxsched.strategies.allreduce import AllReduce  # noqa: E402
from jaxsched.strategies.wfbp import Wfbp  # noqa: E402
from jaxsched.strategies.dear import Dear  # noqa: E402
from jaxsched.strategies.approx import Approx  # noqa: E402
from jaxsched.strategies.kfac import KFAC  # noqa: E402
from jaxsched.strategies.auto import Auto, AutoChoice  # noqa: E402
from jaxsched.strategies.diloco import DiLoCo, DiLoCoState  # noqa: E402

__all__ = [
    "AllReduce",
    "Approx",
    "Auto",
    "AutoChoice",
    "BucketReport",
    "Dear",
    "DiLoCo",
    "DiLoCoState",
    "KFAC",
    "RewrittenBody",
    "STRATEGIES",
    "SchedState",
    "Strategy",
    "UserLayoutStrategy",
    "Wfbp",
    "make_strategy",
    "register_strategy",
    "strategy_names",
    "unregister_strategy",
]
