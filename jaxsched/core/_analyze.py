"""Analyze: where gradients are reduced, what the update region is, and when params are used.

The body of a data-parallel step splits at its gradient reductions (``psum`` over the
data axis of device-varying values that flow into the new params or optimizer state):

* the *backward region*: every equation the gradients need (forward and backward);
* the *update region*: everything else (the optimizer, metrics, anything after).

Per body input the analysis records its first use in the backward region (where an
all-gather must land by), and per reduction the equation that completes its operand
(where a reduce-scatter can start).

Example:
    >>> import jax, optax
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> from jaxsched.core._capture import capture
    >>> from jaxsched.core._analyze import analyze
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    >>> tx = optax.sgd(0.1)
    >>> a = analyze(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
    >>> len(a.reductions)
    4
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn

from jaxsched.core._capture import CapturedStep, UnsupportedStepError
from jaxsched.core._axes import AxisName, as_axes, spec_axes
from jaxsched.core._primitives import REDUCTIONS, SCATTER_REDUCTIONS, SUM_REDUCTIONS, reduces_over, reduction_axes
from jaxsched.core._replay import is_var, live_equations, nested_eqns, source_line

__all__ = ["Analysis", "analyze", "Reduction"]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One reduced gradient: operand ``operand_pos`` of body equation ``eqn_index``.

    Most gradients are summed whole over the data axes (a ``psum``). The gradient of a
    parameter sharded over data axes (FSDP) is reduce-scattered into the parameter's block
    over those axes (``scatter_dim``, ``scatter_axes``), then summed over the other data axes
    (``sum_axes``: HSDP's replica axis; none for FSDP over every data axis).

    Attributes:
      eqn_index: the reducing equation in the body.
      operand_pos: which of its operands (a psum may reduce several at once).
      operand, result: the body variables before and after the reduction (after the sum over
        ``sum_axes`` for a scattered gradient).
      ready_at: index of the backward equation that computes the operand (-1: a body input).
      nbytes: bytes of the full gradient.
      scatter_dim, scatter_axes: the block's dimension and mesh axes of a reduce-scattered
        gradient (None and ``()`` for a psum).
      sum_axes: the mesh axes the (scattered) gradient is summed over; None: every data axis.
      then_index: the body equation of that sum after a reduce-scatter (None: there is none).
    """

    eqn_index: int
    operand_pos: int
    operand: Any
    result: Any
    ready_at: int
    nbytes: int
    scatter_dim: int | None = None
    scatter_axes: tuple[str, ...] = ()
    sum_axes: tuple[str, ...] | None = None
    then_index: int | None = None

    @property
    def scattered(self) -> bool:
        """Whether the gradient is reduce-scattered into a parameter block (FSDP)."""
        return self.scatter_dim is not None

    @property
    def form(self) -> tuple:
        """What a bucket of reductions must share to travel together."""
        return (self.scatter_axes, self.sum_axes)


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Attributes:
    captured: what capture found.
    reductions: gradient reductions, in body order.
    backward: indices of backward-region equations, in order.
    update: indices of update-region equations, in order.
    varying: body variables whose value differs across devices.
    first_use: per body invar index, the first backward equation reading it (or None).
    forward_collectives: reductions over the axis that forward or backward reads (they
      run where the user wrote them).
    per_device_outputs: positions among the step's params and opt_state outputs whose new
      value differs across devices (kept per device, never sharded).
    data_varying: body variables that differ across devices because of the data each sees
      (the batch; not a parameter block, which differs by position): what gradients are.
    varying_axes: per device-varying body variable, the data axes it differs across (a
      parameter block of HSDP differs across the axes it is split over, the same along the
      replica axis; a gradient reduce-scattered into it, once summed over the replica axis,
      too): a chunk along the other axes is a chunk of one tensor.
    """

    captured: CapturedStep
    reductions: tuple[Reduction, ...]
    backward: tuple[int, ...]
    update: tuple[int, ...]
    varying: frozenset
    first_use: tuple[int | None, ...]
    forward_collectives: tuple[int, ...] = ()
    per_device_outputs: frozenset = frozenset()
    data_varying: frozenset = frozenset()
    varying_axes: dict = dataclasses.field(default_factory=dict)


def analyze(captured: CapturedStep) -> Analysis:
    body = captured.body
    axis = captured.axis_name
    outvars = list(body.outvars)
    n_state = captured.num_params + captured.num_opt
    state_out_idx = set(captured.outputs[:n_state])
    state_outvars = {outvars[i] for i in state_out_idx if is_var(outvars[i])}

    # Device-varying values: the batch (and anything sharded), axis_index, and what they touch.
    varying = set()
    data_axes = set(as_axes(axis))
    for v, src, spec in zip(body.invars, captured.sources, captured.in_specs):
        # sharded over a data axis; a block of a model axis (tensor parallel) is the same
        # on every device of the data axis
        sharded = any(a in data_axes for a in spec_axes(spec))
        if src.role == "batch" or (sharded and captured.kind != "pmap"):
            varying.add(v)  # pmap gives every input a device axis; its state is replicated by convention
    for eqn in body.eqns:
        name = eqn.primitive.name
        if reduces_over(eqn, axis, REDUCTIONS):
            continue
        if name == "axis_index" or any(is_var(x) and x in varying for x in eqn.invars):
            varying.update(eqn.outvars)

    # Which equations feed the new params / opt_state (backward slice from the state outputs).
    feeds_state = set(state_outvars)
    for eqn in reversed(body.eqns):
        if any(o in feeds_state for o in eqn.outvars):
            feeds_state.update(x for x in eqn.invars if is_var(x))

    producer = {}
    for i, eqn in enumerate(body.eqns):
        for o in eqn.outvars:
            producer[o] = i

    # A reduce-scatter over data axes into a block, then (HSDP) a psum over the others: one
    # gradient reduction of a sharded parameter, the two equations together.
    then_sum = _sums_after_scatters(body, data_axes)
    from_data = _varying_with_the_data(captured, body, axis, then_sum)
    candidates = [
        i
        for i, eqn in enumerate(body.eqns)
        if (reduces_over(eqn, axis, SUM_REDUCTIONS) or i in then_sum)
        and any(o in feeds_state for o in eqn.outvars)
        # a reduction of an invariant value (e.g. a second pmean) is part of the update, and
        # so is a sum of parameter blocks (a global norm of FSDP's reduced gradients)
        and any(is_var(x) and x in from_data for x in eqn.invars)
    ]
    # A reduction whose result another reduction's operand needs belongs to forward or
    # backward (synchronized batch norm, a global token count, SAM's first gradient): it
    # stays where it is. Only the last reductions on each path, whose results only the
    # update reads, are gradient reductions to reschedule.
    upstream, needed = set(), {x for i in candidates for x in body.eqns[i].invars if is_var(x)}
    for i in range(len(body.eqns) - 1, -1, -1):
        if any(o in needed for o in body.eqns[i].outvars):
            upstream.add(i)
            needed.update(x for x in body.eqns[i].invars if is_var(x))
    forward_collectives = tuple(i for i in candidates if i in upstream)

    reductions, reducing_eqns = [], set()
    for i in candidates:
        eqn = body.eqns[i]
        if i in upstream:
            continue
        if i in then_sum:
            j = then_sum[i]
            reducing_eqns.update({i} if j is None else {i, j})
            x, o = eqn.invars[0], eqn.outvars[0] if j is None else body.eqns[j].outvars[0]
            sum_axes = () if j is None else tuple(reduction_axes(body.eqns[j]))
            reductions.append(
                Reduction(
                    i,
                    0,
                    x,
                    o,
                    producer.get(x, -1),
                    x.aval.size * x.aval.dtype.itemsize,
                    int(eqn.params["scatter_dimension"]),
                    tuple(reduction_axes(eqn)),
                    sum_axes,
                    j,
                )
            )
            continue
        if set(reduction_axes(eqn)) != data_axes:
            extra = [a for a in reduction_axes(eqn) if a not in data_axes]
            raise UnsupportedStepError(
                f"gradients are reduced over axes {reduction_axes(eqn)} at {source_line(eqn)}, "
                f"but the batch is sharded over {as_axes(axis)} only, so {tuple(extra)} are not "
                "data-parallel axes; jaxsched schedules gradient reductions over exactly the "
                "data-parallel axes (reduce the gradients over the axes the batch is sharded "
                "over, and keep model-axis collectives inside forward and backward)"
            )
        reducing_eqns.add(i)
        for pos, (x, o) in enumerate(zip(eqn.invars, eqn.outvars)):
            nbytes = x.aval.size * x.aval.dtype.itemsize
            reductions.append(Reduction(i, pos, x, o, producer.get(x, -1), nbytes))
    if not reductions and not (captured.kind == "jit" and _scattered_in_loops(body, data_axes, axis)):
        nested = _nested_reduction(body, axis)
        if captured.kind == "jit":
            raise UnsupportedStepError(_no_top_level_reduction(captured, nested))
        if nested is not None:
            raise UnsupportedStepError(
                f"the gradients are reduced over {axis!r} inside a nested {nested.primitive.name} "
                f"at {source_line(nested)}; jaxsched rewrites reductions at the top level of the "
                "shard_map body, so call lax.pmean/psum there rather than inside a separately "
                "jitted function, scan, cond or loop"
            )
        partial = sorted(
            {
                reduction_axes(e)
                for e in body.eqns
                if e.primitive.name in SUM_REDUCTIONS
                and set(reduction_axes(e)) & data_axes
                and any(o in feeds_state for o in e.outvars)
            }
        )
        if len(data_axes) > 1 and partial:
            raise UnsupportedStepError(
                f"the gradients are reduced over the data-parallel axes {as_axes(axis)} in "
                f"separate calls (over {', '.join(map(str, partial))}); reduce them in one, "
                f"lax.pmean(grads, {axis!r}), and pass collective=jaxsched.runtime.collectives."
                "Hierarchical(fast=..., slow=...) to have it summed level by level"
            )
        raise UnsupportedStepError(
            f"the step has no gradient reduction over mesh axis {axis!r}: nothing psums or pmeans "
            "device-varying values into the new params or optimizer state. Reduce the gradients "
            f"with lax.pmean(grads, {axis!r}) (or use check_vma=True so JAX does it in backward)"
        )

    # Backward region: what the reduced gradients need. Everything else (the optimizer,
    # including its gradient-free parts such as b1 * mu, and metrics) is the update region,
    # so optimizer state is never gathered just to be decayed.
    needed = {r.operand for r in reductions if is_var(r.operand)}
    in_backward = set()
    for i in range(len(body.eqns) - 1, -1, -1):
        eqn = body.eqns[i]
        if i not in reducing_eqns and any(o in needed for o in eqn.outvars):
            in_backward.add(i)
            needed.update(x for x in eqn.invars if is_var(x))
    backward = [i for i in range(len(body.eqns)) if i in in_backward]
    live = live_equations(body)
    update = [i for i in range(len(body.eqns)) if i not in in_backward and i not in reducing_eqns and i in live]

    first_use: list[int | None] = [None] * len(body.invars)
    position = {v: k for k, v in enumerate(body.invars)}
    for i in backward:
        for x in body.eqns[i].invars:
            k = position.get(x) if is_var(x) else None
            if k is not None and first_use[k] is None:
                first_use[k] = i
    across = _varying_axes(captured, body, axis)

    def differs(k: int) -> bool:
        out = outvars[captured.outputs[k]]
        if not is_var(out):
            return False
        if captured.kind != "jit":
            return out in varying
        # a jax.jit step's state leaf sharded over data axes differs across them by layout
        # (a parameter block): per device only if it differs across others too
        spec = captured.out_specs[captured.outputs[k]]
        return bool(across.get(out, frozenset()) - set(spec_axes(spec)))

    per_device = frozenset(k for k in range(n_state) if differs(k))
    return Analysis(
        captured,
        tuple(reductions),
        tuple(backward),
        tuple(update),
        frozenset(varying),
        tuple(first_use),
        forward_collectives,
        per_device,
        frozenset(from_data),
        across,
    )


def _no_top_level_reduction(captured: CapturedStep, nested: Any) -> str:
    """Why a ``jax.jit`` step has no gradient reduction to schedule, and what to do: the
    reductions are jaxsched's own (the partitioner places them), so the user cannot move them."""
    axis = captured.axis_name
    if nested is not None:
        where = (
            f"the per-device program sums the gradients over {axis!r} inside a "
            f"{nested.primitive.name} (a loop or branch of the step reads each gradient whole "
            "there)"
        )
    elif captured.gathers:
        shown = ", ".join(f"{name} at {line}" for name, line in captured.gathers[:3])
        more = f" and {len(captured.gathers) - 3} more" if len(captured.gathers) > 3 else ""
        where = (
            f"the batch is gathered before the gradients are computed ({shown}{more}: see the "
            "GatherWarnings), so every device computes the whole gradient and no sum over "
            f"{axis!r} is left"
        )
    else:
        where = f"no gradient of the new params or optimizer state depends on the batch split over {axis!r}"
    return (
        f"jaxsched found no gradient reduction to schedule in this jax.jit step: {where}. "
        "Run it unchanged with strategy='allreduce' meanwhile, and check that the batch is "
        f"sharded over {axis!r} where the step computes the loss"
    )


