"""Calls, loops and conditionals in a global jaxpr, per device.

A call (``jit``, ``custom_jvp``/``custom_vjp``, ``jax.checkpoint``) is inlined: its body
is planned with the kinds its operands have. A loop's carry must enter and leave each
iteration in the same kind, so ``scan`` and ``while`` are planned to a fixed point: start
from the kinds of the initial carry, plan the body, widen each carry to the
`join` of what enters and what leaves, until nothing
changes. A gradient accumulated over layers in a ``scan`` thereby stays a partial sum
through the loop and is reduced once, after it. A conditional's branches are planned
with the same operands and return the join of their results' kinds.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxsched.core.partition._interpreter import Partitioner
    >>> from jaxsched.core.partition._kinds import AxisContext, REPLICATED, sharded
    >>> def f(ws, x):  # a scan over stacked layers of a batch-sharded activation
    ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    >>> closed = jax.make_jaxpr(f)(jnp.ones((3, 4, 4)), jnp.ones((8, 4)))
    >>> from jaxsched.core.partition._table import TABLE
    >>> Partitioner(AxisContext("data", 4), TABLE).plan(closed.jaxpr, [REPLICATED, sharded(0)]).out_kinds
    (S(0),)
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn

from jaxsched._errors import JaxschedTypeError
from jaxsched.core.partition._interpreter import EqnPlan, JaxprPlan, Partitioner, Rule, aval_of
from jaxsched.core.partition._kinds import PARTIAL, Kind, REPLICATED, join, sharded
from jaxsched.core._primitives import CALL_PRIMITIVES, scan_counts

__all__ = ["CONTROL_RULES", "call_rule", "is_call"]

#: ``jax.checkpoint``: planned like any call, and kept a checkpoint in the per-device body.
REMAT = frozenset({"remat2", "checkpoint"})
#: Calls whose body is planned with their operands' kinds.
CALLS = CALL_PRIMITIVES | REMAT | {"custom_lin"}

#: How many times a loop's carry kinds may widen before everything is replicated.
MAX_WIDENINGS = 6


def _inner(eqn: JaxprEqn) -> tuple[jex_core.Jaxpr, tuple] | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is None:
            continue
        if hasattr(inner, "jaxpr") and hasattr(inner, "consts"):
            return inner.jaxpr, tuple(inner.consts)
        if isinstance(inner, jex_core.Jaxpr):
            return inner, ()
    return None


def is_call(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a call whose body can be inlined."""
    return eqn.primitive.name in CALLS and _inner(eqn) is not None


def _entry_kinds(kinds: list[Kind], single: list[bool]) -> list[Kind]:
    """Operand kinds a nested body receives: a partial sum that is also used elsewhere is
    reduced first, so that it is reduced once."""
    return [REPLICATED if k.partial and not s else k for k, s in zip(kinds, single)]


def call_rule(
    p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool], out_kinds: Sequence[Kind] | None = None
) -> EqnPlan:
    inner = _inner(eqn)
    if inner is None:  # `rule_for` gives this rule to calls only (`is_call`)
        raise JaxschedTypeError(f"{eqn.primitive.name} is not a call with a body")
    jaxpr, consts = inner
    inputs = _entry_kinds(kinds, single)
    p.callers.append(eqn)
    try:
        sub = p.plan(jaxpr, inputs, out_kinds)
        demanded = _demanded(sub, inputs)
        if demanded != inputs:  # whole operands used as blocks inside: sliced at the call
            inputs, sub = demanded, p.plan(jaxpr, demanded, out_kinds)
    finally:
        p.callers.pop()

    remat = eqn.primitive.name in REMAT

    def run(*values):
        return p.run(sub, consts, values, nested=remat)  # a kept checkpoint nests its body

    if remat:  # keep jax.checkpoint: the per-device body rematerializes too
        run = _rematerialized(eqn, run)
    return EqnPlan(
        tuple(inputs),
        sub.out_kinds,
        lambda values: list(run(*values)),
        with_outputs=lambda wanted: call_rule(p, eqn, kinds, single, tuple(wanted)),
    )


