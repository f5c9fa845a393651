"""`jax.jit` steps whose parameters are sharded, written as large runs write them: FSDP over one
axis, HSDP (FSDP inside a replica, data parallelism across), tensor parallelism beside data
parallelism, a scanned and rematerialised FSDP layer stack. The parameters and the optimizer
state carry the shardings; the step has no collective in it."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

__all__ = ["LAYOUTS", "Layout", "mlp_step", "params_for", "place", "scanned_params", "scanned_step", "state_bytes"]

FEATURES, HIDDEN, OUT = 16, 32, 8


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and where the batch and each MLP parameter live on it."""

    shape: tuple
    names: tuple
    batch: P
    params: dict
    constraint: P | None = None  # of the hidden activation (tensor parallelism)
    explicit: bool = False

    def mesh(self):
        kind = AxisType.Explicit if self.explicit else AxisType.Auto
        n = int(np.prod(self.shape))
        return jax.make_mesh(self.shape, self.names, axis_types=(kind,) * len(self.shape), devices=jax.devices()[:n])

    def context(self, mesh):
        """``jax.set_mesh`` for an Explicit mesh (its steps reshard with bare specs)."""
        return jax.set_mesh(mesh) if self.explicit else contextlib.nullcontext()


LAYOUTS = {
    "fsdp": Layout((8,), ("fsdp",), P("fsdp"), {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None)}),
    "hsdp": Layout(
        (2, 4), ("data", "fsdp"), P(("data", "fsdp")), {"w1": P("fsdp", None), "b1": P(), "w2": P(None, "fsdp")}
    ),
    "tensor": Layout(
        (4, 2),
        ("data", "tensor"),
        P("data"),
        {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None)},
        constraint=P(None, "tensor"),
    ),
    "tensor_explicit": Layout(
        (4, 2),
        ("data", "tensor"),
        P("data"),
        {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None)},
        constraint=P("data", "tensor"),
        explicit=True,
    ),
    "tensor_fsdp": Layout(
        (4, 2),
        ("fsdp", "tensor"),
        P("fsdp"),
        {"w1": P("tensor", "fsdp"), "b1": P("tensor"), "w2": P("fsdp", "tensor")},
        constraint=P(None, "tensor"),
    ),
    # MaxText's and EasyLM's data-parallel runs: model axes of size one name nothing
    "unit_axes": Layout(
        (8, 1, 1),
        ("data", "fsdp", "tensor"),
        P(("data", "fsdp")),
        {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")},
    ),
}


def params_for(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((HIDDEN, OUT)).astype(np.float32) * 0.3,
    }


def place(mesh, tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def batches(mesh, spec, n, seed, rows=32):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
        y = rng.standard_normal((rows, OUT)).astype(np.float32)
        out.append(jax.device_put((x, y), NamedSharding(mesh, spec)))
    return out


def mlp_step(tx, layout: Layout, mesh, dropout=False):
    """An MLP step with a key in the batch when ``dropout``: its bits must match the plain step's."""

    def step(params, opt_state, batch):
        x, y = batch[:2]

        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"] + p["b1"])
            if layout.constraint is not None:
                if layout.explicit:
                    h = jax.sharding.reshard(h, layout.constraint)
                else:
                    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, layout.constraint))
            if dropout:
                keep = jax.random.bernoulli(batch[2], 0.8, h.shape)
                h = jnp.where(keep, h / 0.8, 0.0)
            if layout.explicit:
                out = jnp.matmul(h, p["w2"], out_sharding=layout.batch)
            else:
                out = h @ p["w2"]
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return jax.jit(step)


# -- a scanned, rematerialised FSDP layer stack (MaxText's form) --------------------------
LAYERS = 4


def scanned_params(mesh, seed=0, head=True):
    """A stack of layers scanned over, and (``head``) an output layer outside the loop."""
    rng = np.random.default_rng(seed)
    params = {
        "ws": rng.standard_normal((LAYERS, FEATURES, FEATURES)).astype(np.float32) * 0.3,
        "bs": rng.standard_normal((LAYERS, FEATURES)).astype(np.float32) * 0.1,
        "head": rng.standard_normal((FEATURES, OUT)).astype(np.float32) * 0.3,
    }
    specs = {"ws": P(None, "fsdp", None), "bs": P(None, "fsdp"), "head": P("fsdp", None)}
    if not head:
        del params["head"], specs["head"]
    return place(mesh, params, specs)


def scanned_step(tx):
    """The step of `scanned_params`, with or without the head (its last ``OUT`` features then)."""

    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            @jax.checkpoint
            def layer(h, wb):
                w, b = wb
                return jnp.tanh(h @ w + b), None

            h, _ = jax.lax.scan(layer, x, (p["ws"], p["bs"]))
            out = h @ p["head"] if "head" in p else h[:, -OUT:]
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return jax.jit(step)


def state_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s arrays (device 0's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            shards = [s for s in leaf.addressable_shards if s.device == jax.devices()[0]]
            total += sum(s.data.nbytes for s in shards)
        else:
            total += np.asarray(leaf).nbytes
    return total