def _varying_axes(captured: CapturedStep, body, axis: Any) -> dict:
    """The data axes each body variable differs across (only those that differ): seeded by the
    batch (every data axis), a sharded input (the data axes of its spec; a ``shard_map``
    step's state is per device over them all) and ``axis_index``; a sum, maximum or gather
    over axes removes them, a reduce-scatter over axes adds them."""
    data = tuple(as_axes(axis))
    found: dict = {}
    for v, src, spec in zip(body.invars, captured.sources, captured.in_specs):
        on = tuple(a for a in spec_axes(spec) if a in data)
        if src.role == "batch":
            found[v] = frozenset(data)
        elif on and captured.kind == "jit":
            found[v] = frozenset(on)
        elif on and captured.kind != "pmap":
            found[v] = frozenset(data)
    _propagate_varying(body.eqns, data, found)
    return found


def _propagate_varying(eqns: Any, data: tuple, found: dict) -> None:
    """`_varying_axes` through ``eqns``, into ``found``. A conditional's branches are followed
    (their operands vary as the cond's do), so that the update's rules can tell, inside a
    branch, a parameter block from a chunk of a replicated leaf (``MultiSteps``'
    conditional over both, on an FSDP step); a branch's variables are joined over every
    conditional that runs it (a traced branch may be shared)."""
    removes = REDUCTIONS | {"all_gather", "all_gather_invariant"}
    for eqn in eqns:
        name = eqn.primitive.name
        axes = (
            frozenset(a for a in reduction_axes(eqn) if a in data)
            if (name in removes or name in SCATTER_REDUCTIONS)
            else frozenset()
        )
        if name == "axis_index":
            out = frozenset(a for a in as_axes(eqn.params.get("axis_name", ())) if a in data)
        else:
            out = frozenset().union(*(found.get(x, frozenset()) for x in eqn.invars if is_var(x)))
            if name in removes:
                out = out - axes
            elif name in SCATTER_REDUCTIONS:
                out = out | axes
        outs = [out] * len(eqn.outvars)
        if name == "cond":  # each output varies as some branch's does, and with the index
            index = eqn.invars[0]
            outs = [found.get(index, frozenset()) if is_var(index) else frozenset()] * len(eqn.outvars)
            for branch in eqn.params["branches"]:
                inner = branch.jaxpr
                for v, x in zip(inner.invars, eqn.invars[1:]):
                    seen = (found.get(x, frozenset()) if is_var(x) else frozenset()) | found.get(v, frozenset())
                    if seen:
                        found[v] = seen
                _propagate_varying(inner.eqns, data, found)
                outs = [
                    o | (found.get(r, frozenset()) if is_var(r) else frozenset()) for o, r in zip(outs, inner.outvars)
                ]
        for o, varies in zip(eqn.outvars, outs):
            if varies:
                found[o] = found.get(o, frozenset()) | varies


