"""A small model zoo in Flax NNX, plus the pure-function view a shard_map step needs.

Each model is an ordinary ``nnx.Module``. Data-parallel steps work on plain pytrees,
so `pure` splits a module into ``(params, apply_fn)`` where ``params`` is a
nested dict of arrays and ``apply_fn(params, x)`` is a pure function.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsched.zoo.models import MLP, pure
    >>> params, apply_fn = pure(MLP(64, 10, hidden=(32,), rngs=nnx.Rngs(0)))
    >>> apply_fn(params, jnp.ones((2, 64))).shape
    (2, 10)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsched._errors import JaxschedValueError

__all__ = [
    "ApplyFn",
    "build",
    "CNN",
    "MLP",
    "MODELS",
    "Params",
    "pure",
    "ResidualBlock",
    "TransformerBlock",
    "TransformerLM",
]

Params = Any
ApplyFn = Callable[[Params, jax.Array], jax.Array]


class MLP(nnx.Module):
    """Fully connected classifier; flattens any input shape after the batch axis.

    Args:
      in_features: inputs per example, after flattening.
      num_classes: logits per example.
      hidden: the hidden layers' widths (ReLU after each).
      rngs: the parameters' random streams.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxsched.zoo import models
      >>> mlp = nnx.eval_shape(lambda: models.MLP(64, 10, hidden=(32,), rngs=nnx.Rngs(0)))  # shapes only
      >>> nnx.eval_shape(lambda m, x: m(x), mlp, jnp.ones((2, 8, 8, 1))).shape
      (2, 10)
    """

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (128, 128), *, rngs: nnx.Rngs):
        sizes = [in_features, *hidden]
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])
        self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.hidden:
            x = jax.nn.relu(layer(x))
        return self.head(x)


class ResidualBlock(nnx.Module):
    """conv-relu-conv with an identity skip. No batch statistics, so steps stay pure.

    Args:
      channels: input and output channels (NHWC).
      rngs: the parameters' random streams.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxsched.zoo import models
      >>> block = nnx.eval_shape(lambda: models.ResidualBlock(4, rngs=nnx.Rngs(0)))  # shapes only
      >>> nnx.eval_shape(lambda m, x: m(x), block, jnp.ones((1, 8, 8, 4))).shape
      (1, 8, 8, 4)
    """

    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x + self.conv2(jax.nn.relu(self.conv1(x))))


class CNN(nnx.Module):
    """Small residual CNN for NHWC images.

    Args:
      in_channels: the images' channels.
      num_classes: logits per example.
      channels: channels of every residual block.
      blocks: how many residual blocks (`ResidualBlock`).
      rngs: the parameters' random streams.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxsched.zoo import models
      >>> cnn = nnx.eval_shape(lambda: models.CNN(3, 10, channels=8, blocks=1, rngs=nnx.Rngs(0)))  # shapes only
      >>> nnx.eval_shape(lambda m, x: m(x), cnn, jnp.ones((2, 16, 16, 3))).shape
      (2, 10)
    """

    def __init__(self, in_channels: int, num_classes: int, channels: int = 16, blocks: int = 2, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(in_channels, channels, (3, 3), rngs=rngs)
        self.blocks = nnx.List([ResidualBlock(channels, rngs=rngs) for _ in range(blocks)])
        self.head = nnx.Linear(channels, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class TransformerBlock(nnx.Module):
    """Pre-norm causal self-attention and MLP.

    Args:
      dim: the model width.
      heads: attention heads; must divide ``dim``.
      rngs: the parameters' random streams.

    Raises:
      JaxschedValueError: ``dim`` not divisible by ``heads``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxsched.zoo import models
      >>> block = nnx.eval_shape(lambda: models.TransformerBlock(16, 4, rngs=nnx.Rngs(0)))  # shapes only
      >>> nnx.eval_shape(lambda m, x: m(x), block, jnp.ones((2, 5, 16))).shape
      (2, 5, 16)
    """

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        if dim % heads:
            raise JaxschedValueError(f"model.dim={dim} is not divisible by model.heads={heads}")
        self.heads = heads
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        # No qkv bias: the key bias gets an exactly-zero gradient (softmax is shift-invariant),
        # which adaptive optimizers would turn into amplified rounding noise.
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / jnp.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), split(v))
        x = x + self.proj(attended.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
    """Small decoder-only language model; returns next-token logits.

    Args:
      vocab_size: tokens in the vocabulary (logits per position).
      seq_len: the longest sequence (learned positions).
      dim: the model width.
      heads: attention heads per block.
      layers: how many `TransformerBlock` layers.
      rngs: the parameters' random streams.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxsched.zoo import models
      >>> lm = nnx.eval_shape(lambda: models.TransformerLM(64, 8, dim=16, heads=2, layers=1, rngs=nnx.Rngs(0)))
      >>> nnx.eval_shape(lambda m, x: m(x), lm, jnp.zeros((2, 8), "int32")).shape
      (2, 8, 64)
    """

    def __init__(
        self, vocab_size: int, seq_len: int, dim: int = 64, heads: int = 4, layers: int = 2, *, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
        self.blocks = nnx.List([TransformerBlock(dim, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def pure(model: nnx.Module) -> tuple[Params, ApplyFn]:
    """Split a Flax NNX module into a params dict and a pure ``apply_fn(params, x)``.

    Args:
      model: the module (`build` makes the zoo's).

    Returns:
      ``(params, apply_fn)``: the module's state as a plain nested dict, and a function that
      runs the module with any params of that structure (what a jitted step differentiates).

    Example:
        >>> import jax
        >>> params, apply_fn = pure(build("mlp", (4,), 3, hidden=(8,)))
        >>> apply_fn(params, jax.numpy.ones((2, 4))).shape
        (2, 3)
    """
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def apply_fn(params: Params, x: jax.Array) -> jax.Array:
        merged_state = jax.tree.map(lambda leaf: leaf, state)
        nnx.replace_by_pure_dict(merged_state, params)
        return nnx.merge(graphdef, merged_state)(x)

    return params, apply_fn


MODELS = ("mlp", "cnn", "transformer")


def build(name: str, input_shape: tuple[int, ...], num_outputs: int, seed: int = 0, **options: Any) -> nnx.Module:
    """Build a zoo model by name for inputs of ``input_shape`` (without the batch axis).

    For ``transformer`` the input shape is ``(seq_len,)`` and ``num_outputs`` the vocabulary.

    Args:
      name: one of `MODELS`: ``mlp``, ``cnn``, ``transformer``.
      input_shape: one example's shape (NHWC images, or ``(seq_len,)``).
      num_outputs: classes, or the vocabulary.
      seed: the parameters' seed.
      **options: the model's own options (``hidden=`` for ``mlp``, ``dim=``, ``layers=`` ...).

    Returns:
      The ``nnx.Module`` (`pure` turns it into ``(params, apply_fn)``).

    Raises:
      JaxschedValueError: an unknown name, or options the model does not take.

    Example:
      >>> from jaxsched.zoo import models
      >>> type(models.build("mlp", (8, 8, 1), 10, hidden=(16,))).__name__
      'MLP'
      >>> from flax import nnx
      >>> lm = nnx.eval_shape(lambda: models.build("transformer", (8,), 64, dim=16, layers=1))  # shapes only
      >>> lm.head.kernel.shape  # dim x vocabulary
      (16, 64)
    """
    rngs = nnx.Rngs(seed)
    try:
        if name == "mlp":
            size = 1
            for dim in input_shape:
                size *= dim
            return MLP(size, num_outputs, rngs=rngs, **options)
        if name == "cnn":
            return CNN(input_shape[-1], num_outputs, rngs=rngs, **options)
        if name == "transformer":
            return TransformerLM(num_outputs, input_shape[0], rngs=rngs, **options)
    except TypeError as err:
        raise JaxschedValueError(f"model options {sorted(options)} do not fit model {name!r}: {err}") from None
    raise JaxschedValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
