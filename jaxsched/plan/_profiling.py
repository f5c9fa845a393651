"""Measure the inputs of the cost model on the real backend: layer times and collective costs.

Why: a planner must use the costs of the backend it runs on, not assumed ring costs (on
gloo a reduce-scatter + all-gather took 2.3x one all-reduce; docs/benchmarks.md). Layer profile:
each top-level parameter group of a zoo model is run as its own jitted stage on one
device; forward and backward (the VJP, residuals precomputed) are timed separately,
after warm-up, as medians. Network profile: ``psum``, ``psum_scatter``,
``all_gather`` and ``ppermute`` of several sizes on a mesh, timed the same way, fitted by
least squares to ``alpha + beta * bytes`` with ``alpha >= 0``; the fit's largest relative
error is returned. Optimizer update (optional, `profile_update`): the optax transform
the step uses, run on each layer's parameters as its own jitted program, with the cost of
dispatching an empty program (`measure_dispatch`) taken off, since inside a training
step the update is not dispatched on its own.
Every multi-device call is blocked on before the next one starts (the rendezvous hazard
in docs/benchmarks.md).

Example:
    >>> from jaxsched.plan._profiling import profile_zoo_model
    >>> prof = profile_zoo_model("mlp", batch=8, repeats=2)
    >>> [layer.name for layer in prof.layers]
    ['hidden/0', 'hidden/1', 'head']
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.runtime._processes import agree_across_processes
from jaxsched.zoo import models
from jaxsched.core._axes import axis_size
from jaxsched.sim._costmodel import CollectiveCost, Layer, LayerProfile, NetworkProfile

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


def _with_activation(
    module: Any, activation: Callable | None = None, before: Callable | None = None
) -> tuple[Any, Callable]:
    params, apply = models.pure(module)

    def stage(p, x):
        y = apply(p, before(x) if before else x)
        return activation(y) if activation else y

    return params, stage


def zoo_stages(name: str, model: Any) -> list[Stage]:
    """Split a ``jaxsched.zoo.models`` model into one stage per top-level parameter group.

    Args:
      name: the zoo model's name.
      model: the model, as ``jaxsched.zoo.models.build`` returns it.

    Returns:
      ``(name, params, apply)`` per stage, in forward order.

    Example:
        >>> from jaxsched.zoo import models
        >>> [name for name, _, _ in zoo_stages("mlp", models.build("mlp", (4,), 3, hidden=(8,)))]
        ['hidden/0', 'head']
    """
    relu = jax.nn.relu
    if name == "mlp":
        flatten = lambda x: x.reshape(x.shape[0], -1)
        stages = [
            (f"hidden/{i}", *_with_activation(layer, relu, flatten if i == 0 else None))
            for i, layer in enumerate(model.hidden)
        ]
        return stages + [("head", *_with_activation(model.head))]
    if name == "cnn":
        stages = [("stem", *_with_activation(model.stem, relu))]
        stages += [(f"blocks/{i}", *_with_activation(b)) for i, b in enumerate(model.blocks)]
        return stages + [("head", *_with_activation(model.head, before=lambda x: x.mean(axis=(1, 2))))]
    if name == "transformer":
        embed_params, embed = models.pure(model.embed)
        norm_params, norm = models.pure(model.norm)
        head_params, head = models.pure(model.head)

        def embedding(p, tokens):
            return embed(p["embed"], tokens) + p["pos"][: tokens.shape[1]]

        stages = [("embed", {"embed": embed_params, "pos": model.pos[...]}, embedding)]
        stages += [(f"blocks/{i}", *_with_activation(b)) for i, b in enumerate(model.blocks)]
        return stages + [
            ("norm+head", {"norm": norm_params, "head": head_params}, lambda p, x: head(p["head"], norm(p["norm"], x)))
        ]
    raise JaxschedValueError(f"no stage split for model {name!r}; use one of mlp, cnn, transformer")


def _stage_with_loss(fn: Callable, labels: jax.Array) -> Callable:
    def loss_stage(p, h, y=None):
        logits = fn(p, h)
        y = labels if y is None else y
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1))

    return loss_stage


def profile_stages(
    stages: Sequence[Stage],
    x: jax.Array,
    labels: jax.Array,
    repeats: int = 5,
    device: Any = None,
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
) -> LayerProfile:
    """Time each stage's forward and backward; the last stage ends in the loss.

    Without ``mesh``: on one ``device``, backward timed alone (VJP residuals precomputed).
    With ``mesh``: every device runs the stage at once on its shard of ``x`` (as in a real
    data-parallel step, where devices share the host's cores), and backward is the time of
    forward+backward minus forward. ``x`` and ``labels`` are then the global batch.

    Args:
      stages: the stages (`zoo_stages`), in forward order.
      x: the input batch.
      labels: its labels (the last stage's loss reads them).
      repeats: timed runs per stage (the median is kept).
      device: the device without ``mesh`` (default: the first).
      mesh: time on every device of this mesh at once (default: one device).
      axis: the mesh's data axis (or axes).

    Returns:
      A `LayerProfile`, one layer per stage.

    Example:
        >>> import numpy as np
        >>> from jaxsched.zoo import models
        >>> stages = zoo_stages("mlp", models.build("mlp", (4,), 3, hidden=(8,)))
        >>> x, labels = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
        >>> [layer.name for layer in profile_stages(stages, x, labels, repeats=1).layers]
        ['hidden/0', 'head']
    """
    if mesh is not None:
        return _profile_stages_on_mesh(stages, x, labels, repeats, mesh, axis)
    device = device or jax.devices()[0]
    x, labels = jax.device_put((x, labels), device)
    layers = []
    for index, (name, params, fn) in enumerate(stages):
        params = jax.device_put(params, device)
        last = index == len(stages) - 1
        if last:
            fn = _stage_with_loss(fn, labels)
        forward = jax.jit(fn)
        first = index == 0
        out, vjp_fn = jax.vjp(lambda p, _x=x, _f=fn: _f(p, _x), params) if first else jax.vjp(fn, params, x)
        cotangent = jnp.ones_like(out)
        backward = jax.jit(lambda vjp, ct: vjp(ct))
        forward_s = _median_seconds(lambda: forward(params, x), repeats)
        backward_s = _median_seconds(lambda: backward(vjp_fn, cotangent), repeats)
        layers.append(_layer(name, params, forward_s, backward_s))
        x = jax.block_until_ready(forward(params, x)) if not last else x
    return LayerProfile(
        layers,
        {
            "source": "jaxsched.plan._profiling (measured medians, one device)",
            "backend": jax.default_backend(),
            "repeats": repeats,
        },
    )


def measure_dispatch(mesh: Mesh | None = None, axis: str | tuple[str, ...] = "data", repeats: int = 20) -> float:
    """Seconds to dispatch and block on a trivial jitted program (one element per device).

    With ``mesh``: a ``shard_map`` program on every device of it, as a data-parallel step
    is; without: a jitted program on the default device. This is the fixed cost every
    separately timed program pays and a fused step pays only once.

    Args:
      mesh: time on every device of this mesh at once (default: one device).
      axis: the mesh's data axis (or axes).
      repeats: timed runs (the median is kept).

    Returns:
      Seconds.

    Example:
        >>> measure_dispatch(repeats=2) > 0
        True
    """
    if mesh is None:
        program, x = jax.jit(lambda v: v + 1), jnp.zeros((1,), jnp.float32)
    else:
        program = jax.jit(jax.shard_map(lambda v: v + 1, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
        x = jax.device_put(jnp.zeros((axis_size(mesh, axis),), jnp.float32), NamedSharding(mesh, P(axis)))
    return _median_seconds(lambda: program(x), repeats, warmup=3)


def profile_update(
    layer_params: Sequence[Any],
    tx: Any,
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    repeats: int = 5,
    dispatch_s: float | None = None,
) -> list[float]:
    """Seconds of the optimizer update of each layer's parameters (one entry per layer).

    ``tx`` is the optax ``GradientTransformation`` the step uses; its update and
    ``optax.apply_updates`` run as one jitted program per layer, on every device of ``mesh``
    at once with replicated parameters (as in the data-parallel step; one device without
    ``mesh``). Gradients are the parameters themselves (values do not change the cost of
    the update's arithmetic). The fixed dispatch cost (``dispatch_s``, measured by
    `measure_dispatch` when not given) is subtracted, floored at zero.

    Args:
      layer_params: each layer's parameters.
      tx: the optax transform.
      mesh: time on every device of this mesh at once (default: one device).
      axis: the mesh's data axis (or axes).
      repeats: timed runs per layer (the median is kept).
      dispatch_s: the dispatch cost to subtract.

    Returns:
      Seconds per layer.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> len(profile_update([{"w": jnp.ones((4, 4))}, {"b": jnp.ones(4)}], optax.sgd(0.1), repeats=1))
        2
    """
    import optax

    def update(p, g, state):
        updates, _ = tx.update(g, state, p)
        return optax.apply_updates(p, updates)

    if mesh is None:
        program, put = jax.jit(update), (lambda tree: jax.device_put(tree, jax.devices()[0]))
    else:
        program = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False))
        put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
    if dispatch_s is None:
        dispatch_s = measure_dispatch(mesh, axis)
    seconds = []
    for params in layer_params:
        if not jax.tree.leaves(params):
            seconds.append(0.0)
            continue
        p, g, state = put(params), put(jax.tree.map(jnp.copy, params)), put(tx.init(params))
        seconds.append(max(_median_seconds(lambda: program(p, g, state), repeats) - dispatch_s, 0.0))
    return seconds


def _layer(name: str, params: Any, forward_s: float, backward_s: float) -> Layer:
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    return Layer(name, count, int(nbytes), forward_s, backward_s)


def _profile_stages_on_mesh(
    stages: Sequence[Stage], x: jax.Array, labels: jax.Array, repeats: int, mesh: Mesh, axis: str | tuple[str, ...]
) -> LayerProfile:
    sharded = NamedSharding(mesh, P(axis))
    x, labels = jax.device_put((x, labels), sharded)
    layers = []
    for index, (name, params, fn) in enumerate(stages):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        last = index == len(stages) - 1
        if last:
            loss = _stage_with_loss(fn, labels)
            fn = lambda p, h, y, _loss=loss: _loss(p, h, y)[None]  # type: ignore[assignment,misc]
        else:
            fn = lambda p, h, y, _f=fn: _f(p, h)  # type: ignore[assignment,misc]
        first = index == 0

        def both(p, h, y, _fn=fn, _first=first):
            out, vjp = jax.vjp(lambda q: _fn(q, h, y), p) if _first else jax.vjp(lambda q, a: _fn(q, a, y), p, h)
            return out, vjp(jnp.ones_like(out))

        specs: dict[str, Any] = dict(mesh=mesh, in_specs=(P(), P(axis), P(axis)), check_vma=False)
        forward = jax.jit(jax.shard_map(fn, out_specs=P(axis), **specs))
        forward_backward = jax.jit(jax.shard_map(both, out_specs=(P(axis), P(axis)), **specs))
        forward_s = _median_seconds(lambda: forward(params, x, labels), repeats)
        total_s = _median_seconds(lambda: forward_backward(params, x, labels), repeats)
        layers.append(_layer(name, params, forward_s, max(total_s - forward_s, 0.0)))
        x = jax.block_until_ready(forward(params, x, labels)) if not last else x
    return LayerProfile(
        layers,
        {
            "source": "jaxsched.plan._profiling (measured medians, all devices at once)",
            "backend": jax.default_backend(),
            "repeats": repeats,
            "workers": axis_size(mesh, axis),
        },
    )


def profile_zoo_model(
    name: str,
    batch: int = 64,
    repeats: int = 5,
    seed: int = 0,
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    scale_to_whole_step: bool = True,
    optimizer: Any = None,
    **options: Any,
) -> LayerProfile:
    """Measured layer profile of a ``jaxsched.zoo.models`` zoo model at per-device ``batch``.

    With ``mesh``, every device runs at once and the stage times are rescaled to the whole
    model's measured totals (`scale_to_whole_model`); ``options`` go to the model.
    The whole-model forward is timed less one program dispatch (`measure_dispatch`),
    which a measured network profile carries as ``dispatch_s`` and the simulator adds once.
    With ``optimizer`` (an optax transform), each layer's ``update_s`` is measured by
    `profile_update`; without it, ``update_s`` stays 0.

    Args:
      name: a zoo model (``"mlp"``, ``"cnn"``, ``"transformer"``, ...).
      batch: examples per device.
      repeats: timed runs per stage (the median is kept).
      seed: the seed of the model's parameters and of the random inputs.
      mesh: time every device at once on this mesh (default: one device).
      axis: the mesh's data axis.
      scale_to_whole_step: with ``mesh``, rescale the stage times to the whole model's.
      optimizer: an optax transform whose update is timed per layer.
      **options: the model's own options (``hidden=...``).

    Returns:
      The [`LayerProfile`][jaxsched.sim._costmodel.LayerProfile], one layer per top-level
      parameter group, in forward order.

    Example:
        >>> profile = profile_zoo_model("mlp", batch=4, repeats=1, hidden=(8,))
        >>> [layer.name for layer in profile.layers], profile.layers[0].backward_s > 0
        (['hidden/0', 'head'], True)
    """
    workers = axis_size(mesh, axis) if mesh is not None else 1
    rng = np.random.default_rng(seed)
    if name == "transformer":
        model = models.build(name, (32,), 64, seed, **options)
        x = rng.integers(0, 64, (batch * workers, 32)).astype(np.int32)
        labels = rng.integers(0, 64, (batch * workers, 32)).astype(np.int32)
    else:
        model = models.build(name, (8, 8, 1), 10, seed, **options)
        x = rng.standard_normal((batch * workers, 8, 8, 1)).astype(np.float32)
        labels = rng.integers(0, 10, batch * workers).astype(np.int32)
    stages = zoo_stages(name, model)
    prof = profile_stages(stages, jnp.asarray(x), jnp.asarray(labels), repeats, mesh=mesh, axis=axis)
    meta = {**prof.meta, "model": name, "batch": batch}
    dispatch_s = measure_dispatch(mesh, axis) if (optimizer is not None or mesh is not None) else 0.0
    if mesh is not None and scale_to_whole_step:
        prof = scale_to_whole_model(prof, stages, jnp.asarray(x), jnp.asarray(labels), mesh, axis, repeats, dispatch_s)
        meta.update(prof.meta)
    layers = prof.layers
    if optimizer is not None:
        updates = profile_update([params for _, params, _ in stages], optimizer, mesh, axis, repeats, dispatch_s)
        layers = [dataclasses.replace(layer, update_s=u) for layer, u in zip(layers, updates)]
        meta.update(update="measured (optax transform, dispatch subtracted)", dispatch_s=dispatch_s)
    return LayerProfile(layers, meta)


def scale_to_whole_model(
    prof: LayerProfile,
    stages: Sequence[Stage],
    x: jax.Array,
    labels: jax.Array,
    mesh: Mesh,
    axis: str | tuple[str, ...] = "data",
    repeats: int = 5,
    dispatch_s: float = 0.0,
) -> LayerProfile:
    """Rescale stage times so forward and backward totals match the whole model run as one
    program (XLA fuses across stage boundaries, and per-stage dispatch adds overhead); the
    per-layer shares stay as measured. ``dispatch_s`` (the cost of launching any program,
    `measure_dispatch`) is taken off the whole-model forward, which is timed as its
    own program; backward (forward+backward less forward) pays it in neither term.

    Args:
      prof: the per-stage profile (`profile_stages`).
      stages: its stages.
      x: the global input batch.
      labels: its labels.
      mesh: the mesh the whole model runs on.
      axis: the mesh's data axis (or axes).
      repeats: timed runs (the median is kept).
      dispatch_s: the dispatch cost to take off the forward.

    Returns:
      The rescaled `LayerProfile`.

    Example:
        >>> import jax, numpy as np
        >>> from jaxsched.zoo import models
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> stages = zoo_stages("mlp", models.build("mlp", (4,), 3, hidden=(8,)))
        >>> x, labels = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
        >>> measured = profile_stages(stages, x, labels, repeats=1, mesh=mesh)
        >>> len(scale_to_whole_model(measured, stages, x, labels, mesh, repeats=1))
        2
    """
    names = [name for name, _, _ in stages]
    params = {name: p for name, p, _ in stages}
    loss_stage = _stage_with_loss(stages[-1][2], labels)

    def loss(p, h, y):
        for name, _, fn in stages[:-1]:
            h = fn(p[name], h)
        return loss_stage(p[names[-1]], h, y)[None]

    def loss_and_grad(p, h, y):
        value, grads = jax.value_and_grad(lambda q: loss(q, h, y)[0])(p)
        return value[None], grads

    specs: dict[str, Any] = dict(mesh=mesh, in_specs=(P(), P(axis), P(axis)), check_vma=False)
    forward = jax.jit(jax.shard_map(loss, out_specs=P(axis), **specs))
    both = jax.jit(jax.shard_map(loss_and_grad, out_specs=(P(axis), P(axis)), **specs))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, labels = jax.device_put((x, labels), NamedSharding(mesh, P(axis)))
    forward_total_s = _median_seconds(lambda: forward(params, x, labels), repeats)
    backward_s = max(_median_seconds(lambda: both(params, x, labels), repeats) - forward_total_s, 0.0)
    forward_s = max(forward_total_s - dispatch_s, 0.0)

    def shares(times: list[float]) -> list[float]:
        # per-stage times all within noise of zero: share by parameter count instead
        total = sum(times)
        if total > 0:
            return [t / total for t in times]
        counts = [max(l.params, 1) for l in prof.layers]
        return [c / sum(counts) for c in counts]

    f_shares = shares([l.forward_s for l in prof.layers])
    b_shares = shares([l.backward_s for l in prof.layers])
    layers = [
        dataclasses.replace(l, forward_s=forward_s * f, backward_s=backward_s * b)
        for l, f, b in zip(prof.layers, f_shares, b_shares, strict=True)
    ]
    return LayerProfile(
        layers,
        {
            **prof.meta,
            "whole_model_forward_s": forward_s,
            "whole_model_backward_s": backward_s,
            "whole_model_dispatch_s": dispatch_s,
            "stage_sum_forward_s": prof.forward_s,
            "stage_sum_backward_s": prof.backward_s,
        },
    )


def _collective_programs(mesh: Mesh, axis: str | tuple[str, ...]) -> dict[str, Callable[[jax.Array], jax.Array]]:
    size = axis_size(mesh, axis)
    ring = [(i, (i + 1) % size) for i in range(size)]

    def wrap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))

    return {
        "all_reduce": wrap(lambda x: jax.lax.psum(x, axis)),
        "reduce_scatter": wrap(lambda x: jax.lax.psum_scatter(x[0], axis, tiled=True)[None]),
        "all_gather": wrap(lambda x: jax.lax.all_gather(x[0], axis, tiled=True)[None]),
        "ppermute": wrap(lambda x: jax.lax.ppermute(x, axis, ring)),  # one B-byte message each
    }


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[CollectiveCost, float]:
    """Least-squares ``alpha + beta * B`` with ``alpha, beta >= 0``.

    Args:
      sizes: the measured sizes, bytes.
      seconds: the time measured at each size.

    Returns:
      ``(cost, error)``: the fitted `CollectiveCost` and the fit's largest relative error.

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


def measure_copy(
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    sizes: Sequence[int] = (1 << 20, 1 << 22),
    repeats: int = 5,
    dispatch_s: float = 0.0,
) -> float:
    """Seconds per byte to pack gradients into a bucket buffer and unpack them again, halved
    (the cost of one direction), on every device of ``mesh`` at once.

    The program packs four leaves of a ``B``-byte bucket with `jaxsched.core._layout.BucketLayout`
    (flatten, pad, concatenate: the dear layout; wfbp's flat concatenate moves the same
    bytes) and unpacks the buffer into leaves again; the time, less ``dispatch_s``, is
    fitted over ``sizes`` and the slope halved.

    Args:
      mesh: the mesh (default: every device).
      axis: the mesh's data axis (or axes).
      sizes: the bucket sizes timed, bytes.
      repeats: timed runs per size (the median is kept).
      dispatch_s: the dispatch cost to subtract.

    Returns:
      Seconds per byte, one direction.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> measure_copy(mesh, sizes=(1 << 12, 1 << 14), repeats=1) >= 0
        True
    """
    from jaxsched.core import _layout as layout

    mesh = mesh or jax.make_mesh((jax.device_count(),), (axis,) if isinstance(axis, str) else axis)
    workers = axis_size(mesh, axis)
    points = []
    for size in sizes:
        per_leaf = max(1, size // 16)
        shapes = [(per_leaf - 1,), (per_leaf,), (per_leaf + 1,), (per_leaf,)]  # some padding
        bucket = layout.BucketLayout.of(shapes, [jnp.float32] * 4, workers)

        def roundtrip(leaves, _b=bucket):
            return _b.unpack(_b.pack([leaf * 1.0 for leaf in leaves]))

        program = jax.jit(jax.shard_map(roundtrip, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        leaves = jax.device_put([jnp.ones(shape, jnp.float32) for shape in shapes], NamedSharding(mesh, P()))
        seconds = _median_seconds(lambda: program(leaves), repeats)
        points.append((4 * sum(int(np.prod(shape)) for shape in shapes), max(seconds - dispatch_s, 0.0)))
    cost, _ = fit_alpha_beta(*zip(*points))
    return cost.beta_s_per_byte / 2


def measure_selection_s_per_byte(
    compressor: Any, device: Any = None, elements: int = 1 << 20, repeats: int = 5
) -> float:
    """Seconds of compute per gradient byte ``compressor`` spends before anything is sent
    (selection, error-feedback residual update), on ``device`` (default: the first local).

    Its ``all_reduce`` runs over a one-device axis, where the collective itself is free,
    against a plain ``psum`` of the same buffer; the difference is the compression work
    the simulator charges as ``Compression.selection_s_per_byte``.

    Args:
      compressor: a compressor (`jaxsched.runtime.compress`).
      device: the device (default: the first local one).
      elements: the buffer's float32 elements.
      repeats: timed runs (the median is kept).

    Returns:
      Seconds per gradient byte, at least 0.

    Example:
        >>> from jaxsched.runtime.compress import TopK
        >>> measure_selection_s_per_byte(TopK(0.01), elements=1 << 12, repeats=1) >= 0
        True
    """
    from jaxsched.runtime.collectives._base import BucketSpec, Collective

    device = device if device is not None else jax.local_devices()[0]
    mesh = Mesh(np.array([device]), ("measure",))
    bucket = BucketSpec(0, elements, np.dtype(np.float32), 1, ((elements,),))

    def timed(collective: Any) -> float:
        state = collective.init([bucket])[0]
        fn = jax.jit(
            jax.shard_map(
                lambda g, s: collective.all_reduce(g, "measure", bucket, s),
                mesh=mesh,
                in_specs=(P(), P()),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )
        g = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (elements,)), device)
        state = jax.device_put(state, device)
        return _median_seconds(lambda: fn(g, state), repeats)

    return max(0.0, timed(compressor) - timed(Collective())) / (4 * elements)


def agree_on_network(network: NetworkProfile) -> NetworkProfile:
    """``network`` with process 0's measured numbers (see `agree_across_processes`).

    Every process measures its own profile; planning from different numbers would give
    the processes different programs.

    Args:
      network: this process's measured profile.

    Returns:
      Process 0's profile (``network`` itself in a single process).

    Example:
        >>> from jaxsched.sim._costmodel import network_preset
        >>> network = network_preset("10gbe", 4)
        >>> agree_on_network(network) == network
        True
    """
    names = sorted(network.collectives)
    flat = [x for n in names for x in (network.collectives[n].alpha_s, network.collectives[n].beta_s_per_byte)]
    agreed = agree_across_processes([*flat, network.dispatch_s, network.copy_s_per_byte])
    collectives = {n: CollectiveCost(float(agreed[2 * i]), float(agreed[2 * i + 1])) for i, n in enumerate(names)}
    return dataclasses.replace(
        network, collectives=collectives, dispatch_s=float(agreed[-2]), copy_s_per_byte=float(agreed[-1])
    )


def profile_network(
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    progress: bool = False,
    fixed_costs: bool = True,
) -> tuple[NetworkProfile, dict[str, float]]:
    """Measure and fit all-reduce, reduce-scatter, all-gather and ppermute on ``mesh``
    (default: all devices).

    ``sizes`` are full-tensor bytes (float32); each is rounded to a multiple of 4 * workers.
    Works single-process on virtual CPU devices and multi-process (every process calls it).
    With ``fixed_costs``, also measures ``dispatch_s`` (`measure_dispatch`) and
    ``copy_s_per_byte`` (`measure_copy`). ``alpha_s`` stays as fitted, dispatch
    included: a chain of small psums inside one program measured about the same fixed cost
    per collective (rendezvous of every device) as a standalone collective program
    (docs/simulator.md), so taking the dispatch off would undercount it.

    Args:
      mesh: the mesh to measure on (default: all devices on one axis named ``axis``).
      axis: the data axis the collectives cross.
      sizes: the measured sizes, full-tensor bytes.
      repeats: timed runs per size (the median is kept).
      progress: show a bar over the measurements.
      fixed_costs: also measure ``dispatch_s`` and ``copy_s_per_byte``.

    Returns:
      ``(network, errors)``: the fitted
      [`NetworkProfile`][jaxsched.sim._costmodel.NetworkProfile] and, per collective, the
      fit's largest relative error.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> network, errors = profile_network(mesh, sizes=(4096, 65536), repeats=1, fixed_costs=False)
        >>> network.workers, sorted(errors)
        (2, ['all_gather', 'all_reduce', 'ppermute', 'reduce_scatter'])
    """
    mesh = mesh or jax.make_mesh((jax.device_count(),), (axis,) if isinstance(axis, str) else axis)
    workers = axis_size(mesh, axis)
    programs = _collective_programs(mesh, axis)
    sharding = NamedSharding(mesh, P(axis))
    todo = [(name, size) for name in programs for size in sizes]
    if progress:
        from jaxsched.core._progress import progress as progress_bar

        todo = progress_bar(todo, "profiling collectives", leave=False)
    measured: dict[str, list[tuple[int, float]]] = {name: [] for name in programs}
    for name, size in todo:
        elements = max(workers, size // 4 // workers * workers)
        shape = (workers, elements // workers) if name == "all_gather" else (workers, elements)
        host = np.ones(shape, np.float32)  # every process builds the same global array
        x = jax.make_array_from_callback(shape, sharding, lambda index, _h=host: _h[index])  # type: ignore[misc]
        seconds = _median_seconds(lambda: programs[name](x), repeats)
        measured[name].append((elements * 4, seconds))
    dispatch_s = measure_dispatch(mesh, axis) if fixed_costs else 0.0
    collectives, errors = {}, {}
    for name, points in measured.items():
        collectives[name], errors[name] = fit_alpha_beta(*zip(*points))
    copy_s = measure_copy(mesh, axis, repeats=repeats, dispatch_s=dispatch_s) if fixed_costs else 0.0
    meta = {
        "source": "jaxsched.plan._profiling (measured medians, least-squares fit)",
        "backend": jax.default_backend(),
        "processes": jax.process_count(),
        "fit_max_relative_error": errors,
    }
    return NetworkProfile(workers, collectives, meta, dispatch_s=dispatch_s, copy_s_per_byte=copy_s), errors


__all__ = [
    "fit_alpha_beta",
    "measure_copy",
    "measure_dispatch",
    "profile_network",
    "profile_stages",
    "profile_update",
    "profile_zoo_model",
    "zoo_stages",
]


def psum_programs(count: int, mesh: Mesh, axis: str | tuple[str, ...] = "data") -> dict[str, Callable[..., Any]]:
    """Two ways to all-reduce ``count`` arrays: one ``psum`` of the tuple (what ``lax.pmean``
    of a gradient tree compiles to) and one ``psum`` of their flat concatenation (what a
    bucket of ``wfbp``/``dear`` sends).

    Args:
      count: the number of arrays.
      mesh: the mesh.
      axis: the mesh's data axis (or axes).

    Returns:
      ``{"tuple": ..., "flat": ...}``: jitted programs taking the ``count`` arrays.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> sorted(psum_programs(3, mesh))
        ['flat', 'tuple']
    """

    def tuple_psum(*arrays):
        return tuple(jax.lax.psum(arrays, axis))

    def flat_psum(*arrays):
        return jax.lax.psum(jnp.concatenate([a.reshape(-1) for a in arrays]), axis)

    def wrap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * count, out_specs=P(), check_vma=False))

    return {"tuple": wrap(tuple_psum), "flat": wrap(flat_psum)}


def profile_psum_operands(
    arrays: Sequence[Any], mesh: Mesh, axis: str | tuple[str, ...] = "data", repeats: int = 50
) -> dict[str, float]:
    """Median ms of a tuple ``psum`` of ``arrays`` vs a ``psum`` of their concatenation.

    Why: XLA:CPU runs an all-reduce of a tuple as one rendezvous of all device threads
    per operand (docs/benchmarks.md), so on virtual CPU devices the cost grows with
    the number of leaves, not the bytes. Calls are interleaved so that machine load hits
    both alike, and each is blocked on before the next (one multi-device call in flight).

    Args:
      arrays: the operands.
      mesh: the mesh.
      axis: the mesh's data axis (or axes).
      repeats: timed calls of each program (the median is kept).

    Returns:
      ``{"tuple_ms": ..., "flat_ms": ...}``.

    Example:
        >>> import jax, numpy as np
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> sorted(profile_psum_operands([np.ones(4, np.float32)] * 2, mesh, repeats=2))
        ['flat_ms', 'tuple_ms']
    """
    placed = [jax.device_put(np.asarray(a), NamedSharding(mesh, P())) for a in arrays]
    programs = psum_programs(len(placed), mesh, axis)
    samples: dict[str, list[float]] = {name: [] for name in programs}
    for name, program in programs.items():
        jax.block_until_ready(program(*placed))  # compile outside the timing
    for _ in range(repeats):
        for name, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(*placed))
            samples[name].append(time.perf_counter() - start)
    return {f"{name}_ms": 1e3 * statistics.median(values) for name, values in samples.items()}