def _demanded(sub: JaxprPlan, inputs: list[Kind]) -> list[Kind]:
    """The call's operand kinds, with each whole operand that every reader inside wants as
    one block asked for as that block: its producer outside can then compute just the block
    (a causal mask broadcast to the batch's shape, read inside the transposed ``where``)."""
    wants: dict = {}
    for e, plan in zip(sub.jaxpr.eqns, sub.eqns):
        for x, kind in zip(e.invars, plan.inputs):
            if isinstance(x, jex_core.Var):
                wants.setdefault(x, set()).add(kind)
    for x, kind in zip(sub.jaxpr.outvars, sub.out_kinds):
        if isinstance(x, jex_core.Var):
            wants.setdefault(x, set()).add(kind)
    demanded = list(inputs)
    for i, (x, kind) in enumerate(zip(sub.jaxpr.invars, inputs)):
        wanted = wants.get(x, set())
        if kind.is_replicated and len(wanted) == 1:
            (only,) = wanted
            if only.dim is not None and not only.partial and not only.is_special:
                demanded[i] = only
    return demanded


def _rematerialized(eqn: JaxprEqn, run: Any) -> Any:
    """``run`` as the checkpoint ``eqn`` is: recomputed, and, where ``eqn`` is backward's
    recomputation (``differentiated``), behind an optimization barrier on the operands
    ``prevent_cse`` names, as JAX lowers it. ``jax.checkpoint`` of an undifferentiated
    function lowers to no barrier, and XLA would then merge the recomputation with forward
    (and a parameter's gather inside it with forward's gather), keeping every layer's
    activations and gathered weights alive until backward."""
    prevent_cse = eqn.params.get("prevent_cse", True)
    checkpointed = jax.checkpoint(run, prevent_cse=prevent_cse, policy=eqn.params.get("policy"))
    if not eqn.params.get("differentiated", False):
        return checkpointed

    def behind_barrier(*values):
        guard = prevent_cse if isinstance(prevent_cse, tuple) else (bool(prevent_cse),) * len(values)
        kept = [v for v, g in zip(values, guard) if g]
        if kept:
            kept = list(lax.optimization_barrier(tuple(kept)))
        it = iter(kept)
        return checkpointed(*[next(it) if g else v for v, g in zip(values, guard)])

    return behind_barrier


def _widen(p: Partitioner, plan_body, carry: list[Kind]) -> tuple[list[Kind], JaxprPlan]:
    """Carry kinds at the fixed point of ``plan_body`` (carry kinds -> plan whose first
    outputs are the new carry)."""
    for _ in range(MAX_WIDENINGS):
        sub = plan_body(carry)
        out = sub.out_kinds[: len(carry)]
        widened = [join(c, o) for c, o in zip(carry, out)]
        if widened == carry:
            return carry, sub
        carry = widened
    carry = [REPLICATED] * len(carry)
    return carry, plan_body(carry)


def _summed_carries(plan_body, carry: list[Kind], sub: JaxprPlan, first: int) -> tuple[list[Kind], JaxprPlan]:
    """Carries kept as partial sums across the loop: an accumulator of per-iteration partial
    sums (gradient accumulation over microbatches: ``acc + grad``) is reduced once, after the
    loop, instead of in every iteration. A carry is kept partial when, so planned, it comes
    out partial and every reader inside takes it as it is (no sum inside the loop)."""
    for k, kind in enumerate(carry):
        if not kind.is_replicated or not sub.out_kinds[k].is_replicated:
            continue
        trial_kinds = carry[:k] + [PARTIAL] + carry[k + 1 :]
        trial = plan_body(trial_kinds)
        if trial.out_kinds[k] == PARTIAL and _wanted_as(trial, trial.jaxpr.invars[first + k]) <= {PARTIAL}:
            fixed = [join(c, o) for c, o in zip(trial_kinds, trial.out_kinds[: len(carry)])]
            if fixed == trial_kinds:
                carry, sub = trial_kinds, trial
    return carry, sub


