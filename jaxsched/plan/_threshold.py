"""Fixed-size fusion buffers, as Horovod tensor fusion and PyTorch DDP buckets do."""

from __future__ import annotations

from jaxsched._errors import JaxschedValueError
from jaxsched.sim._costmodel import LayerProfile
from jaxsched.plan._common import to_forward_buckets

__all__ = ["DEFAULT_THRESHOLD_BYTES", "plan_threshold"]

DEFAULT_THRESHOLD_BYTES = 25 * 1024 * 1024  # PyTorch DDP bucket_cap_mb=25


def plan_threshold(layers: LayerProfile, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> list[list[int]]:
    """Fill buckets in gradient-completion (backward) order; close one at ``threshold_bytes``.

    Args:
      layers: the layer profile, in forward order.
      threshold_bytes: a bucket closes once it holds at least this many bytes.

    Returns:
      Contiguous groups of layer indices in forward order.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile
        >>> plan_threshold(LayerProfile([Layer("a", 1, 10, 0.1, 0.1)] * 4), threshold_bytes=20)
        [[0, 1], [2, 3]]
    """
    if threshold_bytes <= 0:
        raise JaxschedValueError(f"threshold_bytes={threshold_bytes} must be > 0")
    groups: list[list[int]] = [[]]
    filled = 0
    for position, layer in enumerate(reversed(layers.layers)):
        groups[-1].append(position)
        filled += layer.bytes
        if filled >= threshold_bytes and position < len(layers) - 1:
            groups.append([])
            filled = 0
    return to_forward_buckets(groups, len(layers))
