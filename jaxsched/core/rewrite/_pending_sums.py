"""Scalar sums over devices, deferred and batched into one collective.

A sharded update computes norms from per-device terms: ``clip_by_global_norm`` sums each
leaf's squares on its chunk and then over the devices, one scalar all-reduce per leaf (46
to 65 per step on a Transformer); LAMB's trust ratios take two norms per leaf. Each is
latency, not bandwidth. Here such a sum is kept as a `PendingSum` (this device's
term), and every scalar computed from pending sums (their total over leaves, a square
root, a ratio) waits with them, to be computed from the totals later. Only a value that is
not a scalar (an update scaled by the clip factor) or another collective makes the sums
reduce, and then *every* waiting sum at once, stacked into one vector per dtype and axes:
one all-reduce where there were many. The scalars are then computed exactly as written, on
the same totals, so the numbers are those of one all-reduce per sum.

Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> def norms(x):
    ...     pending = PendingSums()
    ...     a = pending.defer(jnp.sum(x ** 2), "d")
    ...     b = pending.defer(jnp.sum(jnp.abs(x)), "d")
    ...     total = pending.later(lambda a, b: [a + b], [a, b])[0]
    ...     return jnp.stack(pending.resolve([total, a]))
    >>> f = jax.jit(jax.shard_map(norms, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P()))
    >>> [float(v) for v in f(jnp.arange(4.0))]
    [20.0, 14.0]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched.core._replay import Run, bind, interpret

__all__ = ["PendingSum", "PendingSums", "interpret_batching_sums", "is_pending", "sums_together"]

#: primitives that communicate: never computed later from totals (a psum of a pending
#: value reduces the waiting sums first and is itself deferred, at the next level)
_COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter", "reduce_scatter", "axis_index"}
)


@dataclasses.dataclass(eq=False)
class PendingSum:
    """A scalar not known yet on this device: a sum over devices, or computed from some.

    Attributes:
      local: a sum's term on this device (a one-element array); None for a computed value.
      axes: the mesh axes a sum runs over.
      compute: a computed value's function of nothing, reading its sources' totals.
      total: the value, once known (None before).
      absorbed: a sum that a wider sum contains (it is reduced only if read itself).
    """

    local: Any = None
    axes: Any = None
    compute: Callable[[], Any] | None = None
    total: Any = None
    absorbed: bool = False


class PendingSums:
    """The pending sums of one update region: deferred, combined, reduced together."""

    def __init__(self) -> None:
        self.waiting: list[PendingSum] = []

    def defer(self, local: Any, axes: Any) -> PendingSum:
        """A sum over ``axes`` of every device's ``local``, reduced at the next flush."""
        pending = PendingSum(local=jnp.asarray(local), axes=axes)
        self.waiting.append(pending)
        return pending

    def later(self, fn: Callable[..., Sequence[Any]], values: Sequence[Any], num_outputs: int = 1) -> list:
        """``fn(*values)``'s ``num_outputs`` outputs, computed once every pending value
        among ``values`` is known: nothing is emitted now."""
        outputs: list = []

        def run() -> Sequence[Any]:
            if not outputs:
                outputs.extend(fn(*[self.value(v) for v in values]))
            return outputs

        def output(k: int) -> Callable[[], Any]:
            return lambda: run()[k]

        return [PendingSum(compute=output(k)) for k in range(num_outputs)]

    def widen(self, eqn: Any, values: Sequence[Any]) -> list | None:
        """A ``psum`` over more axes of sums pending over others (HSDP: a block's chunk
        summed over the replica axis, then over the FSDP axis): one sum over all of them."""
        if eqn.primitive.name != "psum" or eqn.params.get("axis_index_groups") is not None:
            return None
        more = _key(eqn.params["axes"])
        fits = lambda v: is_pending(v) and v.local is not None and v.compute is None
        if not values or not all(fits(v) and not set(more) & set(_key(v.axes)) for v in values):
            return None
        for v in values:
            v.absorbed = True  # read alone (rarely), it is reduced alone
        return [self.defer(v.local, _key(v.axes) + more) for v in values]

    def reshape(self, value: Any, shape: tuple) -> PendingSum | None:
        """A sum in another one-element shape (``keepdims=True``) as a sum itself, so that a
        ``psum`` over more axes can widen it; the sum it came from reads its total."""
        if not (is_pending(value) and value.local is not None and math.prod(shape) == 1):
            return None
        view = self.defer(jnp.reshape(value.local, shape), value.axes)
        value.absorbed = True
        value.compute = lambda: jnp.reshape(self.value(view), jnp.shape(value.local))
        return view

    def resolve(self, values: Sequence[Any]) -> list:
        """``values`` with every pending one replaced by its value: all waiting sums
        reduced now, one all-reduce per axes and dtype."""
        if any(is_pending(v) for v in values):
            self.flush()
        return [self.value(v) for v in values]

    def value(self, v: Any) -> Any:
        """``v``'s value (a sum absorbed into a wider one and read after all is reduced
        on its own)."""
        if not isinstance(v, PendingSum):
            return v
        if v.total is None:
            v.total = v.compute() if v.compute is not None else lax.psum(v.local, v.axes)
        return v.total

    def flush(self) -> None:
        groups: dict = {}
        for pending in self.waiting:
            if pending.total is None and not pending.absorbed and pending.compute is None:
                groups.setdefault((_key(pending.axes), jnp.result_type(pending.local)), []).append(pending)
        for members in groups.values():
            axes = members[0].axes
            totals = lax.psum(jnp.stack([jnp.reshape(p.local, ()) for p in members]), axes)
            for k, pending in enumerate(members):
                pending.total = jnp.reshape(totals[k], jnp.shape(pending.local))
        self.waiting = [p for p in self.waiting if p.total is None]