def scan_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    params = eqn.params
    closed = params["jaxpr"]
    n_consts, n_carry = scan_counts(params)
    entry = _entry_kinds(kinds, single)
    consts, carry = entry[:n_consts], entry[n_consts : n_consts + n_carry]
    xs_outer, xs_inner = [], []
    for k, x in zip(entry[n_consts + n_carry :], eqn.invars[n_consts + n_carry :]):
        if k == sharded(0) and p.ctx.can_shard(aval_of(x).shape, 1):
            k = sharded(1)  # microbatches held whole by each device: swapped for their rows
        if k.dim == 0:  # scanning over the sharded dimension itself: every step needs the whole
            if not k.is_block:
                p.gathered(eqn, "scans over the sharded (batch) dimension")
            k = REPLICATED
        xs_outer.append(k)
        xs_inner.append(k.moved(k.dim - 1) if k.dim is not None else k)

    def plan_body(carry_kinds: list[Kind], out_kinds: Sequence[Kind] | None = None) -> JaxprPlan:
        return p.plan(closed.jaxpr, consts + list(carry_kinds) + xs_inner, out_kinds)

    outer_hints = dict(p.hints)  # the enclosing jaxpr's (planning the body replaces them)
    carry, natural = _widen(p, plan_body, carry)
    carry, natural = _summed_carries(plan_body, carry, natural, n_consts)
    demanded = _demanded(natural, consts + list(carry) + xs_inner)[:n_consts]
    if demanded != consts:  # loop-invariant whole values the body reads as blocks
        consts = demanded
        carry, natural = _widen(p, plan_body, carry)
    ys_inner = list(natural.out_kinds[n_carry:])
    for i, (kind, out) in enumerate(zip(ys_inner, eqn.outvars[n_carry:])):
        # a per-iteration partial sum (a layer's weight gradient) whose stack meets a parameter
        # block after the loop is reduce-scattered into the layer's block in its iteration
        hint = outer_hints.get(out)
        if kind.partial and hint is not None and hint.is_block and hint.split >= 1:
            ys_inner[i] = hint.moved(hint.split - 1)
    body = plan_body(carry, carry + ys_inner)
    ys_outer = [k.moved(k.dim + 1) if k.dim is not None else k for k in ys_inner]
    prefetch = _prefetched(p, natural, xs_inner, params["length"])
    if prefetch:
        swapped = [REPLICATED if k in prefetch else kind for k, kind in enumerate(xs_inner)]
        body = p.plan(closed.jaxpr, consts + list(carry) + swapped, carry + ys_inner)
        emit = _double_buffered(p, eqn, body, prefetch, xs_inner)
    else:
        emit = _scan_emit(p, eqn, body)
    return EqnPlan(tuple(consts + carry + xs_outer), tuple(carry + ys_outer), emit)


def _prefetched(p: Partitioner, natural: JaxprPlan, xs_inner: list[Kind], length: int) -> frozenset[int]:
    """The scanned parameter blocks (a layer stack's weights, FSDP) whose next slice is
    gathered during the current iteration: those that the body reads whole, so that handing
    it the gathered slice changes nothing else in its plan. A block the body uses as a block
    (a per-layer update) is left as it is."""
    blocks = [k for k, kind in enumerate(xs_inner) if kind.is_block]
    if not blocks or length < 2:
        return frozenset()
    swapped = [REPLICATED if k in blocks else kind for k, kind in enumerate(xs_inner)]
    saved, p.trying = p.trying, True
    try:
        trial = p.plan(natural.jaxpr, list(natural.in_kinds[: len(natural.in_kinds) - len(xs_inner)]) + swapped)
    finally:
        p.trying = saved
    if trial.out_kinds != natural.out_kinds:
        return frozenset()
    return frozenset(blocks)


