"""Bucket planners: which gradients travel together in one collective.

[`plan_buckets`][jaxsched.plan.plan_buckets] returns contiguous groups of layer indices in **forward order**
(``[[0, 1], [2, 3]]``: layers 2 and 3 finish backward first, so their bucket is sent
first). That is the layout [`jaxsched.sim.simulate`][jaxsched.sim.simulate] and
[`jaxsched.schedule`][jaxsched.schedule] take.

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> from jaxsched.plan import plan_buckets
    >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 2e-3) for i in range(8)])
    >>> net = network_preset("10gbe", 16)
    >>> len(plan_buckets(prof, net, "per_layer"))
    8
    >>> from jaxsched.sim import simulate
    >>> best = plan_buckets(prof, net, "optimal", strategy="wfbp")
    >>> all(simulate(prof, net, "wfbp", best).iteration_s <=
    ...     simulate(prof, net, "wfbp", plan_buckets(prof, net, p)).iteration_s + 1e-12
    ...     for p in PLANNERS)
    True
"""

from __future__ import annotations

from jaxsched import _deprecations

from typing import Any, Callable

from jaxsched._errors import JaxschedValueError
from jaxsched.sim._costmodel import CommPattern, LayerProfile, NetworkProfile, comm_pattern
from jaxsched.plan._mgwfbp import plan_mgwfbp
from jaxsched.plan._optimal import optimal_wfbp, search
from jaxsched.plan._per_layer import plan_per_layer
from jaxsched.plan._prophet import plan_prophet
from jaxsched.plan._threshold import DEFAULT_THRESHOLD_BYTES, plan_threshold
from jaxsched.core._bucketing import param_paths


Planner = Callable[..., list[list[int]]]

#: Planners by name: ``(layers, network, strategy, threshold_bytes=...) -> buckets``.
PLANNER_REGISTRY: dict[str, Planner] = {
    "per_layer": lambda layers, network, strategy, **_: plan_per_layer(layers),
    "threshold": lambda layers, network, strategy, threshold_bytes, **_: plan_threshold(layers, threshold_bytes),
    "mgwfbp": lambda layers, network, strategy, **_: plan_mgwfbp(layers, network, strategy),
    "prophet": lambda layers, network, strategy, **_: plan_prophet(layers, network, strategy),
}
PLANNERS = tuple(PLANNER_REGISTRY) + ("optimal",)


def plan_buckets(
    layers: LayerProfile,
    network: NetworkProfile,
    planner: str = "threshold",
    strategy: str | CommPattern = "wfbp",
    *,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    compression: Any = None,
    progress: bool = False,
    iterations: int = 6,
) -> list[list[int]]:
    """Plan buckets for ``strategy`` (a name or its `CommPattern`) with ``planner``.

    ``optimal`` minimises ``jaxsched.sim.simulate(..., strategy, buckets)`` (exactly by DP for
    all-reduce patterns when bucket copies are free, otherwise by a search of the simulator
    that is exhaustive up to 10 layers); ``compression`` and ``iterations`` are passed to
    the simulator when it is searched.

    Args:
      layers: the layer profile, in forward order.
      network: the network profile.
      planner: one of `PLANNERS`: ``"per_layer"``, ``"threshold"``, ``"mgwfbp"``,
        ``"prophet"`` or ``"optimal"``.
      strategy: a strategy name or its `CommPattern` (what the plan is simulated for).
      threshold_bytes: the ``threshold`` planner's bucket size.
      compression: for ``optimal``, the compression the simulator models (as
        [`simulate`][jaxsched.sim.simulate] takes it).
      progress: for ``optimal``, show a bar over the search.
      iterations: for ``optimal``, the simulated iterations per candidate.

    Returns:
      Contiguous groups of layer indices in forward order, the layout
      [`jaxsched.schedule`][jaxsched.schedule]'s ``buckets`` takes.

    Raises:
      JaxschedValueError: an unknown planner.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> profile = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 2e-3) for i in range(4)])
        >>> plan_buckets(profile, network_preset("10gbe", 8), "threshold", threshold_bytes=2 * 10**6)
        [[0, 1], [2, 3]]
    """
    if planner in PLANNER_REGISTRY:
        return PLANNER_REGISTRY[planner](layers, network, strategy, threshold_bytes=threshold_bytes)
    if planner != "optimal":
        raise JaxschedValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")
    return _plan_optimal(layers, network, strategy, threshold_bytes, compression, progress, iterations)


