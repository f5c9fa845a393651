"""Kernels for gradient compression: fused top-k style error feedback.

Public API (see `jaxsched.runtime.kernels._error_feedback` for the design):

>>> import jax.numpy as jnp
>>> from jaxsched.runtime import kernels
>>> kernels.fused_error_feedback(jnp.array([2.0, 0.1]), jnp.zeros(2), 1.0).count.item()
1
"""

from jaxsched import _deprecations

from jaxsched.runtime.kernels._error_feedback import (
    BLOCK_COLS,
    ErrorFeedback,
    SparseGradient,
    compact,
    default_capacity,
    default_sample_size,
    densify,
    error_feedback_pallas,
    error_feedback_reference,
    estimate_threshold,
    exact_topk_error_feedback,
    fused_error_feedback,
    selection_size,
    threshold_error_feedback,
)

__all__ = [
    "BLOCK_COLS",
    "ErrorFeedback",
    "SparseGradient",
    "compact",
    "default_capacity",
    "default_sample_size",
    "densify",
    "error_feedback_pallas",
    "error_feedback_reference",
    "estimate_threshold",
    "exact_topk_error_feedback",
    "fused_error_feedback",
    "selection_size",
    "threshold_error_feedback",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
