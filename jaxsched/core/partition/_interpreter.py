"""Plan, then run: the two passes that turn a global jaxpr into a per-device computation.

`Partitioner.plan` walks a jaxpr once with the `Kind`
of every input and asks each equation's rule (`jaxsched.core.partition._rules`, keyed by
primitive, as JAX's batching rules are) which kind it needs of each operand and which kinds
its results have. Kinds must be known before anything is traced: a loop's carry must
enter and leave in the same kind, and a ``shard_map``'s output specs are fixed when it is
called. `Partitioner.run` then evaluates the plan on local values where a
``shard_map`` body is being traced, converting operands between kinds (an all-gather, a
``psum``, a local slice) where a rule asked for it, once per variable and kind.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxsched.core.partition._kinds import AxisContext, sharded, REPLICATED
    >>> closed = jax.make_jaxpr(lambda w, x: jnp.sum(x @ w))(jnp.ones((3, 2)), jnp.ones((8, 3)))
    >>> from jaxsched.core.partition._table import TABLE
    >>> p = Partitioner(AxisContext("data", 4), TABLE)
    >>> p.plan(closed.jaxpr, [REPLICATED, sharded(0)]).out_kinds
    (Pt,)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn
from jax.extend import source_info_util

from jaxsched._errors import JaxschedError, JaxschedWarning
from jaxsched.core.partition._kinds import AxisContext, Kind, REPLICATED
from jaxsched.core._replay import aval_of, source_line

__all__ = [
    "EqnPlan",
    "GatherWarning",
    "JaxprPlan",
    "NarrowRule",
    "Partitioner",
    "PartitionError",
    "Rule",
    "RuleTable",
    "aval_of",
]


class PartitionError(JaxschedError, ValueError):
    """A ``jax.jit`` step the per-device rewrite cannot make exact; the message names the
    primitive and the source line."""


class GatherWarning(JaxschedWarning):
    """An operation mixes examples across the sharded batch: its batch-sharded operands are
    all-gathered (exact, at the cost of the gather).

    Only a ``jax.jit`` step on global arrays can do this (a ``shard_map`` body sees its own
    shard); the warning names the operation and its source line, so it can be rewritten
    per example or accepted.

    Example:
        >>> import jax, optax, jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> import warnings
        >>> auto = (jax.sharding.AxisType.Auto,)
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=auto)
        >>> tx = optax.sgd(0.1)
        >>> def step(p, o, batch):
        ...     x, y = batch
        ...     x = x + jax.numpy.roll(x, 1, axis=0)  # mixes neighbouring examples
        ...     loss = lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean()
        ...     updates, o = tx.update(jax.grad(loss)(p), o, p)
        ...     return optax.apply_updates(p, updates), o
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> sched = jaxsched.schedule(jax.jit(step))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = sched(sched.init(params, tx.init(params)), batch)
        >>> any(issubclass(w.category, jaxsched.GatherWarning) for w in caught)
        True
    """


@dataclasses.dataclass
class EqnPlan:
    """What one equation does per device.

    Attributes:
      inputs: the kind each operand must be converted to before ``emit``.
      outputs: the kind of each result.
      emit: local operand values (in ``inputs`` kinds) -> local results.
    """

    inputs: tuple[Kind, ...]
    outputs: tuple[Kind, ...]
    emit: Callable[[list], Sequence[Any]]
    #: for a call: its plan with the results returned in the given kinds, so that a value
    #: computed whole inside it (a mask broadcast to the batch's shape) is computed as the
    #: block its readers outside want
    with_outputs: Callable[[Sequence[Kind]], "EqnPlan"] | None = None


@dataclasses.dataclass
class JaxprPlan:
    """A jaxpr with the plan of each equation and the kinds of its inputs and outputs
    (``out_kinds``: the kinds the outputs are returned in)."""

    jaxpr: jex_core.Jaxpr
    in_kinds: tuple[Kind, ...]
    out_kinds: tuple[Kind, ...]
    eqns: list[EqnPlan]
    kinds: dict


#: A rule: ``(partitioner, eqn, operand kinds, whether this equation is each operand's only
#: use) -> plan`` (`jaxsched.core.partition._forward_rules`).
Rule = Callable[["Partitioner", JaxprEqn, list[Kind], list[bool]], EqnPlan]
#: A narrowing rule: ``(partitioner, eqn, d) -> plan computing block d of the result``, or
#: None when it cannot (`jaxsched.core.partition._narrowing_rules`).
NarrowRule = Callable[["Partitioner", JaxprEqn, int], "EqnPlan | None"]


@dataclasses.dataclass(frozen=True)
class RuleTable:
    """Where the partitioner finds its rules (`jaxsched.core.partition.TABLE`):
    passed in, so that the interpreter knows no rule and the rules may use the interpreter.

    Attributes:
      rule_for: ``eqn -> rule``: how an equation is planned.
      narrow_rule_for: ``eqn -> narrowing rule or None``: how a replicated producer computes
        only the block its readers want.
      block_rule_for: ``eqn -> rule or None``: the rule of an equation that reads a parameter
        block or a partial sum over some data axes; None: such operands are gathered
        (summed) first and the equation's own rule runs on whole values.
      hints_for: ``(jaxpr, out_kinds) -> {variable: kind}``: values that will meet a
        parameter block, which their block rule then computes as that block.
    """

    rule_for: Callable[[JaxprEqn], Rule]
    narrow_rule_for: Callable[[JaxprEqn], NarrowRule | None]
    block_rule_for: Callable[[JaxprEqn], Rule | None] = lambda eqn: None
    hints_for: Callable[[jex_core.Jaxpr, Sequence[Kind] | None], dict] = lambda jaxpr, out_kinds: {}


class Partitioner:
    """Plans and runs global jaxprs per device along one data axis (see the module doc).

    Attributes:
      ctx: the data axes and their conversions.
      gathers: ``(primitive, source line)`` of every operation that gathered the batch.
      zeros: variables known to hold zeros (a zero is a partial sum as it is).
      depth: how many loops, branches and checkpoints the body being run sits in (0: the
        top level, whose gradient reductions the strategies schedule).
    """

    def __init__(self, ctx: AxisContext, rules: "RuleTable"):
        self.ctx = ctx
        self.rules = rules
        self.gathers: list[tuple[str, str]] = []
        self.zeros: set = set()
        self.callers: list = []  # the call equations being planned, outermost first
        self.trying = False  # planning hypothetically (narrowing): record nothing
        self.hints: dict = {}  # of the jaxpr being planned (RuleTable.hints_for)
        self.depth = 0

    # -- planning ---------------------------------------------------------------------------
    def plan(self, jaxpr, in_kinds: Sequence[Kind], out_kinds: Sequence[Kind] | None = None) -> JaxprPlan:
        """The plan of ``jaxpr`` for inputs of ``in_kinds`` (constvars are replicated); with
        ``out_kinds`` the outputs are converted to those kinds."""
        saved, self.hints = self.hints, self.rules.hints_for(jaxpr, out_kinds)
        try:
            return self._plan(jaxpr, in_kinds, out_kinds)
        finally:
            self.hints = saved

    def _plan(self, jaxpr, in_kinds: Sequence[Kind], out_kinds: Sequence[Kind] | None) -> JaxprPlan:
        rule_for = self.rules.rule_for
        hints = self.hints
        kinds: dict = {v: REPLICATED for v in jaxpr.constvars}
        kinds.update(zip(jaxpr.invars, in_kinds, strict=True))
        uses: dict = {}
        for eqn in jaxpr.eqns:
            for x in eqn.invars:
                if isinstance(x, jex_core.Var):
                    uses[x] = uses.get(x, 0) + 1
        for x in jaxpr.outvars:
            if isinstance(x, jex_core.Var):
                uses[x] = uses.get(x, 0) + 1
        plans = []
        for eqn in jaxpr.eqns:
            operand_kinds = [self.kind_of(kinds, x) for x in eqn.invars]
            single = [isinstance(x, jex_core.Var) and uses.get(x, 0) == 1 for x in eqn.invars]
            rule = rule_for(eqn)
            special = any(k.is_special for k in operand_kinds)
            hinted = bool(hints) and any(
                isinstance(x, jex_core.Var) and x in hints for x in (*eqn.outvars, *eqn.invars)
            )
            if special or hinted:
                block_rule = self.rules.block_rule_for(eqn)
                if block_rule is not None:
                    rule = block_rule
                elif special:  # FSDP's gather before use: the rule sees whole values
                    operand_kinds = [REPLICATED if k.is_special else k for k in operand_kinds]
            plan = rule(self, eqn, operand_kinds, single)
            if len(plan.inputs) != len(eqn.invars) or len(plan.outputs) != len(eqn.outvars):
                raise AssertionError(
                    f"rule for {eqn.primitive.name} planned {len(plan.inputs)} inputs / {len(plan.outputs)} outputs"
                )
            kinds.update(zip(eqn.outvars, plan.outputs))
            self._track_zeros(eqn)
            plans.append(plan)
        natural = tuple(self.kind_of(kinds, x) for x in jaxpr.outvars)
        out_kinds = tuple(out_kinds) if out_kinds is not None else natural
        self._narrow(jaxpr, plans, kinds, out_kinds)
        return JaxprPlan(jaxpr, tuple(in_kinds), out_kinds, plans, kinds)

    def _narrow(self, jaxpr, plans: list, kinds: dict, out_kinds: Sequence[Kind]) -> None:
        """Compute blocks, not whole values, where only blocks are read.

        A value computed from replicated inputs alone (a dropout mask drawn from one key, an
        iota, a broadcast constant) is whole on every device, and a rule that meets it beside
        a batch block slices it. When every reader wants the same block, the producer is
        planned to compute just that block (`NARROW`), as XLA's
        partitioner would: one pass from the outputs back."""
        narrow_rule_for = self.rules.narrow_rule_for
        wants: dict = {}

        def want(x: jex_core.Var | jex_core.Literal, kind: Kind, count: int) -> None:
            if isinstance(x, jex_core.Var):
                tally = wants.setdefault(x, {})
                tally[kind] = tally.get(kind, 0) + count

        for eqn, plan in zip(jaxpr.eqns, plans):
            for x, k in zip(eqn.invars, plan.inputs):
                want(x, k, 1)
        for x, k in zip(jaxpr.outvars, out_kinds):
            want(x, k, 1)
        for index in range(len(plans) - 1, -1, -1):
            eqn, plan = jaxpr.eqns[index], plans[index]
            if plan.with_outputs is not None:
                self._narrow_call(eqn, index, plans, kinds, wants, want)
                continue
            if len(eqn.outvars) != 1 or not all(k.is_replicated for k in plan.inputs + plan.outputs):
                continue
            tally = {k: n for k, n in wants.get(eqn.outvars[0], {}).items() if n}
            if len(tally) != 1:
                continue
            (wanted,) = tally
            rule = narrow_rule_for(eqn)
            if wanted.dim is None or wanted.partial or wanted.is_special or rule is None:
                continue
            narrowed = rule(self, eqn, wanted.dim)
            if narrowed is None:
                continue
            plans[index] = narrowed
            kinds[eqn.outvars[0]] = wanted
            for x, old, new in zip(eqn.invars, plan.inputs, narrowed.inputs):
                want(x, old, -1)
                want(x, new, 1)

    def _narrow_call(self, eqn: JaxprEqn, index: int, plans: list, kinds: dict, wants: dict, want: Callable) -> None:
        """A call's whole results that every reader outside wants as one block are returned
        as that block, computed as such inside the call."""
        plan = plans[index]
        outputs = list(plan.outputs)
        for k, (x, kind) in enumerate(zip(eqn.outvars, plan.outputs)):
            tally = {w: n for w, n in wants.get(x, {}).items() if n}
            if not kind.is_replicated or len(tally) != 1:
                continue
            (wanted,) = tally
            if wanted.dim is not None and not wanted.partial and not wanted.is_special:
                outputs[k] = wanted
        if outputs == list(plan.outputs):
            return
        narrowed = plan.with_outputs(outputs)
        plans[index] = narrowed
        for o, kind in zip(eqn.outvars, narrowed.outputs):
            kinds[o] = kind
        for a, old, new in zip(eqn.invars, plan.inputs, narrowed.inputs):
            want(a, old, -1)
            want(a, new, 1)

    @staticmethod
    def kind_of(kinds: dict, x: jex_core.Var | jex_core.Literal) -> Kind:
        return REPLICATED if isinstance(x, jex_core.Literal) else kinds[x]

    def is_zero(self, x: jex_core.Var | jex_core.Literal) -> bool:
        if isinstance(x, jex_core.Literal):
            try:
                return not bool(x.val != 0)
            except (TypeError, ValueError):
                return False
        return x in self.zeros

    def _track_zeros(self, eqn: JaxprEqn) -> None:
        name = eqn.primitive.name
        if (
            name in ("broadcast_in_dim", "convert_element_type", "reshape", "copy", "copy_p")
            and eqn.invars
            and self.is_zero(eqn.invars[0])
        ):
            self.zeros.update(eqn.outvars)

    def where(self, eqn: JaxprEqn) -> str:
        """The user's source line of ``eqn``, or of the innermost call it was inlined from
        (``jnp.roll`` or ``jnp.sort`` run jitted library code that has none)."""
        for candidate in [eqn, *reversed(self.callers)]:
            try:
                line = source_info_util.summarize(candidate.source_info)
            except Exception:  # messages degrade to the next caller
                line = ""
            if line:
                return line
        return source_line(eqn)

    def gathered(self, eqn: JaxprEqn, why: str) -> None:
        """Record (and warn once about) an operation that gathers the batch."""
        if self.trying:
            return
        key = (eqn.primitive.name, self.where(eqn))
        if key in self.gathers:
            return
        warned = any(name == key[0] for name, _ in self.gathers)  # once per primitive: not per layer
        self.gathers.append(key)
        if warned:
            return
        warnings.warn(
            f"jaxsched: {key[0]} at {key[1]} {why}; its batch-sharded operands are "
            f"all-gathered over {self.ctx.axis_name!r} so that it runs on the whole "
            "batch (exact, but every device then computes it in full). Every other "
            f"{key[0]} of the step that does the same is gathered too, without another warning",
            GatherWarning,
            stacklevel=2,
        )

    def refuse(self, eqn: JaxprEqn, why: str) -> PartitionError:
        return PartitionError(f"jaxsched cannot run {eqn.primitive.name} at {self.where(eqn)} per device: {why}")

    # -- running ----------------------------------------------------------------------------
    def run(self, plan: JaxprPlan, consts: Sequence[Any], args: Sequence[Any], nested: bool = False) -> list:
        """Evaluate ``plan`` on local values of its input kinds (where a body is traced);
        ``nested``: as the body of a loop, branch or checkpoint, whose reduce-scatters no
        strategy reschedules (`AxisContext.scatter`)."""
        self.depth += int(nested)
        try:
            return self._run(plan, consts, args)
        finally:
            self.depth -= int(nested)

    def _run(self, plan: JaxprPlan, consts: Sequence[Any], args: Sequence[Any]) -> list:
        jaxpr = plan.jaxpr
        env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        converted: dict = {}

        def read(x: jex_core.Var | jex_core.Literal, want: Kind, site: int = -1) -> Any:
            if isinstance(x, jex_core.Literal):
                return x.val if want.is_replicated else self.ctx.convert(x.val, REPLICATED, want, aval_of(x).shape)
            have = plan.kinds[x]
            if have == want or (want.partial and have.is_replicated and x in self.zeros):
                return env[x]
            # a parameter block is gathered where it is read, once per reading equation (as
            # FSDP does: XLA's scheduler places each gather, and a rematerialised layer's
            # gather, behind the checkpoint's barrier, is not merged into forward's)
            key = (x, want, site if have.is_block and not want.is_block else -1)
            if key not in converted:
                converted[key] = self.ctx.convert(env[x], have, want, aval_of(x).shape, self.depth > 0)
            return converted[key]

        for site, (eqn, eqn_plan) in enumerate(zip(jaxpr.eqns, plan.eqns, strict=True)):
            # what a rule emits (a double-buffered scan, a staged scatter), and the collectives
            # that bring its inputs to the layout it reads, name the user's line in errors,
            # not the rule's
            with source_info_util.user_context(eqn.source_info.traceback):
                values = [read(x, k, site) for x, k in zip(eqn.invars, eqn_plan.inputs, strict=True)]
                results = eqn_plan.emit(values)
            env.update(zip(eqn.outvars, results, strict=True))
        return [read(x, k) for x, k in zip(jaxpr.outvars, plan.out_kinds, strict=True)]