def interpret_batching_sums(
    eqns: Sequence[Any],
    read_operand: Callable[[Any], Any],
    write: Callable[[Any, Any], None],
    run: Run = bind,
    sums: PendingSums | None = None,
) -> None:
    """`interpret` for an update region, its scalar sums over
    devices batched: the equations are taken in `sums_together`'s order, a ``psum``
    of one-element values (a sharded parameter's norm, from the partition stage) is
    deferred, ``run`` may defer more into ``sums`` (a sum over a chunk), and a scalar
    computed from pending values waits with them. Every value still pending at the end of
    the region is reduced then and written as its value."""
    sums = PendingSums() if sums is None else sums
    written: list = []

    def batching_run(eqn: Any, values: list) -> Sequence[Any]:
        values = [v.total if isinstance(v, PendingSum) and v.total is not None else v for v in values]
        widened = sums.widen(eqn, values)
        if widened is not None:
            return widened
        if any(is_pending(v) for v in values):
            if eqn.primitive.name in _RESHAPES and eqn.primitive.name != "convert_element_type":
                reshaped = sums.reshape(values[0], tuple(eqn.outvars[0].aval.shape))
                if reshaped is not None:
                    return [reshaped]
            if _scalar_only(eqn, values):
                return sums.later(lambda *known: run(eqn, list(known)), values, len(eqn.outvars))
            values = sums.resolve(values)
        if _one_element_psum(eqn, values):
            return [sums.defer(v, eqn.params["axes"]) for v in values]
        return run(eqn, values)

    def keep(var: Any, value: Any) -> None:
        if isinstance(value, PendingSum):
            written.append((var, value))
        write(var, value)

    interpret(sums_together(eqns), read_operand, keep, run=batching_run)
    if any(is_pending(v) for _, v in written):
        sums.flush()
    for var, value in written:
        write(var, sums.value(value))


def _one_element(value: Any) -> bool:
    if isinstance(value, PendingSum):
        return True
    if isinstance(value, (int, float, bool, np.ndarray, np.generic, jax.Array)):
        return np.size(value) == 1
    return False


def _scalar_only(eqn: Any, values: Sequence[Any]) -> bool:
    """Whether ``eqn`` computes one-element values from one-element values only, with no
    collective, body or effect: safe to compute later from totals."""
    if eqn.primitive.name in _COLLECTIVES or _orders(eqn) or any(_has_body(p) for p in eqn.params.values()):
        return False
    return all(_one_element(v) for v in values) and all(math.prod(v.aval.shape) == 1 for v in eqn.outvars)


def _has_body(param: Any) -> bool:
    return isinstance(param, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) or (
        isinstance(param, (tuple, list)) and any(_has_body(p) for p in param)
    )


def _one_element_psum(eqn: Any, values: Sequence[Any]) -> bool:
    return (
        eqn.primitive.name == "psum"
        and eqn.params.get("axis_index_groups") is None
        and all(isinstance(v, jax.Array) and v.size == 1 and jnp.issubdtype(v.dtype, jnp.floating) for v in values)
    )


def sums_together(eqns: Sequence[Any]) -> list:
    """``eqns`` reordered so that sums which do not depend on each other come before any
    equation that reads one: LAMB computes each leaf's trust ratio from its own two norms,
    so in the written order every leaf's sums are read (and reduced) before the next leaf's
    are taken, one all-reduce per leaf. Reordered, they are pending together.

    Each equation is keyed by how many sums lie on its longest input path: a sum after
    every equation its operands need, and every reader of a sum after all the sums of its
    level (a local sum, its reshapes and the ``psum`` that completes it count as one). Equal
    keys keep the written order, so the result is a topological order of the same
    equations. Equations with effects keep the written order (nothing is moved).
    """
    eqns = list(eqns)
    if any(_orders(e) for e in eqns):
        return eqns
    level: dict = {}
    summed: set = set()  # outputs of a local sum: a psum of one completes that sum
    keys = []
    for eqn in eqns:
        operands = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        base = max((level.get(v, 0) for v in operands), default=0)
        name = eqn.primitive.name
        scalar_psum = name == "psum" and all(math.prod(v.aval.shape) == 1 for v in eqn.outvars)
        if scalar_psum and operands and all(v in summed for v in operands):
            out, key = base, 2 * base - 1  # the same sum as the local one before it
        elif name == "reduce_sum" or scalar_psum:
            out, key = base + 1, 2 * base + 1
            if name == "reduce_sum":
                summed.update(eqn.outvars)
        elif name in _RESHAPES and operands and all(v in summed for v in operands):
            out, key = base, 2 * base - 1  # keepdims=True: the local sum in another shape
            summed.update(eqn.outvars)
        else:
            out, key = base, 2 * base
        keys.append(key)
        level.update((v, out) for v in eqn.outvars)
    return [eqns[i] for _, i in sorted(zip(keys, range(len(eqns))))]


_RESHAPES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "convert_element_type"})


def _orders(eqn: Any) -> bool:
    """Whether ``eqn`` has an effect beyond naming a mesh axis (a callback, a print): such
    equations keep their written order."""
    return any(type(effect).__name__ != "NamedAxisEffect" for effect in eqn.effects)


def _key(axes: Any) -> tuple:
    """Mesh axes as a tuple in one order: a sum over them is the same in any order."""
    return tuple(sorted(axes, key=str)) if isinstance(axes, (tuple, list)) else (axes,)


def is_pending(value: Any) -> bool:
    """Whether ``value`` is a scalar not known yet (a sum over devices not yet reduced, or
    computed from one)."""
    return isinstance(value, PendingSum) and value.total is None
