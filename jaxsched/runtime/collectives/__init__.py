"""Collectives strategies call per bucket; wrappers (compression, casts) and the
two-level `Hierarchical` plug in here."""

from jaxsched import _deprecations

from jaxsched.runtime.collectives._base import (
    FORMS,
    BucketSpec,
    Collective,
    CollectiveWrapper,
    PlainCollective,
    stack_local,
    stacked_zeros,
    unstack_local,
)
from jaxsched.runtime.collectives._hierarchical import (
    Hierarchical,
    default_collective_for,
    hierarchy_from_mesh,
    slow_axes,
)

# every private module's public names, explicitly
from jaxsched.runtime.collectives._base import CollectiveState, OPERATIONS, SMALL_TENSOR_BYTES, nbytes, psum_scatter
from jaxsched.runtime.collectives._torus import (
    MAX_TORUS_DIMS,
    TPU_LANES,
    Stages,
    scatter_lanes,
    scatter_stages,
    spanned_dims,
    staged_psum_scatter,
)

__all__ = [
    "BucketSpec",
    "Collective",
    "CollectiveState",
    "CollectiveWrapper",
    "FORMS",
    "Hierarchical",
    "MAX_TORUS_DIMS",
    "OPERATIONS",
    "PlainCollective",
    "SMALL_TENSOR_BYTES",
    "Stages",
    "TPU_LANES",
    "default_collective_for",
    "hierarchy_from_mesh",
    "nbytes",
    "psum_scatter",
    "scatter_lanes",
    "scatter_stages",
    "slow_axes",
    "spanned_dims",
    "stack_local",
    "stacked_zeros",
    "staged_psum_scatter",
    "unstack_local",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
