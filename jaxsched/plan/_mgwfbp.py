"""MG-WFBP (Shi, Chu & Li, INFOCOM 2019): merge a layer's gradient into the next one when
waiting for it costs less than the start-up time that one fewer collective saves."""

from __future__ import annotations

from jaxsched.sim._costmodel import LayerProfile, NetworkProfile
from jaxsched.plan._common import backward_view, bucket_time, grad_alpha, to_forward_buckets

__all__ = ["plan_mgwfbp"]


def plan_mgwfbp(layers: LayerProfile, network: NetworkProfile, strategy: str = "wfbp") -> list[list[int]]:
    """Greedy merging in backward order under the single-stream FIFO model.

    A bucket whose collective could start at ``s`` (link free and gradients ready) is
    merged with the next layer, ready at ``r``, when ``r - s < alpha``.

    Args:
      layers: the layer profile, in forward order.
      network: the network profile.
      strategy: the strategy whose communication pattern is planned for.

    Returns:
      Contiguous groups of layer indices in forward order.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> tiny = LayerProfile([Layer(str(i), 1, 4, 1e-6, 1e-6) for i in range(4)])
        >>> plan_mgwfbp(tiny, network_preset("1gbe", 8))  # latency dominates: merge all
        [[0, 1, 2, 3]]
    """
    ready, sizes = backward_view(layers)
    alpha = grad_alpha(network, strategy)
    groups: list[list[int]] = [[0]]
    nbytes, link_free = sizes[0], 0.0
    for j in range(1, len(ready)):
        start = max(link_free, ready[j - 1])
        if ready[j] - start < alpha:
            groups[-1].append(j)
            nbytes += sizes[j]
            continue
        link_free = start + bucket_time(network, strategy, nbytes)
        groups.append([j])
        nbytes = sizes[j]
    return to_forward_buckets(groups, len(layers))
