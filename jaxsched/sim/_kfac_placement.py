"""Which worker inverts which K-FAC factor: a load-balancing plan from matrix sizes.

Inverting (or eigendecomposing) an ``n x n`` factor costs about ``n**3`` operations, and a
model's factors differ in size by orders of magnitude (a 3x3 convolution over 512
channels has a 4608 x 4608 input factor, its bias-free output factor 512 x 512). Three
placements, compared in ``docs/kfac.md``:

* ``naive``: every worker inverts every factor (no communication, ``P`` times the work);
* ``round_robin``: layer ``i``'s factors on worker ``i mod P`` (kfac-jax's placement of
  curvature blocks), blind to sizes;
* ``balanced``: greedy longest-processing-time (LPT): factors sorted by ``n**3``, largest
  first, each to the least-loaded worker so far. LPT's largest load is within
  ``4/3 - 1/(3P)`` of the optimum (Graham, 1969).

Each worker's results are shared with the others afterwards (an all-gather).

Example:
    >>> plan_placement([512, 64, 64, 64, 64], 2, "balanced")
    (0, 1, 1, 1, 1)
    >>> plan_placement([512, 64, 64, 64, 64], 2, "round_robin", layers=[0, 0, 1, 1, 2])
    (0, 0, 1, 1, 0)
    >>> max_load([512, 64, 64, 64, 64], (0, 1, 1, 1, 1), 2) == 512 ** 3
    True
"""

from __future__ import annotations

from typing import Sequence

from jaxsched._errors import JaxschedValueError

__all__ = ["check_placement", "inversion_cost", "max_load", "PLACEMENTS", "plan_placement", "worker_loads"]

#: Placement methods, in the order docs and benchmarks list them.
PLACEMENTS = ("balanced", "round_robin", "naive")


def inversion_cost(n: int) -> float:
    """Relative cost of inverting an ``n x n`` matrix.

    Args:
      n: the matrix's size.

    Returns:
      ``n**3``, as a float.

    Example:
        >>> inversion_cost(512)
        134217728.0
    """
    return float(n) ** 3


def plan_placement(
    dims: Sequence[int], num_workers: int, method: str = "balanced", layers: Sequence[int] | None = None
) -> tuple[int, ...] | None:
    """The worker that inverts each factor.

    Args:
      dims: each factor's size ``n`` (an ``n x n`` matrix).
      num_workers: the workers to spread the inversions over.
      method: ``"balanced"`` (LPT on ``n**3``), ``"round_robin"`` or ``"naive"``.
      layers: ``layers[i]`` is the layer factor ``i`` belongs to; ``round_robin`` places
        whole layers (default: one layer per factor).

    Returns:
      The worker of each factor, or None for ``naive`` (every worker inverts everything).

    Example:
        >>> plan_placement([4096, 512, 512], 2)
        (0, 1, 1)
        >>> plan_placement([4096, 512], 2, "naive") is None
        True
    """
    check_placement(method)
    if not isinstance(num_workers, int) or num_workers < 1:
        raise JaxschedValueError(f"num_workers={num_workers!r} must be an int >= 1")
    if any(int(n) < 1 for n in dims):
        raise JaxschedValueError(f"factor sizes {list(dims)} must all be >= 1")
    if method == "naive":
        return None
    if method == "round_robin":
        layers = list(range(len(dims))) if layers is None else list(layers)
        if len(layers) != len(dims):
            raise JaxschedValueError(f"layers has {len(layers)} entries for {len(dims)} factors")
        order = {layer: k for k, layer in enumerate(dict.fromkeys(layers))}
        return tuple(order[layer] % num_workers for layer in layers)
    load = [0.0] * num_workers
    owner = [0] * len(dims)
    # largest first; ties broken by index so the plan is deterministic
    for i in sorted(range(len(dims)), key=lambda i: (-inversion_cost(dims[i]), i)):
        w = min(range(num_workers), key=lambda w: (load[w], w))
        owner[i] = w
        load[w] += inversion_cost(dims[i])
    return tuple(owner)


def worker_loads(dims: Sequence[int], owners: Sequence[int] | None, num_workers: int) -> list[float]:
    """Inversion cost per worker under a plan.

    Args:
      dims: each factor's size.
      owners: each factor's worker, as `plan_placement` gives (``None``: naive, everyone
        does everything).
      num_workers: the number of workers.

    Returns:
      Each worker's summed ``n**3``.

    Example:
        >>> worker_loads([4, 2, 2], (0, 1, 1), 2)
        [64.0, 16.0]
    """
    if owners is None:
        return [sum(inversion_cost(n) for n in dims)] * num_workers
    load = [0.0] * num_workers
    for n, w in zip(dims, owners, strict=True):
        load[w] += inversion_cost(n)
    return load


def max_load(dims: Sequence[int], owners: Sequence[int] | None, num_workers: int) -> float:
    """The busiest worker's inversion cost: what the step waits for.

    Args:
      dims: each factor's size.
      owners: each factor's worker (``None``: naive).
      num_workers: the number of workers.

    Returns:
      The largest of `worker_loads`.

    Example:
        >>> max_load([4, 2, 2], None, 2)
        80.0
    """
    return max(worker_loads(dims, owners, num_workers))


def check_placement(method: str) -> str:
    if method not in PLACEMENTS:
        raise JaxschedValueError(f"placement={method!r} is unknown; choose one of {', '.join(PLACEMENTS)}")
    return method
