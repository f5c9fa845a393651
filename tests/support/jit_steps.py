"""Data-parallel steps written the way the JAX and Flax docs teach: ``jax.jit`` on global
arrays, the batch placed with ``NamedSharding(mesh, P("data"))``, no ``shard_map``."""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["Cnn", "TinyLM", "cnn_state_step", "lm_step", "mlp_params", "mlp_step", "place", "replicated"]


def place(mesh, batch, spec=P("data")):
    return jax.device_put(batch, NamedSharding(mesh, spec))


def replicated(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


# -- an MLP, (params, opt_state, batch) -> (params, opt_state, aux) -------------------------
def mlp_params(seed=0, features=6, hidden=16, classes=3):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((features, hidden)).astype(np.float32) * 0.3,
        "b1": np.zeros(hidden, np.float32),
        "w2": rng.standard_normal((hidden, classes)).astype(np.float32) * 0.3,
    }


def mlp_loss(p, x, y):
    logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def mlp_step(tx, donate=False):
    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def mlp_batches(seed, n, rows, features=6, classes=3):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((rows, features)).astype(np.float32), rng.integers(0, classes, rows).astype(np.int32))
        for _ in range(n)
    ]


# -- a CNN with BatchNorm over the global batch and dropout ---------------------------------
class Cnn(nn.Module):
    classes: int = 5

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(6, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(0.3, deterministic=not train)(x)
        x = nn.Dense(16)(x)
        x = jnp.tanh(x)
        return nn.Dense(self.classes)(x)


def cnn_state(seed=0, tx=None):
    model = Cnn()
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 2)), train=False)
    tx = tx or optax.sgd(0.05, momentum=0.9)
    return (
        {
            "params": variables["params"],
            "batch_stats": variables["batch_stats"],
            "opt_state": tx.init(variables["params"]),
            "step": jnp.zeros((), jnp.int32),
            "key": jax.random.key(seed + 1),
        },
        model,
        tx,
    )


def cnn_state_step(model, tx):
    @jax.jit
    def step(state, batch):
        x, y = batch
        dropout_key = jax.random.fold_in(state["key"], state["step"])

        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state["batch_stats"]},
                x,
                train=True,
                rngs={"dropout": dropout_key},
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy(
                logits, optax.smooth_labels(jax.nn.one_hot(y, logits.shape[-1]), 0.1)
            ).mean()
            return loss, (logits, updates["batch_stats"])

        (loss, (logits, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {
            "params": optax.apply_updates(state["params"], updates),
            "batch_stats": stats,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "key": state["key"],
        }
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return new, {"loss": loss, "accuracy": accuracy}

    return step


def cnn_batches(seed, n, rows, classes=5):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((rows, 8, 8, 2)).astype(np.float32), rng.integers(0, classes, rows).astype(np.int32))
        for _ in range(n)
    ]


# -- a small Transformer LM: padding masks, a global token count, label smoothing,
#    global-norm clipping, a schedule, layers in a scan under jax.checkpoint -----------------
class Block(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, h, mask):
        y = nn.LayerNorm()(h)
        # no bias: the keys' bias has a zero gradient (softmax ignores it), which Adam would
        # turn into updates of pure rounding noise
        y = nn.SelfAttention(num_heads=2, qkv_features=self.dim, deterministic=True, use_bias=False)(y, mask=mask)
        h = h + y
        y = nn.LayerNorm()(h)
        y = nn.Dense(2 * self.dim)(y)
        return h + nn.Dense(self.dim)(jax.nn.gelu(y)), None


class TinyLM(nn.Module):
    vocab: int = 13
    dim: int = 16
    layers: int = 2

    @nn.compact
    def __call__(self, tokens, padding):
        h = nn.Embed(self.vocab, self.dim)(tokens)
        h = h + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        causal = nn.make_causal_mask(tokens)
        mask = nn.combine_masks(causal, nn.make_attention_mask(padding, padding))
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=self.layers,
        )
        h, _ = blocks(self.dim, name="blocks")(h, mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def lm_setup(seed=0, seq=6):
    model = TinyLM()
    params = model.init(jax.random.key(seed), jnp.zeros((1, seq), jnp.int32), jnp.ones((1, seq), bool))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 20)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.01))
    return model, params, tx


def lm_step(model, tx):
    @jax.jit
    def step(params, opt_state, batch):
        tokens, targets, padding = batch

        def loss_fn(p):
            logits = model.apply({"params": p}, tokens, padding)
            labels = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), 0.1)
            per_token = optax.softmax_cross_entropy(logits, labels)
            weights = padding.astype(jnp.float32)
            return jnp.sum(per_token * weights) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return step


def lm_batches(seed, n, rows, seq=6, vocab=13):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
        lengths = rng.integers(2, seq + 1, rows)
        padding = np.arange(seq)[None, :] < lengths[:, None]
        out.append((tokens, np.roll(tokens, -1, 1), padding))
    return out
