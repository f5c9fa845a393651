"""Strategies: one module each, registered by name.

Adding one is one new module (a `Strategy` subclass with ``name``, ``cost``, its
state conversions and its rewrite) plus ``@register_strategy``; see
docs/architecture.md.
"""

from jaxsched import _deprecations

from jaxsched.strategies._base import BucketReport, RewrittenBody, SchedState, Strategy, UserLayoutStrategy
from jaxsched.strategies._registry import (
    STRATEGIES,
    make_strategy,
    register_strategy,
    strategy_names,
    unregister_strategy,
)

# Built-in strategies register themselves on import.
from jaxsched.strategies._allreduce import AllReduce  # noqa: E402
from jaxsched.strategies._wfbp import Wfbp  # noqa: E402
from jaxsched.strategies._dear import Dear  # noqa: E402
from jaxsched.strategies._approx import Approx  # noqa: E402
from jaxsched.strategies._kfac import KFAC  # noqa: E402
from jaxsched.strategies._auto import Auto, AutoChoice  # noqa: E402
from jaxsched.strategies._diloco import DiLoCo, DiLoCoState  # noqa: E402

# every private module's public names, explicitly
from jaxsched.strategies._approx import ApproxState, nested_eqns_of, UpdateSplit
from jaxsched.strategies._approximation import (
    ApproxParams,
    ApproximateState,
    METHODS,
    STALENESS_RULES,
    StalenessAwareState,
    approximate,
    approximated_point,
    staleness_aware,
)
from jaxsched.strategies._base import (
    bucket_sum_axes,
    reduce_gradients,
    scatter_block,
    ScheduledState,
    check_leaf_counts,
    placed_user_layout,
)
from jaxsched.strategies._dear import DearLayout
from jaxsched.strategies._diloco_fragments import FragmentSchedule, PhaseKey, fragment_of_leaves, sync_schedule
from jaxsched.strategies._kfac import (
    INVERSES,
    KFACFallbackWarning,
    KFACState,
    check_options,
    damped_inverse,
    damped_terms,
    local_factors,
    plan_factor_buckets,
    precondition,
)
from jaxsched.strategies._registry import StrategyNames

__all__ = [
    "AllReduce",
    "Approx",
    "ApproxParams",
    "ApproxState",
    "ApproximateState",
    "Auto",
    "AutoChoice",
    "BucketReport",
    "Dear",
    "DearLayout",
    "DiLoCo",
    "DiLoCoState",
    "FragmentSchedule",
    "INVERSES",
    "KFAC",
    "KFACFallbackWarning",
    "KFACState",
    "METHODS",
    "PhaseKey",
    "RewrittenBody",
    "STALENESS_RULES",
    "STRATEGIES",
    "SchedState",
    "ScheduledState",
    "StalenessAwareState",
    "Strategy",
    "StrategyNames",
    "UpdateSplit",
    "UserLayoutStrategy",
    "Wfbp",
    "approximate",
    "approximated_point",
    "bucket_sum_axes",
    "check_leaf_counts",
    "check_options",
    "damped_inverse",
    "damped_terms",
    "fragment_of_leaves",
    "local_factors",
    "make_strategy",
    "nested_eqns_of",
    "placed_user_layout",
    "plan_factor_buckets",
    "precondition",
    "reduce_gradients",
    "register_strategy",
    "scatter_block",
    "staleness_aware",
    "strategy_names",
    "sync_schedule",
    "unregister_strategy",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