def _plan_optimal(
    layers: LayerProfile,
    network: NetworkProfile,
    strategy: str | CommPattern,
    threshold_bytes: int,
    compression: Any,
    progress: bool,
    iterations: int,
) -> list[list[int]]:
    if strategy == "bytescheduler":
        raise JaxschedValueError("bytescheduler partitions tensors itself; plan buckets for another strategy")
    pattern = comm_pattern(strategy)
    if compression is None and (not pattern.in_backward or pattern.delayed_update):
        # Nothing overlaps backward (or communication overlaps the whole next step):
        # every extra bucket only adds a start-up cost.
        return [list(range(len(layers)))]
    if (
        compression is None
        and not network.copy_s_per_byte
        and pattern.in_backward
        and pattern.collectives() == ("all_reduce",)
    ):
        return optimal_wfbp(layers, network)[0]  # exact: the DP's model is the simulator's
    # With bucket copies on the compute stream (measured profiles) the DP's model is
    # incomplete: search the simulator, with the DP's plan among the candidates.
    from jaxsched.sim import simulate  # the planner searches the simulator

    def evaluate(buckets: list[list[int]]) -> float:
        return simulate(
            layers, network, strategy, buckets, iterations=iterations, compression=compression, keep_spans=False
        ).iteration_s

    candidates = [plan_buckets(layers, network, p, strategy, threshold_bytes=threshold_bytes) for p in PLANNER_REGISTRY]
    candidates += [plan_threshold(layers, 2**e) for e in range(16, 32, 2)]
    candidates += [optimal_wfbp(layers, network)[0], [list(range(len(layers)))]]
    return search(layers, candidates, evaluate, progress=progress)


# the private modules' public names (after plan_buckets, which _from_step imports)
from jaxsched.plan._from_step import (  # noqa: E402
    auto_bucket_paths,
    forward_flops,
    group_paths,
    layer_names,
    local_device,
    MATMULS,
    measure_flops_per_s,
    PASS_THROUGH,
    step_layer_profile,
    step_network_profile,
    with_selection_cost,
)
from jaxsched.plan._optimal import all_partitions, EXHAUSTIVE_LAYERS  # noqa: E402
from jaxsched.plan._planned_step import is_abstract, PlannedStep, REPLICATED, takes_as_is, zero_count  # noqa: E402
from jaxsched.plan._profiling import (  # noqa: E402
    fit_alpha_beta,
    measure_copy,
    measure_dispatch,
    profile_network,
    profile_stages,
    profile_update,
    profile_zoo_model,
    zoo_stages,
)

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "EXHAUSTIVE_LAYERS",
    "MATMULS",
    "PASS_THROUGH",
    "PLANNERS",
    "PLANNER_REGISTRY",
    "PlannedStep",
    "REPLICATED",
    "all_partitions",
    "auto_bucket_paths",
    "fit_alpha_beta",
    "forward_flops",
    "group_paths",
    "is_abstract",
    "layer_names",
    "local_device",
    "measure_copy",
    "measure_dispatch",
    "measure_flops_per_s",
    "optimal_wfbp",
    "param_paths",
    "plan_buckets",
    "plan_mgwfbp",
    "plan_per_layer",
    "plan_prophet",
    "plan_threshold",
    "profile_network",
    "profile_stages",
    "profile_update",
    "profile_zoo_model",
    "search",
    "step_layer_profile",
    "step_network_profile",
    "takes_as_is",
    "with_selection_cost",
    "zero_count",
    "zoo_stages",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