def _scan_emit(p: Partitioner, eqn: JaxprEqn, body: JaxprPlan) -> Any:
    params = eqn.params
    n_consts, n_carry = scan_counts(params)

    def emit(values: list) -> list:
        const_vals = values[:n_consts]
        init = values[n_consts : n_consts + n_carry]
        xs = values[n_consts + n_carry :]

        def step(c, x):
            outs = p.run(body, params["jaxpr"].consts, [*const_vals, *c, *x], nested=True)
            return outs[:n_carry], outs[n_carry:]

        final, ys = lax.scan(
            step, list(init), list(xs), length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
        return [*final, *ys]

    return emit


def _double_buffered(
    p: Partitioner, eqn: JaxprEqn, body: JaxprPlan, prefetch: frozenset[int], xs_inner: list[Kind]
) -> Any:
    """The scan with its layer weights double-buffered: the carry holds the current layer's
    gathered weights while the iteration gathers the next layer's, which nothing in the
    iteration waits for, so the gather runs under the layer's compute (prefetch distance one:
    two layers gathered at once)."""
    params = eqn.params
    n_consts, n_carry = scan_counts(params)
    length, reverse = params["length"], params["reverse"]
    order = sorted(prefetch)
    xs_vars: list[Any] = list(eqn.invars[n_consts + n_carry :])
    shapes = {k: xs_vars[k].aval.shape[1:] for k in order}

    def gather(k: int, block: Any) -> Any:
        return p.ctx.convert(block, xs_inner[k], REPLICATED, shapes[k])

    def emit(values: list) -> list:
        const_vals = values[:n_consts]
        init = values[n_consts : n_consts + n_carry]
        xs = values[n_consts + n_carry :]
        first = length - 1 if reverse else 0
        stacks = [xs[k] for k in order]  # read in place (a shifted copy would cost a stack)

        def step(state, x):
            c, current, index = state
            # the slice the next iteration runs on; the last iteration fetches its own again,
            # unused, which keeps the loop whole (its outputs stacked by the scan itself)
            coming = jnp.clip(index - 1 if reverse else index + 1, 0, length - 1)
            gathered = [
                gather(k, lax.dynamic_index_in_dim(stack, coming, 0, keepdims=False)) for k, stack in zip(order, stacks)
            ]
            x = list(x)
            for k, whole in zip(order, current):
                x[k] = whole
            outs = p.run(body, params["jaxpr"].consts, [*const_vals, *c, *x], nested=True)
            return (outs[:n_carry], gathered, coming), outs[n_carry:]

        current = [gather(k, xs[k][first]) for k in order]
        start = jnp.asarray(first, jnp.int32)
        (final, _, _), ys = lax.scan(
            step, (list(init), current, start), list(xs), length=length, reverse=reverse, unroll=params["unroll"]
        )
        return [*final, *ys]

    return emit


def while_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    params = eqn.params
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    entry = _entry_kinds(kinds, single)
    cond_consts, body_consts, carry = entry[:nc], entry[nc : nc + nb], entry[nc + nb :]
    cond_consts = [REPLICATED if k.partial else k for k in cond_consts]

    def plan_body(carry_kinds: list[Kind], out_kinds: Sequence[Kind] | None = None) -> JaxprPlan:
        return p.plan(body.jaxpr, body_consts + list(carry_kinds), out_kinds)

    carry, _ = _widen(p, plan_body, carry)
    body_plan = plan_body(carry, carry)
    cond_plan = p.plan(cond.jaxpr, cond_consts + carry, [REPLICATED])

    def emit(values: list) -> list:
        cvals, bvals, init = values[:nc], values[nc : nc + nb], values[nc + nb :]
        return list(
            lax.while_loop(
                lambda c: p.run(cond_plan, cond.consts, [*cvals, *c], nested=True)[0],
                lambda c: p.run(body_plan, body.consts, [*bvals, *c], nested=True),
                list(init),
            )
        )

    return EqnPlan(tuple(cond_consts + body_consts + carry), tuple(carry), emit)


def _wanted_as(sub: JaxprPlan, var: jex_core.Var) -> set[Kind]:
    """The kinds the readers of ``var`` inside a planned jaxpr take it in (and its kind as an
    output, where it is one)."""
    wanted = {
        kind
        for e, plan in zip(sub.jaxpr.eqns, sub.eqns)
        for x, kind in zip(e.invars, plan.inputs)
        if isinstance(x, jex_core.Var) and x == var
    }
    wanted.update(kind for x, kind in zip(sub.jaxpr.outvars, sub.out_kinds) if isinstance(x, jex_core.Var) and x == var)
    return wanted


def cond_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    branches = eqn.params["branches"]
    operands = _entry_kinds(kinds[1:], single[1:])
    # a partial sum that a branch reduces (optax.MultiSteps' update on the gradient) is
    # reduced before the cond, at the top level, where the strategies schedule reductions
    trial = [p.plan(b.jaxpr, operands) for b in branches]
    operands = [
        REPLICATED if k.partial and any(_wanted_as(t, t.jaxpr.invars[i]) - {k} for t in trial) else k
        for i, k in enumerate(operands)
    ]
    natural = [p.plan(b.jaxpr, operands).out_kinds for b in branches]
    outs = [functools.reduce(join, ks) for ks in zip(*natural)]
    plans = [p.plan(b.jaxpr, operands, outs) for b in branches]

    def emit(values: list) -> list:
        index, ops = values[0], values[1:]
        fns = [lambda *a, b=b, plan=plan: p.run(plan, b.consts, a, nested=True) for b, plan in zip(branches, plans)]
        return list(lax.switch(index, fns, *ops))

    return EqnPlan((REPLICATED, *operands), tuple(outs), emit)


CONTROL_RULES: dict[str, Rule] = {"scan": scan_rule, "while": while_rule, "cond": cond_rule}
