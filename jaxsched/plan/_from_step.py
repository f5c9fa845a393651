"""``buckets="auto"``: cost-model planning for a captured step.

The planners work on layers (parameter groups in forward order) and an alpha-beta
network profile. For a user's step, layers are the parameter paths without their last
component (``hidden/0/kernel`` and ``hidden/0/bias`` form layer ``hidden/0``), ordered
by first use in forward. Their compute times come from a measured `LayerProfile`
when one is given (its layer names may use ``.`` or ``/``), else from a static estimate:
the FLOPs of the forward matmuls and convolutions that read each layer's parameters,
over a matmul rate measured on the mesh's first device, with backward at twice forward.
The network profile is measured on the step's own mesh unless one is given.

Example:
    >>> layer_names(["hidden/0/bias", "hidden/0/kernel", "head/kernel"])
    ['hidden/0', 'hidden/0', 'head']
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxsched._errors import JaxschedValueError
from jaxsched.core._analyze import Analysis
from jaxsched.core._axes import as_axes
from jaxsched.sim._costmodel import CollectiveCost, CommPattern, Layer, LayerProfile, NetworkProfile, network_preset
from jaxsched.runtime.engine._base import EngineCosts
from jaxsched.plan import plan_buckets

__all__ = [
    "auto_bucket_paths",
    "forward_flops",
    "group_paths",
    "layer_names",
    "local_device",
    "MATMULS",
    "measure_flops_per_s",
    "PASS_THROUGH",
    "step_layer_profile",
    "step_network_profile",
    "with_selection_cost",
]

MATMULS = ("dot_general", "conv_general_dilated")
PASS_THROUGH = (
    "convert_element_type",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "pvary",
)


def layer_names(paths: Sequence[str]) -> list[str]:
    return [p.rsplit("/", 1)[0] if "/" in p else p for p in paths]


def _flops(eqn) -> float:
    out = math.prod(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in lhs_contract)
    rhs = eqn.invars[1].aval.shape  # conv: kernel spatial * input features per output
    return 2.0 * out * math.prod(rhs) / max(1, rhs[eqn.params["dimension_numbers"].rhs_spec[0]])


def forward_flops(analysis: Analysis) -> list[float]:
    """FLOPs of the matmuls/convolutions that read each parameter leaf (first reads only):
    the static estimate of each layer's compute when no layer profile is given.

    Args:
      analysis: the captured step's analysis (`PlannedStep.analysis`).

    Returns:
      Per-device forward FLOPs per parameter leaf (0 for a leaf no matmul reads, a bias).

    Example:
        >>> from jaxsched.demo import steps
        >>> planned = steps.planned_step_example()
        >>> from jaxsched.plan import forward_flops
        >>> forward_flops(planned.analysis)  # one row per device: 2 * 1 * 4 * 3 for the hidden kernel
        [0.0, 24.0, 0.0, 24.0]
    """
    cap = analysis.captured
    origin = {cap.body.invars[cap.body_input("params", i)]: i for i in range(cap.num_params)}
    flops = [0.0] * cap.num_params
    for k in analysis.backward:
        eqn = cap.body.eqns[k]
        sources = {origin[x] for x in eqn.invars if not isinstance(x, jex_core.Literal) and x in origin}
        if eqn.primitive.name in PASS_THROUGH and len(sources) == 1:
            origin.update({o: next(iter(sources)) for o in eqn.outvars})
        elif eqn.primitive.name in MATMULS:
            for i in sources:
                flops[i] += _flops(eqn) / len(sources)
    return flops


def local_device(mesh: Any) -> Any:
    """This process's first device of ``mesh`` (where it measures what a plan needs).

    Args:
      mesh: the step's ``jax.sharding.Mesh``.

    Returns:
      A ``jax.Device`` of this process.

    Example:
        >>> import jax
        >>> from jaxsched.plan import local_device
        >>> local_device(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])) == jax.devices()[0]
        True
    """
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def measure_flops_per_s(device: Any, size: int = 256, repeats: int = 5) -> float:
    """A matmul rate achievable on ``device`` (median of ``repeats``): turns the static
    FLOP counts into seconds.

    Args:
      device: where to measure.
      size: the side of the square float32 matmul.
      repeats: timed runs after one warm-up.

    Returns:
      FLOP/s.

    Example:
        >>> import jax
        >>> from jaxsched.plan import measure_flops_per_s
        >>> measure_flops_per_s(jax.devices()[0], size=32, repeats=2) > 0
        True
    """
    # one device, outside any mesh the caller set (`jax.set_mesh`), which jit would hold it to
    with jax.set_mesh(None):
        a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            f(a).block_until_ready()
            times.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(times)


def step_layer_profile(
    analysis: Analysis, paths: Sequence[str], measured: LayerProfile | None = None, flops_per_s: float | None = None
) -> tuple[LayerProfile, list[list[int]]]:
    """The step's layers in forward order and, per layer, its parameter leaf indices.

    A layer is a path without its last part (``hidden/0`` for ``hidden/0/kernel``), ordered
    by first use in the body, since that is the order backward reverses.

    Args:
      analysis: the captured step's analysis (`PlannedStep.analysis`).
      paths: the parameter paths (`PlannedStep.paths`).
      measured: a profile to take the layers' times from, matched by name; None estimates
        them from `forward_flops`.
      flops_per_s: the rate for the estimate; None measures it on this process's device.

    Returns:
      ``(profile, members)``: the `LayerProfile`, and each layer's parameter leaf indices.

    Raises:
      JaxschedValueError: ``measured`` lacks one of the step's layers.

    Example:
        >>> from jaxsched.demo import steps
        >>> planned = steps.planned_step_example()
        >>> from jaxsched.plan import step_layer_profile
        >>> prof, members = step_layer_profile(planned.analysis, planned.paths, flops_per_s=1e9)
        >>> [layer.name for layer in prof.layers], members
        (['hidden/0', 'head'], [[2, 3], [0, 1]])
    """
    cap = analysis.captured
    names = layer_names(paths)
    first_use: dict[str, int] = {}
    for i in range(cap.num_params):
        use = analysis.first_use[cap.body_input("params", i)]
        first_use[names[i]] = min(first_use.get(names[i], 10**9), 10**9 if use is None else use)
    order = sorted(first_use, key=lambda n: (first_use[n], n))
    members = [[i for i in range(cap.num_params) if names[i] == n] for n in order]
    avals = [cap.body.invars[cap.body_input("params", i)].aval for i in range(cap.num_params)]
    if measured is not None:
        by_name = {layer.name.replace(".", "/"): layer for layer in measured.layers}
        missing = [n for n in order if n not in by_name]
        if missing:
            raise JaxschedValueError(
                f"layer_profile has no layers named {', '.join(missing)}; its layers "
                f"are {', '.join(by_name)} (use '/' or '.' between path parts)"
            )
        layers = [dataclasses.replace(by_name[n], name=n) for n in order]
        return LayerProfile(layers, {"source": "measured layer profile"}), members
    if flops_per_s is None:
        from jaxsched.plan._profiling import agree_across_processes

        flops_per_s = float(agree_across_processes([measure_flops_per_s(local_device(cap.mesh))])[0])
    flops = forward_flops(analysis)
    layers = []
    for name, group in zip(order, members):
        f = sum(flops[i] for i in group)
        nbytes = sum(math.prod(avals[i].shape) * avals[i].dtype.itemsize for i in group)
        params = sum(math.prod(avals[i].shape) for i in group)
        layers.append(Layer(name, params, nbytes, f / flops_per_s, 2 * f / flops_per_s))
    meta = {"source": "static estimate: forward matmul FLOPs over a measured matmul rate", "flops_per_s": flops_per_s}
    return LayerProfile(layers, meta), members


def step_network_profile(
    analysis: Analysis, network_profile: NetworkProfile | str | None = None, engine_costs: EngineCosts | None = None
) -> NetworkProfile:
    """The network a plan for this step assumes: a preset, a given profile, or one measured on
    the step's mesh (the same on every process), with the engine's fixed cost per collective
    added to every collective's start-up.

    Args:
      analysis: the captured step's analysis (`PlannedStep.analysis`).
      network_profile: a preset name (two-level: the first data axis is the slow one), a
        profile, or None to measure.
      engine_costs: the running engine's fixed costs, if any.

    Returns:
      The `NetworkProfile` to plan with.

    Example:
        >>> from jaxsched.demo import steps
        >>> planned = steps.planned_step_example()
        >>> from jaxsched.plan import step_network_profile
        >>> step_network_profile(planned.analysis, "10gbe").cost("all_reduce").alpha_s
        5e-05
    """
    cap = analysis.captured
    if isinstance(network_profile, str):
        # a two-level preset: the step's first data axis is the slow one, the rest one node
        first = as_axes(cap.axis_name)[0]
        network = network_preset(network_profile, cap.axis_size, per_node=cap.axis_size // cap.mesh.shape[first])
    elif network_profile is None:
        from jaxsched.plan._profiling import agree_on_network, profile_network

        network = agree_on_network(profile_network(cap.mesh, cap.axis_name, repeats=3)[0])
    else:
        network = network_profile
    extra = engine_costs.per_collective_s if engine_costs is not None else 0.0
    if extra:
        network = dataclasses.replace(
            network,
            collectives={
                name: CollectiveCost(cost.alpha_s + extra, cost.beta_s_per_byte)
                for name, cost in network.collectives.items()
            },
            meta={**network.meta, "engine_per_collective_s": extra},
        )
    return network


def with_selection_cost(compression: Any, compressor: Any, mesh: Any) -> Any:
    """The simulator's ``compression`` with the selection time ``compressor`` really takes on
    this process's device of ``mesh`` (the same number on every process).

    Args:
      compression: the simulator's model of the compressor (a `jaxsched.sim.Compression`),
        or None for dense collectives.
      compressor: the compressor whose selection is timed, or None.
      mesh: the step's mesh.

    Returns:
      ``compression`` with ``selection_s_per_byte`` measured; unchanged when it is None,
      has no compressor, or already has a selection cost.

    Example:
        >>> import jax
        >>> from jaxsched.plan import with_selection_cost
        >>> with_selection_cost(None, None, jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])) is None
        True
    """
    if compression is None or compressor is None or compression.selection_s_per_byte:
        return compression
    from jaxsched.plan._profiling import agree_across_processes, measure_selection_s_per_byte

    seconds = float(agree_across_processes([measure_selection_s_per_byte(compressor, local_device(mesh))])[0])
    return dataclasses.replace(compression, selection_s_per_byte=seconds)


def auto_bucket_paths(
    analysis: Analysis,
    paths: Sequence[str],
    strategy: str | CommPattern,
    layer_profile: LayerProfile | None = None,
    network_profile: NetworkProfile | str | None = None,
    planner: str = "optimal",
    compression: Any = None,
    engine_costs: EngineCosts | None = None,
) -> tuple[list[list[str]], LayerProfile, NetworkProfile]:
    """Plan buckets for ``strategy`` (a name or its pattern) and return them as lists of
    parameter paths. ``engine_costs`` (from the engine that will run the step) adds its
    fixed cost per collective, so a staged engine is not cut finer than pays.

    Args:
      analysis: the captured step's analysis (`PlannedStep.analysis`).
      paths: the parameter paths (`PlannedStep.paths`).
      strategy: the strategy name or its `CommPattern`.
      layer_profile: measured layer times, or None for the static estimate.
      network_profile: a preset name, a profile, or None to measure.
      planner: a name of `PLANNERS`.
      compression: the simulator's model of the strategy's compressor, if any.
      engine_costs: the running engine's fixed costs, if any.

    Returns:
      ``(buckets, layer_profile, network_profile)``: the buckets as lists of parameter paths,
      and the profiles they were planned with.

    Example:
        >>> from jaxsched.demo import steps
        >>> planned = steps.planned_step_example()
        >>> from jaxsched.plan import auto_bucket_paths, step_layer_profile
        >>> prof, _ = step_layer_profile(planned.analysis, planned.paths, flops_per_s=1e9)
        >>> auto_bucket_paths(planned.analysis, planned.paths, "wfbp", prof, "10gbe")[0]
        [['hidden/0/bias', 'hidden/0/kernel', 'head/bias', 'head/kernel']]
    """
    profile, members = step_layer_profile(analysis, paths, layer_profile)
    network = step_network_profile(analysis, network_profile, engine_costs)
    groups = plan_buckets(profile, network, planner, strategy=strategy, compression=compression)
    return group_paths(groups, members, paths), profile, network


def group_paths(
    groups: Sequence[Sequence[int]], members: Sequence[Sequence[int]], paths: Sequence[str]
) -> list[list[str]]:
    """A plan's groups of layers as lists of parameter paths (``members``: each layer's
    parameter leaf indices, from `step_layer_profile`): the form explicit bucket plans take.

    Args:
      groups: buckets of layer indices.
      members: each layer's parameter leaf indices.
      paths: the parameter paths.

    Returns:
      One list of parameter paths per bucket.

    Example:
        >>> from jaxsched.plan import group_paths
        >>> group_paths([[0], [1]], [[1], [0, 2]], ["a/w", "b/b", "b/w"])
        [['b/b'], ['a/w', 'b/w']]
    """
    return [[paths[i] for layer in group for i in members[layer]] for group in groups]
