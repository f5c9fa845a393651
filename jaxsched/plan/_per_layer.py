"""WFBP (Zhang et al., Poseidon 2017): one collective per layer, issued as soon as it is ready."""

from __future__ import annotations

from jaxsched.sim._costmodel import LayerProfile

__all__ = ["plan_per_layer"]


def plan_per_layer(layers: LayerProfile) -> list[list[int]]:
    """One bucket per layer.

    Args:
      layers: the layer profile, in forward order.

    Returns:
      Contiguous groups of layer indices in forward order.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile
        >>> plan_per_layer(LayerProfile([Layer("a", 1, 4, 0.1, 0.1)] * 3))
        [[0], [1], [2]]
    """
    return [[i] for i in range(len(layers))]