def _varying_with_the_data(captured: CapturedStep, body, axis: Any, scatters: dict) -> set:
    """Values that differ across devices because of the data each device sees (the batch, its
    position): what a gradient reduction sums. Unlike device-varying values in general, a
    ``jax.jit`` step's parameter blocks do not count (they differ by position in the
    parameter, not by data), and reductions and reduce-scatters end the dependence."""
    data_axes = set(as_axes(axis))
    found = set()
    for v, src, spec in zip(body.invars, captured.sources, captured.in_specs):
        sharded = any(a in data_axes for a in spec_axes(spec))
        if src.role == "batch" or (sharded and captured.kind not in ("pmap", "jit")):
            found.add(v)
    ends = set(scatters) | {j for j in scatters.values() if j is not None}
    # a device's position seeds its data in a per-device step (a key folded with it); in a
    # partitioned jax.jit step it only selects the block a device holds of a whole value
    position = captured.kind != "jit"
    for i, eqn in enumerate(body.eqns):
        if i in ends or reduces_over(eqn, axis, REDUCTIONS):
            continue
        if (position and eqn.primitive.name == "axis_index") or any(is_var(x) and x in found for x in eqn.invars):
            found.update(eqn.outvars)
    return found


def _sums_after_scatters(body, data_axes: set) -> dict[int, int | None]:
    """Tiled reduce-scatters over some data axes whose result is then summed over the other
    data axes (or over none, when they span them all): scatter equation -> sum equation."""
    uses: dict = {}
    for i, eqn in enumerate(body.eqns):
        for x in eqn.invars:
            if is_var(x):
                uses.setdefault(x, []).append(i)
    found: dict[int, int | None] = {}
    for i, eqn in enumerate(body.eqns):
        if eqn.primitive.name not in SCATTER_REDUCTIONS or not eqn.params.get("tiled", False):
            continue
        axes = set(reduction_axes(eqn))
        if not axes <= data_axes or len(eqn.invars) != 1:
            continue
        if axes == data_axes:
            found[i] = None
            continue
        readers = uses.get(eqn.outvars[0], [])
        if len(readers) == 1:
            then = body.eqns[readers[0]]
            if then.primitive.name in SUM_REDUCTIONS and set(reduction_axes(then)) == data_axes - axes:
                found[i] = readers[0]
    return found


