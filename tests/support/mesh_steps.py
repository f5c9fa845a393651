"""Steps on meshes with several axes, as large runs write them.

* `tensor_parallel_mlp`: a 2-D ``('data', 'model')`` mesh, the hidden dimension
  sharded over ``'model'`` (a Megatron MLP: a forward ``psum`` over ``'model'``), the batch
  over ``'data'``, gradients ``pmean``ed over ``'data'`` only.
* `two_level_step`: data parallel over two axes, ``('dcn', 'ici')`` by default, the
  batch sharded over both and gradients ``pmean``ed over both.

Each returns ``(step, params, opt_state, batches)``; ``batches(n, seed)`` yields fresh
random placed batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched.zoo import models


def _specs_like(tree, mesh):
    return jax.tree.map(
        lambda x: x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P(), tree
    )


def tensor_parallel_mlp(
    data: int = 4,
    model: int = 2,
    check_vma: bool = False,
    tx=None,
    din: int = 6,
    hidden: int = 8,
    dout: int = 3,
    seed: int = 0,
):
    mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[: data * model])
    tx = tx or optax.adam(1e-2)
    rng = np.random.default_rng(seed)
    values = {
        "w1": rng.standard_normal((din, hidden)) * 0.3,
        "b1": rng.standard_normal(hidden) * 0.1,
        "w2": rng.standard_normal((hidden, dout)) * 0.3,
        "b2": np.zeros(dout),
    }
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    params = {k: jax.device_put(jnp.asarray(v, jnp.float32), NamedSharding(mesh, specs[k])) for k, v in values.items()}
    opt_state = tx.init(params)
    opt_specs = _specs_like(opt_state, mesh)

    def local(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            h = jax.nn.relu(x @ p["w1"] + p["b1"])
            out = lax.psum(h @ p["w2"], "model") + p["b2"]
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        if check_vma:  # JAX sums over 'data' in backward (params are invariant there)
            grads = jax.tree.map(lambda g: g / data, grads)
        else:
            grads = lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, opt_specs, P("data")),
            out_specs=(specs, opt_specs, P()),
            check_vma=check_vma,
        )
    )

    def batches(n: int, seed: int = 1, per_device: int = 2):
        r = np.random.default_rng(seed)
        for _ in range(n):
            b = (
                r.standard_normal((per_device * data, din)).astype(np.float32),
                r.standard_normal((per_device * data, dout)).astype(np.float32),
            )
            yield jax.device_put(b, NamedSharding(mesh, P("data")))

    return step, params, opt_state, batches


def two_level_step(
    slow: int = 2,
    fast: int = 4,
    axes: tuple[str, str] = ("dcn", "ici"),
    check_vma: bool = False,
    tx=None,
    seed: int = 0,
    devices=None,
):
    devices = devices if devices is not None else jax.devices()[: slow * fast]
    mesh = jax.make_mesh((slow, fast), axes, devices=devices)
    tx = tx or optax.adam(1e-2)
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, seed=seed, hidden=(13, 7)))
    opt_state = tx.init(params)
    n = slow * fast

    def local(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            logits = apply_fn(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.tree.map(lambda g: g / n, grads) if check_vma else lax.pmean(grads, axes)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, axes)

    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axes)), out_specs=(P(), P(), P()), check_vma=check_vma)
    )

    def batches(count: int, seed: int = 1, per_device: int = 2):
        r = np.random.default_rng(seed)
        for _ in range(count):
            b = (
                r.standard_normal((per_device * n, 8, 8, 1)).astype(np.float32),
                r.integers(0, 10, per_device * n).astype(np.int32),
            )
            yield jax.device_put(b, NamedSharding(mesh, P(axes)))

    return step, params, opt_state, batches


def run_plain_and_scheduled(made, strategy: str, steps: int = 3, seed: int = 1, **options):
    """((plain params, opt_state), (scheduled ones), plain aux, scheduled aux, sched)."""
    import jaxsched

    step, params, opt_state, batches = made
    data = list(batches(steps, seed))
    plain, plain_aux = (params, opt_state), []
    for b in data:
        p, o, aux = step(*plain, b)
        plain, _ = (p, o), plain_aux.append(jax.device_get(aux))
    sched = jaxsched.schedule(step, strategy=strategy, **options)
    state, sched_aux = sched.init(params, opt_state), []
    for b in data:
        state, aux = sched(state, b)
        sched_aux.append(jax.device_get(aux))
    return plain, sched.finalize(state), plain_aux, sched_aux, sched
