"""``jaxsched.integrations.kfac``: K-FAC for the dense and convolution layers of an ordinary step.

The preconditioner is a strategy (`KFAC`, registered as ``"kfac"``): wrap the step
you already have, and its reduced gradients are preconditioned before your optax update.
Layers are found in the step's jaxpr (`find_layers`); factor all-reduces are
bucketed and issued in backward; inversions are placed across workers
(`plan_placement`). See docs/kfac.md for the conventions and measured numbers.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> step = steps.make_step(apply_fn, tx, mesh)
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> [(layer.name, layer.dims) for layer in find_layers(step, params, tx.init(params), batch).layers]
    [('hidden/0', (65, 16)), ('head', (17, 10))]
    >>> sched = jaxsched.schedule(step, strategy=KFAC(damping=1e-2, factor_buckets="per_layer"))
    >>> state, aux = sched(sched.init(params, tx.init(params)), batch)
    >>> plan_placement([65, 16, 17, 10], 2, "balanced")
    (0, 1, 1, 1)
"""

from __future__ import annotations

from typing import Any, Callable

from jaxsched.sim._kfac_placement import PLACEMENTS, max_load, plan_placement, worker_loads
from jaxsched.core.rewrite._layers import LayerMatch, MatchedLayer
from jaxsched.strategies._kfac import INVERSES, KFAC, KFACFallbackWarning, KFACState


def find_layers(step: Callable, params: Any, opt_state: Any, batch: Any) -> LayerMatch:
    """The dense and convolution layers K-FAC recognises in ``step``.

    Args:
      step: the training step, ``step(params, opt_state, batch)``.
      params: example params (traced, not run).
      opt_state: example optimizer state.
      batch: an example batch, placed as the step takes it.

    Returns:
      A `LayerMatch`: the matched layers (name, factor sizes) and the parameter paths K-FAC
      leaves on the plain gradient. The module's example calls it.

    Example:
      >>> import jax, optax
      >>> import jaxsched
      >>> from jaxsched.demo import steps
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> found = jaxsched.kfac.find_layers(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> [(layer.name, layer.dims) for layer in found.layers]  # dims: (d_A, d_G), a bias row in d_A
      [('hidden/0', (5, 3)), ('head', (4, 2))]
    """
    from jaxsched.core._capture import capture
    from jaxsched.plan._planned_step import PlannedStep
    from jaxsched.core.rewrite._layers import match_layers

    planned = PlannedStep(capture(step, params, opt_state, batch))
    return match_layers(planned.analysis, planned.paths)


__all__ = [
    "INVERSES",
    "KFAC",
    "KFACFallbackWarning",
    "KFACState",
    "LayerMatch",
    "MatchedLayer",
    "PLACEMENTS",
    "find_layers",
    "max_load",
    "plan_placement",
    "worker_loads",
]
