"""Simulated time per step of DiLoCo and Streaming DiLoCo (figures are simulated).

Why: DiLoCo trades a sum over the slow links every step for one outer all-reduce every H
steps (per fragment, on a staggered schedule, overlapping τ inner steps). Whether that
brings a step to its compute depends on the model's bytes, the links and H, F, τ: this
model answers before a cluster is rented.

The model, per replica group (a node of a two-level network, or one worker):

* an **inner step** is the user's step reduced over the fast links only: the per-step
  simulator's ``wfbp`` over the node's devices (`jaxsched.sim.simulate`), or the
  compute alone when a replica is one worker;
* a fragment's **outer all-reduce** moves ``bytes / F`` (or its quantized payload,
  all-gathered) across the replicas on the slow link, one at a time on a link stream;
* with τ = 0 the step that sends waits for it; with τ >= 1 it is issued at the start of
  the next step and the step ``τ`` later waits for its arrival; each arrival costs the
  outer optimizer's update (the profile's update time, per fragment).

The period is the mean step over whole H-step cycles after the first one.

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
    >>> net = network_preset("10gbe", 8)
    >>> plain = simulate_diloco(layers, net, inner_steps=1)
    >>> streaming = simulate_diloco(layers, net, inner_steps=10, fragments=2, overlap_steps=1)
    >>> streaming.step_s < plain.step_s, streaming.simulated
    (True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxsched.sim._costmodel import LayerProfile, NetworkProfile, network_preset, ring_costs, LINK_PRESETS

__all__ = ["DiLoCoSimResult", "simulate_diloco"]


@dataclasses.dataclass(frozen=True)
class DiLoCoSimResult:
    """What `simulate_diloco` found.

    Attributes:
      step_s: mean simulated seconds per inner step, over whole cycles after the first.
      inner_s: one inner step alone (compute and fast-link sums).
      outer_s: one fragment's outer all-reduce on the slow link.
      slow_bytes_per_step: bytes each device sends over its slow link per step (mean).
      replicas: replica groups synchronized by the outer all-reduce.
      options: what was simulated.
      simulated: always True: these figures come from a model, not a measurement.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> layers = LayerProfile([Layer("l", 10**6, 4 * 10**6, 1e-3, 2e-3)])
        >>> result = simulate_diloco(layers, network_preset("10gbe", 4), inner_steps=4)
        >>> result.replicas, sorted(result.summary())[:3]
        (4, ['inner_s', 'options', 'outer_s'])
    """

    step_s: float
    inner_s: float
    outer_s: float
    slow_bytes_per_step: float
    replicas: int
    options: dict
    simulated: bool = True

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _levels(network: NetworkProfile) -> tuple[NetworkProfile | None, NetworkProfile, int, int]:
    """(fast network within a replica or None, slow network across replicas, replicas,
    devices per replica)."""
    levels = network.meta.get("levels")
    if not levels:
        return None, network, network.workers, 1
    nodes, per_node = int(levels["nodes"]), int(levels["per_node"])
    fast = network_preset(levels["fast"], per_node)
    slow = NetworkProfile(
        nodes, ring_costs(LINK_PRESETS[levels["slow"]], nodes), {"preset": levels["slow"], "algorithm": "ring"}
    )
    return fast, slow, nodes, per_node


def simulate_diloco(
    layers: LayerProfile,
    network: NetworkProfile,
    inner_steps: int = 50,
    fragments: int = 1,
    overlap_steps: int = 0,
    outer_bits: int = 32,
    block_size: int = 256,
    cycles: int = 4,
) -> DiLoCoSimResult:
    """Simulate DiLoCo on ``layers`` over ``network``.

    Args:
      layers: the model's layer profile.
      network: one level (every worker a replica) or two levels (every node a replica,
        `jaxsched.sim._costmodel.two_level_network`).
      inner_steps: H, the inner steps between a fragment's outer all-reduces.
      fragments: F, Streaming DiLoCo's fragments, synchronized on a staggered schedule.
      overlap_steps: τ, the inner steps an outer all-reduce may overlap.
      outer_bits: 32 sends float32 outer gradients; 4 or 8 the quantized payload of
        `jaxsched.runtime.compress.Quantize`.
      block_size: the quantizer's block size.
      cycles: the H-step cycles simulated after the first.

    Returns:
      A `DiLoCoSimResult`.

    Raises:
      SimulationError: options out of range.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> layers = LayerProfile([Layer("l", 10**6, 4 * 10**6, 1e-3, 2e-3)])
        >>> net = network_preset("1gbe", 4)
        >>> f32 = simulate_diloco(layers, net, inner_steps=10)
        >>> int8 = simulate_diloco(layers, net, inner_steps=10, outer_bits=8)
        >>> int8.slow_bytes_per_step < f32.slow_bytes_per_step
        True
    """
    from jaxsched.sim._core import SimulationError, simulate

    if inner_steps < 1 or fragments < 1 or fragments > inner_steps:
        raise SimulationError(f"inner_steps={inner_steps}, fragments={fragments}: need 1 <= fragments <= inner_steps")
    if overlap_steps < 0 or overlap_steps * fragments >= inner_steps:
        raise SimulationError(
            f"overlap_steps={overlap_steps} must be >= 0 and < inner_steps / fragments = {inner_steps}/{fragments}"
        )
    if outer_bits not in (4, 8, 32):
        raise SimulationError(f"outer_bits={outer_bits}: use 32 (float32), 8 or 4")
    fast, slow, replicas, per_node = _levels(network)
    if fast is None:
        inner = layers.forward_s + layers.backward_s + layers.update_s
    else:
        inner = simulate(layers, fast, "wfbp").iteration_s
    fragment_bytes = layers.total_bytes / fragments
    shard_bytes = fragment_bytes / per_node
    if outer_bits == 32:
        sent = shard_bytes
        outer = slow.time("all_reduce", shard_bytes) if replicas > 1 else 0.0
    else:
        elements = shard_bytes / 4
        sent = math.ceil(elements / block_size) * (block_size * outer_bits / 8 + 4)
        outer = slow.time("all_gather", sent * replicas) if replicas > 1 else 0.0
    if fast is not None and replicas > 1:
        outer += fast.time("all_gather", fragment_bytes)
    update = layers.update_s / fragments
    offsets = [((p + 1) * inner_steps // fragments) % inner_steps for p in range(fragments)]

    def due(s: int) -> bool:
        return s >= 1 and any(s % inner_steps == d for d in offsets)

    clock, link_free, arrivals, starts = 0.0, 0.0, {}, []
    total_steps = inner_steps * (cycles + 1)
    for t in range(total_steps + 1):
        starts.append(clock)
        if t == total_steps:
            break
        if overlap_steps >= 1 and due(t):
            begin = max(clock, link_free)
            link_free = begin + outer
            arrivals[t + overlap_steps] = link_free
        clock += inner
        if overlap_steps == 0 and due(t + 1):
            begin = max(clock, link_free)
            link_free = begin + outer
            clock = link_free + update
        elif t + 1 in arrivals:
            clock = max(clock, arrivals.pop(t + 1)) + update
    step = (starts[total_steps] - starts[inner_steps]) / (total_steps - inner_steps)
    return DiLoCoSimResult(
        step,
        inner,
        outer,
        sent * fragments / inner_steps if replicas > 1 else 0.0,
        replicas,
        {"inner_steps": inner_steps, "fragments": fragments, "overlap_steps": overlap_steps, "outer_bits": outer_bits},
    )
