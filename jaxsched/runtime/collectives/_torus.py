"""Reduce-scatters that XLA:TPU keeps: at most two torus dimensions per group.

The logic lives in the core layer, where the partition stage reduce-scatters parameter
blocks too; this module re-exports it (see the private `jaxsched.core._torus`).

Example:
    >>> import jax
    >>> scatter_stages(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), "data")
    ()
"""

from __future__ import annotations

from jaxsched.core._torus import (
    MAX_TORUS_DIMS,
    TPU_LANES,
    Stages,
    scatter_lanes,
    scatter_stages,
    spanned_dims,
    staged_psum_scatter,
)

__all__ = [
    "MAX_TORUS_DIMS",
    "TPU_LANES",
    "Stages",
    "scatter_lanes",
    "scatter_stages",
    "spanned_dims",
    "staged_psum_scatter",
]
