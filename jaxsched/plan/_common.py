"""Shared helpers: backward-order views of a profile and conversion to forward buckets."""
from __future__ import annotations

from typing import Any

from jaxsched.costmodel import LayerProfile, NetworkProfile


def backward_view(layers: LayerProfile) -> tuple[list[Any], list[int]]:
    """Ready offsets (from backward start) and bytes of each layer, in backward order."""
    ready, sizes, elapsed = [], [], 0.0
    for layer in reversed(layers.layers):
        elapsed += layer.backward_s
        ready.append(elapsed)
        sizes.append(layer.bytes)
    return ready, sizes


def to_forward_buckets(backward_groups: list[list[int]], num_layers: int) -> list[list[int]]:
    """Groups of backward positions (0 = last layer) -> forward-order buckets of layer indices."""
    buckets = [sorted(num_layers - 1 - j for j in group) for group in backward_groups]
    return sorted(buckets, key=lambda b: b[0])


def grad_alpha(network: NetworkProfile, strategy: str) -> float:
    """Per-bucket start-up cost that merging saves, for the collectives ``strategy`` uses."""
    if strategy == "dear":
        return network.cost("reduce_scatter").alpha_s + network.cost("all_gather").alpha_s
    return network.cost("all_reduce").alpha_s


def bucket_time(network: NetworkProfile, strategy: str, nbytes: float) -> float:
    if strategy == "dear":
        return network.time("reduce_scatter", nbytes) + network.time("all_gather", nbytes)
    return network.time("all_reduce", nbytes)
