"""Dense and convolution layers found in a captured step's jaxpr (no hand tagging).

K-FAC needs, per layer, the layer's input ``a`` and the cotangent ``g`` of its output.
The user's step already computes both: backward forms the weight gradient from exactly
them. So a layer is recognised by matching two equations of the per-device body:

* **dense**: a forward ``dot_general(x, W)`` whose right operand is a 2-D parameter
  (one contracting dimension, no batch dimensions), and a backward ``dot_general`` that
  reads the same ``x`` and whose result, through reshapes, transposes and casts only,
  is ``W``'s reduced gradient. Its other operand is ``g``.
* **convolution**: a forward ``conv_general_dilated(x, W)`` (no feature or batch groups)
  and a backward ``conv_general_dilated(x, g)`` that becomes ``W``'s gradient.

A bias is matched when its gradient is a ``reduce_sum`` of that same ``g`` over every
dimension but the output features (or ``g`` itself, reshaped, where those dimensions have
size 1: one example per device). Parameters that no rule matches are returned in
``unmatched`` (their paths), so a caller can leave them on the plain gradient.

Example:
    >>> import jax, optax
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> from jaxsched.core._capture import capture
    >>> from jaxsched.plan._planned_step import PlannedStep
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> tx = optax.sgd(0.1)
    >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    >>> planned = PlannedStep(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
    >>> found = match_layers(planned.analysis, planned.paths)
    >>> [(l.name, l.kind, l.dims) for l in found.layers], found.unmatched
    ([('hidden/0', 'dense', (5, 3)), ('head', 'dense', (4, 2))], ())
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jax.extend.core import JaxprEqn

from jaxsched.core._analyze import Analysis
from jaxsched.core._bucketing import match_reductions
from jaxsched.core._replay import aval_of, is_var

__all__ = ["LayerMatch", "match_layers", "MatchedLayer", "PASS_THROUGH"]

#: Equations that move or cast a value without changing what it holds.
PASS_THROUGH = frozenset(
    {"reshape", "transpose", "convert_element_type", "copy", "copy_p", "squeeze", "expand_dims", "broadcast_in_dim"}
)


@dataclasses.dataclass(frozen=True)
class MatchedLayer:
    """One dense or convolution layer as K-FAC sees it.

    Attributes:
      name: the kernel's path without its last component (``hidden/0``).
      kind: ``"dense"`` or ``"conv"``.
      kernel, bias: parameter leaf indices (``bias`` None when not matched or absent).
      kernel_reduction, bias_reduction: indices into ``analysis.reductions``.
      inputs: the body variable holding the layer input ``x``.
      cotangent: the body variable holding the output cotangent ``g``.
      grad_eqn: the body equation that forms the kernel gradient (backward order).
      dims: ``(d_A, d_G)``: the sizes of the two Kronecker factors (``d_A`` counts the
        bias row when a bias is matched).
      params: how to turn the kernel into the ``(d_A - bias, d_G)`` matrix: for dense
        ``{"in_axis": 0 or 1}``; for conv the forward convolution's parameters.

    Example:
        >>> import jax, optax
        >>> from jaxsched.demo import steps
        >>> from jaxsched.integrations import kfac
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> found = kfac.find_layers(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
        >>> layer = found.layers[0]
        >>> layer.name, layer.kind, layer.kernel, layer.bias, layer.dims  # d_A: 4 inputs and the bias row
        ('hidden/0', 'dense', 3, 2, (5, 3))
    """

    name: str
    kind: str
    kernel: int
    bias: int | None
    kernel_reduction: int
    bias_reduction: int | None
    inputs: Any
    cotangent: Any
    grad_eqn: int
    dims: tuple[int, int]
    params: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


@dataclasses.dataclass(frozen=True)
class LayerMatch:
    """What `match_layers` found: K-FAC preconditions ``layers`` and leaves ``unmatched``
    on the plain gradient.

    Attributes:
      layers: the matched layers, in forward order of their kernels' first use.
      unmatched: paths of parameters with a gradient reduction that no layer covers.

    Example:
        >>> import jax, optax
        >>> from jaxsched.demo import steps
        >>> from jaxsched.integrations import kfac
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> found = kfac.find_layers(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
        >>> [layer.name for layer in found.layers], found.unmatched
        (['hidden/0', 'head'], ())
    """

    layers: tuple[MatchedLayer, ...]
    unmatched: tuple[str, ...]


def match_layers(analysis: Analysis, paths: Sequence[str]) -> LayerMatch:
    """Match every dense and convolution layer of ``analysis``'s step (see module doc)."""
    cap = analysis.captured
    body = cap.body
    producer = {o: i for i, e in enumerate(body.eqns) for o in e.outvars}
    param_of = {body.invars[k]: src.index for k, src in enumerate(cap.sources) if src.role == "params"}
    reduction_of_param = {i: j for i, j in enumerate(match_reductions(analysis)) if j is not None}
    param_of_reduction = {j: i for i, j in reduction_of_param.items()}
    # the equation behind each reduction's operand, through pass-through equations
    source_eqn = {j: _origin(r.operand, producer, body) for j, r in enumerate(analysis.reductions)}
    by_eqn: dict[int, list[int]] = {}
    for j, i in source_eqn.items():
        if i is not None:
            by_eqn.setdefault(i, []).append(j)

    layers, used = [], set()
    for f, eqn in enumerate(body.eqns):
        name = eqn.primitive.name
        if name not in ("dot_general", "conv_general_dilated") or len(eqn.invars) != 2:
            continue
        x, w = eqn.invars
        if not (is_var(x) and is_var(w)) or w not in param_of or x in param_of:
            continue
        kernel = param_of[w]
        j_w = reduction_of_param.get(kernel)
        if j_w is None or j_w in used:
            continue
        grad_eqn = source_eqn.get(j_w)
        if grad_eqn is None or grad_eqn <= f:
            continue
        g_eqn = body.eqns[grad_eqn]
        if g_eqn.primitive.name != name or x not in g_eqn.invars:
            continue
        if name == "dot_general":
            layer = _dense(eqn, g_eqn, x, w)
        else:
            layer = _conv(eqn, g_eqn, x, w)
        if layer is None:
            continue
        g, d_in, d_out, params = layer
        j_b = _bias_reduction(analysis, g, d_out, producer, body, params["out_axis"], by_eqn)
        bias = None
        if j_b is not None:
            bias = param_of_reduction.get(j_b)
            if bias is None or j_b in used:
                j_b, bias = None, None
        used.add(j_w)
        if j_b is not None:
            used.add(j_b)
        path = paths[kernel]
        layers.append(
            MatchedLayer(
                name=path.rsplit("/", 1)[0] if "/" in path else path,
                kind="dense" if name == "dot_general" else "conv",
                kernel=kernel,
                bias=bias,
                kernel_reduction=j_w,
                bias_reduction=j_b,
                inputs=x,
                cotangent=g,
                grad_eqn=grad_eqn,
                dims=(d_in + (1 if bias is not None else 0), d_out),
                params=params,
            )
        )
    unmatched = tuple(paths[p] for p, j in sorted(reduction_of_param.items()) if j not in used)
    return LayerMatch(tuple(layers), unmatched)


def _origin(x: Any, producer: dict, body) -> int | None:
    """The first equation behind ``x`` that is not a pass-through (its index), or None."""
    while is_var(x) and x in producer:
        i = producer[x]
        eqn = body.eqns[i]
        if eqn.primitive.name in PASS_THROUGH and len(eqn.invars) == 1 or _sums_unit_axes(eqn):
            x = eqn.invars[0]
            continue
        return i
    return None


def _sums_unit_axes(eqn: JaxprEqn) -> bool:
    """A ``reduce_sum`` over axes of size 1 only (a reshape in disguise)."""
    return eqn.primitive.name == "reduce_sum" and all(aval_of(eqn.invars[0]).shape[a] == 1 for a in eqn.params["axes"])


def _dense(fwd, bwd, x, w):
    (cx, cw), (bx, bw) = fwd.params["dimension_numbers"]
    if bx or bw or len(cx) != 1 or len(cw) != 1 or len(w.aval.shape) != 2 or len(x.aval.shape) < 2:
        return None
    if fwd.invars[0] is not x or cx[0] != len(x.aval.shape) - 1:
        return None
    in_axis = cw[0]
    d_in, d_out = w.aval.shape[in_axis], w.aval.shape[1 - in_axis]
    g = bwd.invars[1] if bwd.invars[0] is x else bwd.invars[0]
    if not is_var(g) or g is x:
        return None
    (gc_l, gc_r), (gb_l, gb_r) = bwd.params["dimension_numbers"]
    if gb_l or gb_r:
        return None
    x_contract = gc_l if bwd.invars[0] is x else gc_r
    g_contract = gc_r if bwd.invars[0] is x else gc_l
    x_rows = tuple(range(len(x.aval.shape) - 1))
    if tuple(sorted(x_contract)) != x_rows or len(g.aval.shape) != len(x.aval.shape):
        return None
    g_free = [d for d in range(len(g.aval.shape)) if d not in g_contract]
    if len(g_free) != 1 or g.aval.shape[g_free[0]] != d_out:
        return None
    batch = x.aval.shape[0]
    return (
        g,
        d_in,
        d_out,
        {"in_axis": in_axis, "out_axis": g_free[0], "batch": batch, "rows": math.prod(x.aval.shape[:-1])},
    )


def _conv(fwd, bwd, x, w):
    p = fwd.params
    if p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1:
        return None
    if fwd.invars[0] is not x or bwd.invars[0] is not x:
        return None
    g = bwd.invars[1]
    dn = p["dimension_numbers"]
    o_dim, i_dim, *spatial = dn.rhs_spec
    d_out = w.aval.shape[o_dim]
    filter_shape = tuple(w.aval.shape[s] for s in spatial)
    d_in = w.aval.shape[i_dim] * math.prod(filter_shape)
    out_axis = dn.out_spec[1]
    if not is_var(g) or g.aval.shape[out_axis] != d_out:
        return None
    rows = math.prod(d for k, d in enumerate(g.aval.shape) if k != out_axis)
    return (
        g,
        d_in,
        d_out,
        {
            "out_axis": out_axis,
            "batch": x.aval.shape[dn.lhs_spec[0]],
            "rows": rows,
            "filter_shape": filter_shape,
            "window_strides": p["window_strides"],
            "padding": p["padding"],
            "lhs_dilation": p["lhs_dilation"],
            "rhs_dilation": p["rhs_dilation"],
            "dimension_numbers": dn,
            "precision": p.get("precision"),
        },
    )


def _bias_reduction(analysis: Analysis, g, d_out: int, producer: dict, body, out_axis: int, by_eqn: dict) -> int | None:
    """The reduction whose operand is ``reduce_sum(g)`` over every axis but ``out_axis``.

    Where every other axis of ``g`` has size 1 (one example per device), JAX sums nothing:
    the bias gradient is ``g`` itself, reshaped, and its origin is ``g``'s own."""
    want = tuple(d for d in range(len(g.aval.shape)) if d != out_axis)
    for i, js in by_eqn.items():
        eqn = body.eqns[i]
        if eqn.primitive.name == "reduce_sum" and eqn.invars[0] is g and tuple(sorted(eqn.params["axes"])) == want:
            for j in js:
                if tuple(analysis.reductions[j].operand.aval.shape) == (d_out,):
                    return j
    if all(g.aval.shape[d] == 1 for d in want):
        for j in by_eqn.get(_origin(g, producer, body), ()):
            if tuple(analysis.reductions[j].operand.aval.shape) == (d_out,):
                return j
    return None
