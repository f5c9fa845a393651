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

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.core._axes import axis_size
from jaxsched.demo.config import OptimizerConfig

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
    "replicate",
    "shard_batch",
    "split_batch",
    "Step",
]

Step = Callable[[Any, Any, Any], tuple[Any, Any, Any]]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over every position (works for classes and tokens)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return (jnp.argmax(logits, axis=-1) == labels).mean()


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The optax chain a config names; ``clip_norm`` prepends global-norm clipping."""
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
    """The per-device body: gradients on the local batch, pmean'ed over ``axis``."""

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
    anywhere; the batch's placement tells XLA (and `jaxsched.core.partition`) where to sum."""

    def step(params, opt_state, batch):
        x, y = batch
        loss, logits, grads = _loss_and_grads(apply_fn, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": accuracy(logits, y)}

    return step


def make_jit_step(apply_fn: Callable, tx: optax.GradientTransformation) -> Step:
    """The step as ``jax.jit`` on global arrays: parameters replicated, the batch placed with
    `shard_batch`; XLA's partitioner adds the gradient sums."""
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
    axes when ``axis`` is a tuple, e.g. ``("dcn", "ici")``)."""
    size = axis_size(mesh, axis)
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[0] % size:
            raise JaxschedValueError(
                f"batch leading dimension {leaf.shape[0]} is not divisible by the {size} devices on mesh axis {axis!r}"
            )
    return jax.device_put(batch, NamedSharding(mesh, P(axis)))


def replicate(tree: Any, n: int) -> Any:
    """Stack ``n`` copies of every leaf along a new leading device axis (pmap layout)."""
    return jax.tree.map(lambda leaf: np.stack([np.asarray(leaf)] * n), tree)


def place_replicated(tree: Any, mesh: Mesh) -> Any:
    """Put every leaf on ``mesh``, replicated, as a ``make_step`` step returns it.

    Why: fresh arrays live on one device; the step's outputs are replicated over the mesh.
    A jitted step compiles once per input placement, so starting from fresh arrays makes
    it compile a second time on step 2 (about 1 s on CPU for the demo's MLP).
    """
    return jax.device_put(tree, NamedSharding(mesh, P()))


def place_stacked(tree: Any, devices: list | None = None, axis: str = "data") -> Any:
    """Put stacked leaves (leading device axis) one slice per device, as a ``jax.pmap`` step
    returns them, so that the step compiles once (see `place_replicated`)."""
    devices = list(devices if devices is not None else jax.devices())
    mesh = Mesh(np.array(devices), (axis,))  # pmap's outputs live on an Auto-typed mesh
    return jax.device_put(tree, NamedSharding(mesh, P(axis)))


def split_batch(batch: Any, n: int) -> Any:
    """Reshape a global batch to ``(n, batch // n, ...)`` for a pmap step."""

    def split(leaf):
        leaf = np.asarray(leaf)
        if leaf.shape[0] % n:
            raise JaxschedValueError(f"batch leading dimension {leaf.shape[0]} is not divisible by {n} devices")
        return leaf.reshape(n, leaf.shape[0] // n, *leaf.shape[1:])

    return jax.tree.map(split, batch)
