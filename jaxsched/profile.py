"""Measure the inputs of the cost model on the real backend: layer times and collective costs.

Why: a planner must use the costs of the backend it runs on, not assumed ring costs (on
gloo a reduce-scatter + all-gather took 2.3x one all-reduce; FACTS.md). Layer profile:
each top-level parameter group of a zoo model is run as its own jitted stage on one
device; forward and backward (the VJP, residuals precomputed) are timed separately,
after warm-up, as medians. Network profile: ``psum``, ``psum_scatter`` and
``all_gather`` of several sizes on a mesh, timed the same way, fitted by least squares to
``alpha + beta * bytes`` with ``alpha >= 0``; the fit's largest relative error is returned.
Every multi-device call is blocked on before the next one starts (the rendezvous hazard
in FACTS.md).

Example:
    >>> from jaxsched.profile import profile_zoo_model
    >>> prof = profile_zoo_model("mlp", batch=8, repeats=2)
    >>> [layer.name for layer in prof.layers]
    ['hidden.0', 'hidden.1', 'head']
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched import models
from jaxsched.costmodel import CollectiveCost, Layer, LayerProfile, NetworkProfile

Stage = tuple[str, Any, Callable[[Any, jax.Array], jax.Array]]
DEFAULT_SIZES = tuple(1 << e for e in range(12, 23, 2))  # 4 KiB .. 4 MiB per collective


def _median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _with_activation(module: Any, activation: Callable | None = None,
                     before: Callable | None = None) -> tuple[Any, Callable]:
    params, apply = models.pure(module)

    def stage(p, x):
        y = apply(p, before(x) if before else x)
        return activation(y) if activation else y

    return params, stage


def zoo_stages(name: str, model: Any) -> list[Stage]:
    """Split a ``jaxsched.models`` model into one stage per top-level parameter group."""
    relu = jax.nn.relu
    if name == "mlp":
        flatten = lambda x: x.reshape(x.shape[0], -1)
        stages = [(f"hidden.{i}", *_with_activation(layer, relu, flatten if i == 0 else None))
                  for i, layer in enumerate(model.hidden)]
        return stages + [("head", *_with_activation(model.head))]
    if name == "cnn":
        stages = [("stem", *_with_activation(model.stem, relu))]
        stages += [(f"blocks.{i}", *_with_activation(b)) for i, b in enumerate(model.blocks)]
        return stages + [("head", *_with_activation(model.head, before=lambda x: x.mean(axis=(1, 2))))]
    if name == "transformer":
        embed_params, embed = models.pure(model.embed)
        norm_params, norm = models.pure(model.norm)
        head_params, head = models.pure(model.head)

        def embedding(p, tokens):
            return embed(p["embed"], tokens) + p["pos"][: tokens.shape[1]]

        stages = [("embed", {"embed": embed_params, "pos": model.pos[...]}, embedding)]
        stages += [(f"blocks.{i}", *_with_activation(b)) for i, b in enumerate(model.blocks)]
        return stages + [("norm+head", {"norm": norm_params, "head": head_params},
                          lambda p, x: head(p["head"], norm(p["norm"], x)))]
    raise ValueError(f"no stage split for model {name!r}; use one of mlp, cnn, transformer")


def profile_stages(stages: Sequence[Stage], x: jax.Array, labels: jax.Array, repeats: int = 5,
                   device: Any = None) -> LayerProfile:
    """Time each stage's forward and backward on ``device``; the last stage ends in the loss."""
    device = device or jax.devices()[0]
    x, labels = jax.device_put((x, labels), device)
    layers = []
    for index, (name, params, fn) in enumerate(stages):
        params = jax.device_put(params, device)
        last = index == len(stages) - 1
        if last:
            def fn(p, h, _fn=fn):
                logits = _fn(p, h)
                return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                                     labels[..., None], axis=-1))
        forward = jax.jit(fn)
        first = index == 0
        out, vjp_fn = (jax.vjp(lambda p, _x=x, _f=fn: _f(p, _x), params) if first
                       else jax.vjp(fn, params, x))
        cotangent = jnp.ones_like(out)
        backward = jax.jit(lambda vjp, ct: vjp(ct))
        forward_s = _median_seconds(lambda: forward(params, x), repeats)
        backward_s = _median_seconds(lambda: backward(vjp_fn, cotangent), repeats)
        count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
        nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
        layers.append(Layer(name, count, int(nbytes), forward_s, backward_s))
        x = jax.block_until_ready(forward(params, x)) if not last else x
    return LayerProfile(layers, {"source": "jaxsched.profile (measured medians)",
                                 "backend": jax.default_backend(), "repeats": repeats})


