"""Collectives strategies call per bucket; wrappers (compression, casts) and the
two-level `Hierarchical` plug in here."""

from jaxsched.runtime.collectives.base import (
    FORMS,
    BucketSpec,
    Collective,
    CollectiveWrapper,
    PlainCollective,
    stack_local,
    stacked_zeros,
    unstack_local,
)
from jaxsched.runtime.collectives.hierarchical import (
    Hierarchical,
    default_collective_for,
    hierarchy_from_mesh,
    slow_axes,
)

__all__ = [
    "FORMS",
    "BucketSpec",
    "Collective",
    "CollectiveWrapper",
    "Hierarchical",
    "PlainCollective",
    "default_collective_for",
    "hierarchy_from_mesh",
    "slow_axes",
    "stack_local",
    "stacked_zeros",
    "unstack_local",
]
