"""The reference data-parallel training step, written the way users write it today.

``make_step`` returns ``step(params, opt_state, batch) -> (params, opt_state, aux)``:
``jax.value_and_grad`` on the local shard of the batch, ``lax.pmean`` of the gradients
and metrics over the mesh axis, then an optax update. ``make_jit_step`` is the same step
on global arrays under ``jax.jit``, the batch's sharding telling XLA where to sum. Every
scheduling strategy is compared against these steps.

Example:
    >>> import jax, optax
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> step = steps.make_step(apply_fn, optax.sgd(0.1), mesh)
    >>> x, y = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> params, opt_state, aux = step(params, optax.sgd(0.1).init(params), (x, y))
    >>> sorted(aux)
    ['accuracy', 'loss']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.core._axes import axis_size
from jaxsched.demo.config import OptimizerConfig

if TYPE_CHECKING:
    from jaxsched.plan import PlannedStep
    from jaxsched.strategies import Strategy

__all__ = [
    "accuracy",
    "cross_entropy",
    "global_step_fn",
    "local_step_fn",
    "make_jit_step",
    "make_optimizer",
    "make_pmap_step",
    "make_step",
    "place_replicated",
    "place_stacked",
    "planned_example",
    "planned_step_example",
    "replicate",
    "shard_batch",
    "split_batch",
    "Step",
]

Step = Callable[[Any, Any, Any], tuple[Any, Any, Any]]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over every position (works for classes and tokens).

    Args:
      logits: ``(..., classes)``.
      labels: integer labels, ``logits``'s shape without the last axis.

    Returns:
      The mean loss, a scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> round(float(steps.cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))), 4)  # log 4
      1.3863
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The fraction of positions whose largest logit is the label.

    Args:
      logits: ``(..., classes)``.
      labels: integer labels.

    Returns:
      A scalar in [0, 1].

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> float(steps.accuracy(jnp.array([[0.0, 1.0], [1.0, 0.0]]), jnp.array([1, 1])))
      0.5
    """
    return (jnp.argmax(logits, axis=-1) == labels).mean()


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The optax chain a config names; ``clip_norm`` prepends global-norm clipping.

    Args:
      cfg: the ``[optimizer]`` table of a demo config: ``sgd``, ``momentum``, ``adam`` or
        ``adamw``, with its learning rate and options.

    Returns:
      The optax transformation.

    Raises:
      JaxschedValueError: an unknown optimizer name.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.demo import config, steps
      >>> tx = steps.make_optimizer(config.OptimizerConfig(name="sgd", learning_rate=0.1, clip_norm=1.0))
      >>> len(tx.init(jnp.ones(2))[1])  # clipping, then sgd
      2
    """
    if cfg.name == "sgd":
        tx = optax.sgd(cfg.learning_rate)
    elif cfg.name == "momentum":
        tx = optax.sgd(cfg.learning_rate, momentum=cfg.momentum)
    elif cfg.name == "adam":
        tx = optax.adam(cfg.learning_rate)
    elif cfg.name == "adamw":
        tx = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)
    else:
        raise JaxschedValueError(f"optimizer.name={cfg.name!r} is unknown")
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return tx


def _loss_and_grads(apply_fn: Callable, params: Any, x: Any, y: Any) -> tuple:
    """Cross-entropy, logits and gradients on the batch this code sees (local or global)."""

    def loss_fn(p):
        logits = apply_fn(p, x)
        return cross_entropy(logits, y), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, logits, grads


def local_step_fn(apply_fn: Callable, tx: optax.GradientTransformation, axis: str | tuple[str, ...]) -> Step:
    """The per-device body: gradients on the local batch, pmean'ed over ``axis``.

    `make_step` wraps it in ``jax.shard_map`` and ``jax.jit``; `make_pmap_step` in ``jax.pmap``.

    Args:
      apply_fn: the model, ``apply_fn(params, x) -> logits``.
      tx: the optax optimizer.
      axis: the mesh axis (or axes) the gradients and metrics are averaged over.

    Returns:
      ``local_step(params, opt_state, batch) -> (params, opt_state, aux)``.

    Example:
      >>> import jax, optax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxsched.demo import steps
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
      >>> tx = optax.sgd(0.1)
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> body = steps.local_step_fn(apply_fn, tx, "data")
      >>> step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(), check_vma=False))
      >>> batch = steps.shard_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), mesh)
      >>> sorted(step(params, tx.init(params), batch)[2])
      ['accuracy', 'loss']
    """

    def local_step(params, opt_state, batch):
        x, y = batch
        loss, logits, grads = _loss_and_grads(apply_fn, params, x, y)
        grads = lax.pmean(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        aux = {"loss": lax.pmean(loss, axis), "accuracy": lax.pmean(accuracy(logits, y), axis)}
        return params, opt_state, aux

    return local_step


def make_step(
    apply_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, axis: str | tuple[str, ...] = "data"
) -> Step:
    """A jitted ``jax.shard_map`` step: replicated params/opt_state, batch sharded on ``axis``.

    Args:
      apply_fn: the model, ``apply_fn(params, x) -> logits`` (as `jaxsched.zoo.models.pure` gives).
      tx: the optax optimizer.
      mesh: the devices; the batch's leading axis is split over ``axis``.
      axis: one mesh axis, or a tuple such as ``("dcn", "ici")``: data parallel over several.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, aux)``, cross entropy loss,
      gradients averaged with ``lax.pmean``; ``aux`` holds ``loss`` and ``accuracy``.

    Example:
        >>> import jax, optax
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> step = make_step(apply_fn, optax.sgd(0.1), mesh)
        >>> batch = shard_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), mesh)
        >>> params, opt_state, aux = step(params, optax.sgd(0.1).init(params), batch)
        >>> sorted(aux)
        ['accuracy', 'loss']
    """
    body = local_step_fn(apply_fn, tx, axis)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=(P(), P(), P()), check_vma=False)
    )


def global_step_fn(apply_fn: Callable, tx: optax.GradientTransformation) -> Step:
    """The same step on global arrays, as the JAX sharding tutorial writes it: no collective
    anywhere; the batch's placement tells XLA (and `jaxsched.core.partition`) where to sum.

    Args:
      apply_fn: the model, ``apply_fn(params, x) -> logits``.
      tx: the optax optimizer.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, aux)``, not jitted.

    Example:
      >>> import jax, optax
      >>> from jaxsched.demo import steps
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
      >>> tx = optax.sgd(0.1)
      >>> step = jax.jit(steps.global_step_fn(apply_fn, tx))
      >>> _, _, aux = step(params, tx.init(params), (jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")))
      >>> sorted(aux)
      ['accuracy', 'loss']
    """

    def step(params, opt_state, batch):
        x, y = batch
        loss, logits, grads = _loss_and_grads(apply_fn, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": accuracy(logits, y)}

    return step


def make_jit_step(apply_fn: Callable, tx: optax.GradientTransformation) -> Step:
    """The step as ``jax.jit`` on global arrays: parameters replicated, the batch placed with
    `shard_batch`; XLA's partitioner adds the gradient sums.

    Args:
      apply_fn: the model, ``apply_fn(params, x) -> logits``.
      tx: the optax optimizer.

    Returns:
      The jitted `global_step_fn`.

    Example:
      >>> import jax, optax
      >>> from jaxsched.demo import steps
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
      >>> tx = optax.sgd(0.1)
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
      >>> batch = steps.shard_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), mesh)
      >>> _, _, aux = steps.make_jit_step(apply_fn, tx)(params, tx.init(params), batch)
      >>> sorted(aux)
      ['accuracy', 'loss']
    """
    return jax.jit(global_step_fn(apply_fn, tx))


def make_pmap_step(
    apply_fn: Callable, tx: optax.GradientTransformation, axis: str = "data", devices: list | None = None
) -> Step:
    """The same step as `make_step` with ``jax.pmap``: every input carries a leading device axis.

    Args:
      apply_fn: the model, ``apply_fn(params, x) -> logits``.
      tx: the optax optimizer.
      axis: the pmap axis name the gradients are averaged over.
      devices: the devices to map over (default: all).

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, aux)`` over stacked inputs
      (`replicate` the trees, `split_batch` the batch).

    Example:
        >>> import jax, optax
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
        >>> tx = optax.sgd(0.1)
        >>> step = make_pmap_step(apply_fn, tx, devices=jax.devices()[:2])
        >>> batch = split_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), 2)
        >>> params2, opt_state, aux = step(replicate(params, 2), replicate(tx.init(params), 2), batch)
        >>> aux["loss"].shape
        (2,)
    """
    return jax.pmap(local_step_fn(apply_fn, tx, axis), axis_name=axis, devices=devices)


def shard_batch(batch: Any, mesh: Mesh, axis: str | tuple[str, ...] = "data") -> Any:
    """Place a global batch on the mesh, split along its leading axis (over several mesh
    axes when ``axis`` is a tuple, e.g. ``("dcn", "ici")``).

    Args:
      batch: a tree of global arrays with the batch on their leading axis.
      mesh: the mesh.
      axis: the mesh axis (or axes) the batch is split over.

    Returns:
      The batch, placed.

    Raises:
      JaxschedValueError: a leading dimension not divisible by the devices on ``axis``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> x, y = steps.shard_batch((jnp.ones((4, 3)), jnp.zeros(4, "int32")), mesh)
      >>> x.addressable_shards[0].data.shape  # two examples per device
      (2, 3)
    """
    size = axis_size(mesh, axis)
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[0] % size:
            raise JaxschedValueError(
                f"batch leading dimension {leaf.shape[0]} is not divisible by the {size} devices on mesh axis {axis!r}"
            )
    return jax.device_put(batch, NamedSharding(mesh, P(axis)))


def replicate(tree: Any, n: int) -> Any:
    """Stack ``n`` copies of every leaf along a new leading device axis (pmap layout).

    Args:
      tree: the params or optimizer state.
      n: devices.

    Returns:
      The stacked tree (numpy arrays).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> steps.replicate({"w": jnp.ones(3)}, 2)["w"].shape
      (2, 3)
    """
    return jax.tree.map(lambda leaf: np.stack([np.asarray(leaf)] * n), tree)


def place_replicated(tree: Any, mesh: Mesh) -> Any:
    """Put every leaf on ``mesh``, replicated, as a ``make_step`` step returns it.

    Why: fresh arrays live on one device; the step's outputs are replicated over the mesh.
    A jitted step compiles once per input placement, so starting from fresh arrays makes
    it compile a second time on step 2 (about 1 s on CPU for the demo's MLP).

    Args:
      tree: the params or optimizer state.
      mesh: the mesh the step runs on.

    Returns:
      The tree, replicated on ``mesh``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> steps.place_replicated({"w": jnp.ones(3)}, mesh)["w"].sharding.is_fully_replicated
      True
    """
    return jax.device_put(tree, NamedSharding(mesh, P()))


def place_stacked(tree: Any, devices: list | None = None, axis: str = "data") -> Any:
    """Put stacked leaves (leading device axis) one slice per device, as a ``jax.pmap`` step
    returns them, so that the step compiles once (see `place_replicated`).

    Args:
      tree: stacked leaves (from `replicate`).
      devices: the pmap step's devices (default: all).
      axis: the name of the mesh axis the slices are placed over.

    Returns:
      The tree, one slice per device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> placed = steps.place_stacked(steps.replicate({"w": jnp.ones(3)}, 2), jax.devices()[:2])
      >>> len(placed["w"].addressable_shards), placed["w"].addressable_shards[0].data.shape
      (2, (1, 3))
    """
    devices = list(devices if devices is not None else jax.devices())
    mesh = Mesh(np.array(devices), (axis,))  # pmap's outputs live on an Auto-typed mesh
    return jax.device_put(tree, NamedSharding(mesh, P(axis)))


def split_batch(batch: Any, n: int) -> Any:
    """Reshape a global batch to ``(n, batch // n, ...)`` for a pmap step.

    Args:
      batch: a tree of global arrays with the batch on their leading axis.
      n: devices.

    Returns:
      The batch with a leading device axis (numpy arrays).

    Raises:
      JaxschedValueError: a leading dimension not divisible by ``n``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.demo import steps
      >>> x, y = steps.split_batch((jnp.ones((4, 3)), jnp.zeros(4, "int32")), 2)
      >>> x.shape, y.shape
      ((2, 2, 3), (2, 2))
    """

    def split(leaf):
        leaf = np.asarray(leaf)
        if leaf.shape[0] % n:
            raise JaxschedValueError(f"batch leading dimension {leaf.shape[0]} is not divisible by {n} devices")
        return leaf.reshape(n, leaf.shape[0] // n, *leaf.shape[1:])

    return jax.tree.map(split, batch)


def planned_example(strategy: Strategy) -> tuple[Strategy, PlannedStep]:
    """A tiny MLP's step (4 features, one hidden layer of 3, 2 classes, sgd) on the first 2
    devices, captured and planned for ``strategy`` as `jaxsched.schedule` would.

    What a strategy's hooks take (``rewrite``, ``convert``, ``finalize``, ...): their
    examples start from it instead of repeating the capture and the selection.

    Args:
      strategy: a `jaxsched.strategies.Strategy` instance.

    Returns:
      ``(strategy, planned)``: the strategy as selection set it up for this step (its own
      copy, possibly specialised for the mesh) and the `jaxsched.plan.PlannedStep`.

    Example:
      >>> from jaxsched.demo import steps
      >>> from jaxsched.strategies import Wfbp
      >>> wfbp, planned = steps.planned_example(Wfbp())
      >>> wfbp.name, planned.axis_size
      ('wfbp', 2)
    """
    from jaxsched.pipeline._selection import select
    from jaxsched.runtime.engine import make_engine

    chosen = select(_captured_example(), strategy, None, make_engine("xla"))
    return chosen.strategy, chosen.planned


def planned_step_example() -> PlannedStep:
    """`planned_example`'s step, captured and planned for no strategy: what the planning
    stage's examples start from.

    Returns:
      The `jaxsched.plan.PlannedStep` of a tiny MLP's step (4 features, one hidden layer of
      3, 2 classes, sgd) on the first 2 devices, one row per device.

    Example:
      >>> from jaxsched.demo import steps
      >>> planned = steps.planned_step_example()
      >>> planned.axis_size, len(planned.paths)
      (2, 4)
    """
    from jaxsched.plan import PlannedStep

    return PlannedStep(_captured_example())


def _captured_example() -> Any:
    """The captured step of `planned_example` and `planned_step_example`."""
    from jaxsched.core._capture import capture
    from jaxsched.zoo import models

    params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = optax.sgd(0.1)
    batch = shard_batch((jnp.ones((2, 4)), jnp.zeros(2, "int32")), mesh)
    return capture(make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
