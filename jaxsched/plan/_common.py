"""Shared helpers: backward-order views of a profile and conversion to forward buckets."""

from __future__ import annotations

from typing import Any

from jaxsched.sim._costmodel import CommPattern, LayerProfile, NetworkProfile, comm_pattern


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


def grad_alpha(network: NetworkProfile, strategy: str | CommPattern) -> float:
    """Per-bucket start-up cost that merging saves, for the collectives ``strategy`` uses."""
    return comm_pattern(strategy).startup_seconds(network)


def bucket_time(network: NetworkProfile, strategy: str | CommPattern, nbytes: float) -> float:
    """Communication time of one bucket of ``nbytes`` under ``strategy``'s pattern."""
    return comm_pattern(strategy).bucket_seconds(network, nbytes)
