"""Prophet-style blocks (Cao et al., 2021): use the predicted gradient-ready times and the
measured link speed; whenever the link frees, send every gradient already waiting as one
block, so the link never idles while gradients queue and fewer start-ups are paid."""

from __future__ import annotations

from jaxsched.sim._costmodel import LayerProfile, NetworkProfile
from jaxsched.plan._common import backward_view, bucket_time, to_forward_buckets

__all__ = ["plan_prophet"]


def plan_prophet(layers: LayerProfile, network: NetworkProfile, strategy: str = "wfbp") -> list[list[int]]:
    """Blocks = the gradients ready when the link becomes free (at least one each).

    Args:
      layers: the layer profile, in forward order.
      network: the network profile.
      strategy: the strategy whose communication pattern is planned for.

    Returns:
      Contiguous groups of layer indices in forward order.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> slow = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 1e-3) for i in range(4)])
        >>> plan_prophet(slow, network_preset("1gbe", 8))
        [[0, 1, 2], [3]]
    """
    ready, sizes = backward_view(layers)
    groups: list[list[int]] = []
    link_free, j = 0.0, 0
    while j < len(ready):
        start = max(link_free, ready[j])
        group = [j]
        while j + 1 < len(ready) and ready[j + 1] <= start:
            j += 1
            group.append(j)
        link_free = start + bucket_time(network, strategy, sum(sizes[p] for p in group))
        groups.append(group)
        j += 1
    return to_forward_buckets(groups, len(layers))