def _scattered_in_loops(jaxpr: jex_core.Jaxpr, data_axes: set, axis: AxisName) -> bool:
    """Whether every gradient of a ``jax.jit`` step is already reduced where the partitioner
    placed it: inside a loop (a scanned FSDP stack's layer gradients, scattered into their
    blocks in their own iteration), with no whole-gradient sum nested anywhere. A ``jax.jit``
    step holds no collective of the user's, so these are jaxsched's own; the strategy then has
    nothing left to place at the top level, and the step runs as partitioned.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("fsdp",))
        >>> def body(ws):
        ...     scan = lambda c, w: (c, jax.lax.psum_scatter(w, "fsdp", tiled=True))
        ...     return jax.lax.scan(scan, 0.0, ws)[1]
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(None, "fsdp"))
        >>> per_device = jax.make_jaxpr(f)(jnp.ones((3, 8))).jaxpr.eqns[0].params["jaxpr"]
        >>> _scattered_in_loops(per_device, {"fsdp"}, "fsdp")
        True
    """
    if _nested_reduction(jaxpr, axis) is not None:
        return False
    for eqn in jaxpr.eqns:
        for sub in jex_core.jaxprs_in_params(eqn.params):
            for e in nested_eqns(sub):
                if e.primitive.name in SCATTER_REDUCTIONS and set(reduction_axes(e)) & data_axes:
                    return True
    return False


def _nested_reduction(jaxpr: jex_core.Jaxpr, axis: AxisName) -> JaxprEqn | None:
    """The top-level equation whose sub-jaxpr psums over ``axis``, if any."""
    for eqn in jaxpr.eqns:
        for sub in jex_core.jaxprs_in_params(eqn.params):
            if any(reduces_over(e, axis, SUM_REDUCTIONS) for e in nested_eqns(sub)):
                return eqn
    return None