def profile_zoo_model(name: str, batch: int = 64, repeats: int = 5, seed: int = 0) -> LayerProfile:
    """Measured layer profile of a ``jaxsched.models`` zoo model at per-device ``batch``."""
    rng = np.random.default_rng(seed)
    if name == "transformer":
        model = models.build(name, (32,), 64, seed)
        x = rng.integers(0, 64, (batch, 32)).astype(np.int32)
        labels = rng.integers(0, 64, (batch, 32)).astype(np.int32)
    else:
        model = models.build(name, (8, 8, 1), 10, seed)
        x = rng.standard_normal((batch, 8, 8, 1)).astype(np.float32)
        labels = rng.integers(0, 10, batch).astype(np.int32)
    prof = profile_stages(zoo_stages(name, model), jnp.asarray(x), jnp.asarray(labels), repeats)
    return LayerProfile(prof.layers, {**prof.meta, "model": name, "batch": batch})


def _collective_programs(mesh: Mesh, axis: str) -> dict[str, Callable[[jax.Array], jax.Array]]:
    def wrap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                     check_vma=False))

    return {
        "all_reduce": wrap(lambda x: jax.lax.psum(x, axis)),
        "reduce_scatter": wrap(lambda x: jax.lax.psum_scatter(x[0], axis, tiled=True)[None]),
        "all_gather": wrap(lambda x: jax.lax.all_gather(x[0], axis, tiled=True)[None]),
    }


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[CollectiveCost, float]:
    """Least-squares ``alpha + beta * B`` with ``alpha, beta >= 0``; returns the max relative error.

    Example:
        >>> cost, err = fit_alpha_beta([1e3, 1e4, 1e5], [1.1e-3, 2e-3, 11e-3])
        >>> round(cost.alpha_s, 4), round(cost.beta_s_per_byte * 1e9), err < 1e-9
        (0.001, 100, True)
    """
    b, t = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([np.ones_like(b), b], axis=1)
    alpha, beta = np.linalg.lstsq(design, t, rcond=None)[0]
    if alpha < 0:
        alpha, beta = 0.0, float(b @ t / (b @ b))
    if beta < 0:
        alpha, beta = float(t.mean()), 0.0
    cost = CollectiveCost(float(alpha), float(beta))
    error = float(np.max(np.abs([cost.time(x) - y for x, y in zip(b, t)]) / t))
    return cost, error


def profile_network(mesh: Mesh | None = None, axis: str = "data",
                    sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                    progress: bool = False) -> tuple[NetworkProfile, dict[str, float]]:
    """Measure and fit all-reduce, reduce-scatter and all-gather on ``mesh`` (default: all devices).

    ``sizes`` are full-tensor bytes (float32); each is rounded to a multiple of 4 * workers.
    Works single-process on virtual CPU devices and multi-process (every process calls it).
    """
    mesh = mesh or jax.make_mesh((jax.device_count(),), (axis,))
    workers = mesh.shape[axis]
    programs = _collective_programs(mesh, axis)
    sharding = NamedSharding(mesh, P(axis))
    todo = [(name, size) for name in programs for size in sizes]
    if progress:
        from tqdm import tqdm
        todo = tqdm(todo, desc="profiling collectives", leave=False)
    measured: dict[str, list[tuple[int, float]]] = {name: [] for name in programs}
    for name, size in todo:
        elements = max(workers, size // 4 // workers * workers)
        shape = (workers, elements // workers) if name == "all_gather" else (workers, elements)
        x = jax.device_put(np.ones(shape, np.float32), sharding)
        seconds = _median_seconds(lambda: programs[name](x), repeats)
        measured[name].append((elements * 4, seconds))
    collectives, errors = {}, {}
    for name, points in measured.items():
        collectives[name], errors[name] = fit_alpha_beta(*zip(*points))
    meta = {"source": "jaxsched.profile (measured medians, least-squares fit)",
            "backend": jax.default_backend(), "processes": jax.process_count(),
            "fit_max_relative_error": errors}
    return NetworkProfile(workers, collectives, meta), errors


__all__ = ["fit_alpha_beta", "profile_network", "profile_stages", "profile_zoo_model", "zoo_stages"]
