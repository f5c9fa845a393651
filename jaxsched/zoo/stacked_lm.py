"""A decoder-only language model whose layers are stacked on a leading axis, as MaxText writes
it: run by ``lax.scan`` over the stack with ``jax.checkpoint`` (or unrolled), the weights
sharded for FSDP over ``"fsdp"`` and, for HSDP, replicated over ``"data"`` with the batch over
both. Plain functions on a dict of arrays, so that the same step serves real training on CPU
devices and ahead-of-time compiles for clusters we do not have.

Example:
    >>> import jax, optax
    >>> config = StackedLM(dim=16, mlp=32, layers=2, heads=2, vocab=32, seq=8)
    >>> mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> params = init(config, mesh, seed=0)
    >>> params["layers"]["w1"].shape, params["layers"]["w1"].sharding.spec
    ((2, 16, 32), P(None, 'fsdp', None))
    >>> tx = optax.adamw(1e-3)
    >>> step = make_step(config, tx, mesh)
    >>> batch = synthetic_batch(config, mesh, rows=4, seed=1)
    >>> params, opt_state, aux = step(params, tx.init(params), batch)
    >>> bool(aux["loss"] > 0)
    True
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["StackedLM", "abstract", "batch_spec", "init", "make_step", "param_specs", "synthetic_batch"]


@dataclasses.dataclass(frozen=True)
class StackedLM:
    """The model's sizes and how its layers run.

    Attributes:
      dim, mlp, layers, heads, vocab, seq: width, feed-forward width, depth, attention heads,
        vocabulary and sequence length.
      scan: ``lax.scan`` over the stacked layers (False: a Python loop, unrolled).
      remat: ``jax.checkpoint`` each layer (recomputed in backward).
    """

    dim: int = 1024
    mlp: int = 4096
    layers: int = 8
    heads: int = 8
    vocab: int = 8192
    seq: int = 512
    scan: bool = True
    remat: bool = True

    def shapes(self) -> dict:
        d, f, n = self.dim, self.mlp, self.layers
        return {
            "embed": (self.vocab, d),
            "layers": {
                "wqkv": (n, d, 3 * d),
                "wo": (n, d, d),
                "w1": (n, d, f),
                "w2": (n, f, d),
                "ln1": (n, d),
                "ln2": (n, d),
            },
            "ln_f": (d,),
        }

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's weights gathered whole (float32)."""
        d, f = self.dim, self.mlp
        return 4 * (3 * d * d + d * d + 2 * d * f + 2 * d)


def param_specs(config: StackedLM) -> dict:
    """FSDP: every matrix split over ``"fsdp"`` along its input dimension (the stack axis and
    the norms' scales replicated, as MaxText's ``embed`` axis maps to ``fsdp``)."""
    del config
    fsdp = P(None, "fsdp", None)
    return {
        "embed": P("fsdp", None),
        "layers": {"wqkv": fsdp, "wo": fsdp, "w1": fsdp, "w2": fsdp, "ln1": P(), "ln2": P()},
        "ln_f": P(),
    }


def batch_spec(mesh: Mesh) -> P:
    """The batch over every data axis of the mesh: ``("data", "fsdp")`` for HSDP."""
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    return P(axes[0] if len(axes) == 1 else axes)


def init(config: StackedLM, mesh: Mesh, seed: int = 0) -> dict:
    """Parameters drawn on the host and placed with `param_specs` on ``mesh``: matrices
    normal over the square root of their input width, norm scales one."""
    rng = np.random.default_rng(seed)
    shapes = config.shapes()
    scales = {"ln1", "ln2", "ln_f"}

    def draw(path: tuple, shape: tuple) -> np.ndarray:
        if str(getattr(path[-1], "key", "")) in scales:
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    values = jax.tree_util.tree_map_with_path(draw, shapes, is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.map(
        lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec)),
        values,
        param_specs(config),
        is_leaf=lambda x: isinstance(x, np.ndarray),
    )


def abstract(config: StackedLM, mesh: Mesh, tx: optax.GradientTransformation, rows_per_device: int) -> tuple:
    """``(params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` with their shardings: what
    ``sched.inspect`` compiles for a cluster ahead of time. Optimizer moments are placed like
    the parameters they follow, scalars replicated."""
    specs = param_specs(config)
    params = jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)),
        config.shapes(),
        specs,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    by_shape = {tuple(a.shape): a.sharding for a in jax.tree.leaves(params)}
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=by_shape.get(tuple(a.shape), NamedSharding(mesh, P()))
        ),
        jax.eval_shape(tx.init, params),
    )
    rows = rows_per_device * mesh.devices.size
    sharding = NamedSharding(mesh, batch_spec(mesh))
    batch = tuple(jax.ShapeDtypeStruct((rows, config.seq), jnp.int32, sharding=sharding) for _ in range(2))
    return params, opt_state, batch


def synthetic_batch(config: StackedLM, mesh: Mesh, rows: int, seed: int = 0) -> tuple:
    """Random tokens and their targets, placed over the mesh's data axes."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab, (rows, config.seq)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    return jax.device_put((tokens, targets), NamedSharding(mesh, batch_spec(mesh)))


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _batch_constraint(mesh: Mesh | None) -> Callable[[jax.Array], jax.Array]:
    """Activations kept split over the data axes, as MaxText's logical constraints keep them:
    without it XLA's propagation may split them like the weights that touch them, and then
    replicate whole tensors to undo it."""
    if mesh is None:
        return lambda x: x
    sharding = NamedSharding(mesh, batch_spec(mesh))
    return lambda x: jax.lax.with_sharding_constraint(x, sharding)


def layer(config: StackedLM, h: jax.Array, p: dict, mesh: Mesh | None = None) -> jax.Array:
    """One pre-norm decoder layer: causal attention, then a GELU feed-forward."""
    constrain = _batch_constraint(mesh)
    h = constrain(h)
    rows, seq, dim = h.shape
    heads = config.heads
    x = _rms(h, p["ln1"])
    q, k, v = jnp.split(x @ p["wqkv"], 3, -1)
    split = lambda t: constrain(t.reshape(rows, seq, heads, dim // heads))
    scores = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / np.sqrt(dim // heads)
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    scores = constrain(scores)
    attended = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), split(v)).reshape(rows, seq, dim)
    h = constrain(h + attended @ p["wo"])
    return constrain(h + jax.nn.gelu(constrain(_rms(h, p["ln2"]) @ p["w1"])) @ p["w2"])


def loss(config: StackedLM, params: dict, tokens: jax.Array, targets: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    constrain = _batch_constraint(mesh)
    h = constrain(params["embed"][tokens])
    body: Callable = lambda h, p: (layer(config, h, p, mesh), None)
    if config.remat:
        body = jax.checkpoint(body)
    if config.scan:
        h, _ = jax.lax.scan(body, h, params["layers"])
    else:
        for i in range(config.layers):
            h, _ = body(h, jax.tree.map(lambda a: a[i], params["layers"]))
    logits = constrain(_rms(h, params["ln_f"]) @ params["embed"].T)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(config: StackedLM, tx: optax.GradientTransformation, mesh: Mesh | None = None) -> Callable:
    """The training step as MaxText's is written: ``jax.jit`` on global arrays, no collective.
    Given the ``mesh``, activations are constrained to the batch's split (MaxText's logical
    activation constraints); without it XLA propagates shardings as it likes."""

    @jax.jit
    def train_step(params, opt_state, batch):
        tokens, targets = batch
        value, grads = jax.value_and_grad(lambda p: loss(config, p, tokens, targets, mesh))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value}

    return train_step
