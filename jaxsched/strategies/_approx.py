"""``approx``: the next step never waits for communication (approximated parameters).

Jin's All-Reduce scheduler (HKU thesis, 2023) and DaSGD: the gradient of step ``t`` is
applied ``k = staleness`` steps later, and meanwhile forward and backward run at
approximated parameters ``θ̃`` (`jaxsched.strategies._approximation` states the recurrences; this
strategy runs them on the user's own step, with the user's own optimizer as ``U``).

One program per step. With ``k >= 1``, step ``t``'s program

1. issues, at its very start, the reduction of the oldest pending local gradients
   ``g_{t-k}`` (per bucket, through the strategy's collective, so compression wraps it):
   its operands are program inputs, ready before any compute;
2. forms ``θ̃_t`` from the true parameters ``θ_{t-k}`` (``stale``, ``local`` or
   ``extrapolate``; ``local`` replays the user's update region on this device's own
   pending gradients);
3. runs the user's forward and backward (the backward region of the analysis) at ``θ̃_t``
   on this step's batch: its gradients join the pending queue, unreduced;
4. applies ``ḡ_{t-k}`` at its end: the update region, on the true parameters and
   optimizer state.

Nothing in 2-3 reads the collective's result, so an XLA latency-hiding scheduler (GPU,
TPU) or a staged engine can overlap it with the whole forward and backward. The first
``k`` steps have fewer than ``k`` gradients pending: their update is computed on zeros
and discarded by a select on ``num_pending`` (one program serves every step; the true
parameters and optimizer state stay exactly as they were). `Approx.finalize`
drains the queue: it reduces and applies every pending gradient, in order, and returns
the true parameters of the recurrence. ``staleness=0`` is a synchronous step: one
all-reduce per bucket in backward, as ``wfbp`` (equal to ``allreduce`` up to float
reassociation).

The step's ``aux`` is what the user's step reports for this batch at ``θ̃_t`` (its loss
and metrics), except values derived from the reduced gradients, which belong to step
``t-k``; in the first ``k`` steps, before any has arrived, they are computed on zeros (a
gradient norm reads 0). A step whose new parameters or optimizer state read anything of forward or
backward other than the reduced gradients (a loss-dependent learning rate, a gradient
clipped before ``pmean``, a batch statistic) cannot be delayed and is refused, naming the
equation; so is ``local`` when the update itself communicates.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="approx",
    ...                           approx_method="local", staleness=1)
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> for _ in range(3):
    ...     state, aux = sched(state, batch)
    >>> int(state.num_pending), len(state.pending)     # g_2 still pending
    (1, 1)
    >>> true_params, opt_state = sched.finalize(state)  # reduces and applies it
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.core._capture import UnsupportedStepError
from jaxsched.runtime.collectives._base import BucketSpec, Collective, stack_local, unstack_local
from jaxsched.runtime.engine._base import PerDeviceProgram, platform_family
from jaxsched.sim._costmodel import APPROX_PATTERN
from jaxsched.strategies._approximation import (
    approximated_point,
    check_method,
    check_staleness,
    fenced,
    gated,
    select,
    selected,
)
from jaxsched.plan._planned_step import PlannedStep, is_abstract, zero_count
from jaxsched.core._primitives import COLLECTIVES
from jaxsched.core._replay import interpret, is_var, nested_eqns, read, source_line
from jaxsched.core.rewrite._pending_sums import interpret_batching_sums
from jaxsched.core.rewrite._backward import walk_backward
from jaxsched.strategies._base import (
    RewrittenBody,
    ScheduledState,
    Strategy,
    placed_user_layout,
    reduce_gradients,
    scatter_block,
)
from jaxsched.strategies._registry import register_strategy

__all__ = ["Approx", "ApproxState", "nested_eqns_of", "UpdateSplit"]


class ApproxState(NamedTuple):
    """The state of the ``approx`` strategy.

    Attributes:
      params: the true parameters ``θ`` (every arrived gradient applied), user layout.
      opt_state: the user's optimizer state at ``θ``, user layout.
      collective_state: the collective's carried state per bucket, stacked on a leading
        device axis (see [`SchedState`][jaxsched._schedule.SchedState]).
      pending: ``staleness`` slots, oldest first; slot ``i`` holds this device's
        *unreduced* gradients of one step: each large gradient as its own array, the
        small ones packed into one flat array per dtype (`PendingLayout`), each stacked on
        a leading device axis (``P(axis)``). ``()`` for ``staleness=0`` and before the
        step is traced.
      num_pending: int32 scalar: how many of the last slots hold gradients (the first
        ``staleness`` steps fill the queue).
      previous_params: ``θ`` before the last applied gradient (``extrapolate``), else ``()``.

    Example:
        >>> Approx(staleness=2).initial_state({"w": 1.0}, ()).pending
        ()
    """

    params: Any
    opt_state: Any
    collective_state: Any = ()
    pending: tuple = ()
    num_pending: Any = 0
    previous_params: Any = ()


#: Gradients of at most this many elements travel packed in a pending slot (`PendingLayout`).
SMALL_GRADIENT_ELEMENTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PendingLayout:
    """The arrays of one pending slot: each large gradient its own, the small ones packed.

    Every array of the state is an argument and an output of every call, and costs host
    time to pass, return and free (about 1 to 3 us each on a 2-core CPU machine), and a
    model has many small gradients (biases, norm scales). Packed, the small ones cost one
    array per dtype, for a copy of at most ``SMALL_GRADIENT_ELEMENTS`` elements each; a
    large gradient keeps its own array, since packing it would copy it on every step. The
    layout follows the step's analysis order and shapes alone, never the bucket plan or
    the platform, so that any program of the step reads the state another wrote.

    Attributes:
      arrays: one device's arrays of a slot: the large gradients in analysis order, then
        one flat array per dtype of small ones.
      places: per gradient (analysis order): ``(array, offset, shape)``; ``offset`` is
        None where the gradient is the whole array.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layout = PendingLayout.of([jax.ShapeDtypeStruct((512, 512), jnp.float32),
        ...                            jax.ShapeDtypeStruct((512,), jnp.float32),
        ...                            jax.ShapeDtypeStruct((4, 3), jnp.float32)])
        >>> [a.shape for a in layout.arrays]  # the weight alone; the two small ones packed
        [(512, 512), (524,)]
        >>> grads = [jnp.ones((512, 512)), jnp.zeros(512), jnp.ones((4, 3))]
        >>> [g.shape for g in layout.unpack(layout.pack(grads))]
        [(512, 512), (512,), (4, 3)]
    """

    arrays: tuple[jax.ShapeDtypeStruct, ...]
    places: tuple[tuple[int, int | None, tuple[int, ...]], ...]

    @classmethod
    def of(cls, template: Sequence[jax.ShapeDtypeStruct], small: int = SMALL_GRADIENT_ELEMENTS) -> "PendingLayout":
        own = [t for t in template if math.prod(t.shape) > small]
        dtypes = list(dict.fromkeys(np.dtype(t.dtype) for t in template if math.prod(t.shape) <= small))
        sizes = [0] * len(dtypes)
        places: list[tuple[int, int | None, tuple[int, ...]]] = []
        n_own = 0
        for t in template:
            shape = tuple(t.shape)
            if math.prod(shape) > small:
                places.append((n_own, None, shape))
                n_own += 1
            else:
                k = dtypes.index(np.dtype(t.dtype))
                places.append((len(own) + k, sizes[k], shape))
                sizes[k] += math.prod(shape)
        packed = [jax.ShapeDtypeStruct((n,), d) for n, d in zip(sizes, dtypes)]
        arrays = [jax.ShapeDtypeStruct(tuple(t.shape), t.dtype) for t in own] + packed
        return cls(tuple(arrays), tuple(places))

    def pack(self, grads: Sequence[Any]) -> list:
        """The slot's arrays from the per-gradient arrays (analysis order)."""
        out: list[Any] = [None] * len(self.arrays)
        parts: dict[int, list] = {}
        for (array, offset, _), g in zip(self.places, grads, strict=True):
            if offset is None:
                out[array] = g
            else:
                parts.setdefault(array, []).append(jnp.reshape(g, (-1,)))
        for array, p in parts.items():
            out[array] = p[0] if len(p) == 1 else jnp.concatenate(p)
        return out

    def unpack(self, arrays: Sequence[Any]) -> list:
        """The per-gradient arrays (analysis order) from the slot's arrays."""
        return [
            arrays[array] if offset is None else jnp.reshape(arrays[array][offset : offset + math.prod(shape)], shape)
            for array, offset, shape in self.places
        ]


@dataclasses.dataclass(frozen=True)
class UpdateSplit:
    """The update region split for delaying it.

    Attributes:
      state_eqns: update equations the new params / opt_state need; they read only
        params, opt_state, consts and the reduced gradients.
      aux_eqns: the other update equations (metrics); they may read forward/backward.

    Example:
      >>> import jaxsched
      >>> from jaxsched.strategies import Approx
      >>> from jaxsched.demo import steps
      >>> approx, planned = steps.planned_example(Approx(staleness=1))
      >>> split = approx.update_split(planned)
      >>> len(split.state_eqns) > 0, set(split.state_eqns).isdisjoint(split.aux_eqns)
      (True, True)
    """

    state_eqns: tuple[int, ...]
    aux_eqns: tuple[int, ...]


@register_strategy
class Approx(Strategy):
    """Reduce step ``t-k``'s gradients at the start of step ``t``; compute at ``θ̃_t``.

    The options also pass through ``jaxsched.schedule(..., approx_method=..., staleness=...)``.

    Args:
      collective: how each bucket travels (default: a plain sum).
      approx_method: ``"stale"``, ``"local"`` or ``"extrapolate"`` (`jaxsched.strategies._approximation`).
      staleness: ``k >= 0``; ``0`` is a synchronous step.

    Example:
        >>> Approx(approx_method="stale", staleness=2)
        Approx(approx_method='stale', staleness=2, collective=Collective)
    """

    name = "approx"
    cost = APPROX_PATTERN
    # ``local`` replays the update on this device's unreduced gradients: a pmean of
    # gradients JAX already reduced in backward (check_vma) must then be the identity it
    # means, not a global sum of different local gradients
    folds_invariant_sums = True
    # the update of the arrived gradients and the approximated parameters both read the
    # true parameters: donated, XLA copied every state input at the program's start (no
    # memory saved; 25 copies a step on a 4-layer MLP, with or without an optimization
    # barrier ordering the update after θ̃)
    donates_state = False

    def __init__(self, collective: Collective | None = None, approx_method: str = "local", staleness: int = 1):
        super().__init__(collective)
        self.method = check_method(approx_method)
        self.staleness = check_staleness(staleness)

    def __repr__(self) -> str:
        return (
            f"Approx(approx_method={self.method!r}, staleness={self.staleness}, "
            f"collective={type(self.collective).__name__})"
        )

    # -- buckets --------------------------------------------------------------------------
    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        return self.concatenated_gradient_buckets(planned)

    def _reduce_bucket(
        self, planned: PlannedStep, k: int, grads: Sequence[Any], carried: list, scattered: bool = False
    ) -> list:
        """The sum of one bucket's gradients through the collective, per gradient (a sharded
        parameter's: into its block; ``scattered``: from its block, over the replica axes)."""
        spec = self.collective_buckets_memo(planned)[k]
        bucket = planned.buckets[k]
        out, carried[k] = reduce_gradients(
            self.collective, planned, bucket, grads, spec, carried[k], scattered=scattered
        )
        return out

    def collective_buckets_memo(self, planned: PlannedStep) -> list[BucketSpec]:
        return planned.memo("approx.buckets", lambda: self.collective_buckets(planned))

    def _reduce_all(self, planned: PlannedStep, local: Sequence[Any], carried: list) -> list:
        """Every pending gradient reduced, bucket by bucket (analysis order out)."""
        reduced: list[Any] = [None] * len(local)
        for k, bucket in enumerate(planned.buckets):
            if not bucket.reductions:
                continue
            sums = self._reduce_bucket(planned, k, [local[j] for j in bucket.reductions], carried, scattered=True)
            for j, s in zip(bucket.reductions, sums):
                reduced[j] = s
        return reduced

    # -- what the update may read -----------------------------------------------------------
    def update_split(self, planned: PlannedStep) -> UpdateSplit:
        return planned.memo("approx.split", lambda: self._update_split(planned))

    def _update_split(self, planned: PlannedStep) -> UpdateSplit:
        cap, analysis = planned.captured, planned.analysis
        body = cap.body
        n_state = cap.num_params + cap.num_opt
        state_outvars = [body.outvars[k] for k in cap.outputs[:n_state]]
        needed = {v for v in state_outvars if is_var(v)}
        state_eqns = []
        for i in reversed(analysis.update):
            eqn = body.eqns[i]
            if any(o in needed for o in eqn.outvars):
                state_eqns.append(i)
                needed.update(x for x in eqn.invars if is_var(x))
        state_eqns.reverse()
        aux_eqns = tuple(i for i in analysis.update if i not in set(state_eqns))

        # Forward values that are functions of params/opt_state/consts alone (pmap's squeeze
        # of each parameter block, a cast of the params) ran at the approximated point in
        # backward: the delayed update recomputes those it reads from the true params.
        pure = {v for v, src in zip(body.invars, cap.sources) if src.role != "batch"}
        recomputable = {}
        for i in analysis.backward:
            eqn = body.eqns[i]
            if eqn.primitive.name not in COLLECTIVES and all(not is_var(x) or x in pure for x in eqn.invars):
                pure.update(eqn.outvars)
                recomputable.update({o: i for o in eqn.outvars})
        wanted = {x for i in state_eqns for x in body.eqns[i].invars if is_var(x) and x in recomputable}
        recompute = set()
        while wanted:
            i = recomputable[wanted.pop()]
            if i not in recompute:
                recompute.add(i)
                wanted.update(x for x in body.eqns[i].invars if is_var(x) and x in recomputable)
        state_eqns = sorted(recompute) + state_eqns if recompute else state_eqns
        state_eqns = sorted(state_eqns)

        # What the delayed update may read: params, opt_state, consts, reduced gradients,
        # and its own results. Anything else is this step's forward/backward or batch.
        producer = {o: i for i, e in enumerate(body.eqns) for o in e.outvars}
        allowed = {r.result for r in analysis.reductions}
        allowed.update(v for v, src in zip(body.invars, cap.sources) if src.role != "batch")
        offenders = []  # (equation, the first value it may not read), in program order
        for i in state_eqns:
            eqn = body.eqns[i]
            unread = next((x for x in eqn.invars if is_var(x) and x not in allowed), None)
            if unread is None:
                allowed.update(eqn.outvars)
            else:
                offenders.append((eqn, unread))
        if offenders:
            raise UnsupportedStepError(self._refusal(planned, offenders, producer))
        for position, v in enumerate(state_outvars):
            if is_var(v) and v not in allowed:
                role = "params" if position < cap.num_params else "opt_state"
                raise UnsupportedStepError(
                    f"approx cannot delay this step's update: output {role} leaf {position} is "
                    f"{self._describe(planned, v, producer)}, not a function of params, opt_state "
                    "and the reduced gradients; use a synchronous strategy (wfbp, dear)"
                )
        if self.method == "local":
            for i in state_eqns:
                eqn = body.eqns[i]
                inner = [eqn] + list(nested_eqns_of(eqn))
                hit = next((e for e in inner if e.primitive.name in COLLECTIVES), None)
                if hit is not None:
                    raise UnsupportedStepError(
                        f"approx_method='local' replays the update on this device's own gradients "
                        f"before forward, but the update communicates ({hit.primitive.name} at "
                        f"{source_line(hit)}), which would put a collective in front of forward; "
                        "use approx_method='stale' or 'extrapolate'"
                    )
        return UpdateSplit(tuple(state_eqns), aux_eqns)

    def _refusal(self, planned: PlannedStep, offenders: list, producer: dict) -> str:
        """Why the update cannot be delayed, naming the equation to change. A loop among the
        offenders is named first: a scanned layer stack's backward computes gradients inside
        its loop, which the update then waits for, and whatever else reads this step's values
        (the head's backward feeding that loop) follows from it."""
        loop = next(
            ((inner, x) for e, x in offenders for inner in [e, *nested_eqns_of(e)] if inner.primitive.name in _LOOPS),
            None,
        )
        eqn, unread = loop or offenders[0]
        where = f"{eqn.primitive.name} at {source_line(eqn) or 'an unnamed line'}"
        read = self._describe(planned, unread, producer)
        if loop is not None:
            return (
                f"approx cannot delay this step's update: the loop {where} feeds the new "
                f"params/opt_state and reads {read}. Gradients that come out of a loop over this "
                "step's values (a scanned layer stack's backward, which reduces each layer's "
                "gradient in its own iteration) make the update wait for this step's backward, "
                "while approx applies step t-k's reduced gradients at the end of step t. Unroll "
                "the stack (a Python loop over the layers), or use a synchronous strategy (wfbp, "
                "dear, or approx with staleness=0)"
            )
        return (
            f"approx cannot delay this step's update: {where} feeds the new params/opt_state "
            f"and reads {read}. approx applies step t-k's reduced gradients at the end of step "
            "t, so the update may read only params, opt_state and the reduced gradients; "
            "compute that value from them, fold it into the gradients before lax.pmean, or use "
            "a synchronous strategy (wfbp, dear, or approx with staleness=0)"
        )

    @staticmethod
    def _describe(planned: PlannedStep, x: Any, producer: dict) -> str:
        body, cap = planned.captured.body, planned.captured
        if x in producer:
            eqn = body.eqns[producer[x]]
            return f"the result of {eqn.primitive.name} at {source_line(eqn)} (forward/backward)"
        for v, src in zip(body.invars, cap.sources):
            if v is x:
                return f"batch leaf {src.index}"
        return repr(x)

    def _run_update(
        self,
        planned: PlannedStep,
        params: Sequence,
        opts: Sequence,
        reduced: Sequence,
        consts: Sequence,
        env: dict | None = None,
    ) -> tuple[list, list, dict]:
        """The state part of the update region on (params, opt_state, reduced gradients)."""
        cap, analysis = planned.captured, planned.analysis
        body = cap.body
        values = planned.body_arguments(params, opts, [None] * cap.num_batch, consts)
        env = {} if env is None else env
        env.update(zip(body.invars, values, strict=True))
        env.update((r.result, g) for r, g in zip(analysis.reductions, reduced, strict=True))
        state_eqns = [body.eqns[i] for i in self.update_split(planned).state_eqns]
        interpret_batching_sums(state_eqns, lambda x: read(env, x), env.__setitem__)
        outs = [read(env, body.outvars[k]) for k in cap.outputs[: cap.num_params + cap.num_opt]]
        return outs[: cap.num_params], outs[cap.num_params :], env

    # -- state ------------------------------------------------------------------------------
    def initial_state(self, params: Any, opt_state: Any) -> ApproxState:
        return ApproxState(params, opt_state, (), (), zero_count(params, opt_state), ())

    def pending_template(self, planned: PlannedStep) -> list[jax.ShapeDtypeStruct]:
        """One device's pending gradient per reduction (analysis order).

        A sharded parameter's is its block, reduce-scattered in its own step; only its sum
        over the replica axes waits.

        Args:
          planned: the captured and planned step.

        Returns:
          One ``jax.ShapeDtypeStruct`` per gradient reduction.

        Example:
          >>> import jaxsched
          >>> from jaxsched.strategies import Approx
          >>> from jaxsched.demo import steps
          >>> approx, planned = steps.planned_example(Approx(staleness=1))
          >>> [t.shape for t in approx.pending_template(planned)]  # one per gradient reduction
          [(2,), (3, 2), (3,), (4, 3)]
        """
        return [
            jax.ShapeDtypeStruct(tuple((r.result if r.scattered else r.operand).aval.shape), r.operand.aval.dtype)
            for r in planned.analysis.reductions
        ]

    def pending_layout(self, planned: PlannedStep) -> PendingLayout:
        """How a pending slot packs `pending_template`'s gradients (`PendingLayout`).

        Example:
          >>> import jaxsched
          >>> from jaxsched.strategies import Approx
          >>> from jaxsched.demo import steps
          >>> approx, planned = steps.planned_example(Approx(staleness=1))
          >>> [a.shape for a in approx.pending_layout(planned).arrays]  # all small: 2 + 6 + 3 + 12
          [(23,)]
        """
        return planned.memo("approx.pending_layout", lambda: PendingLayout.of(self.pending_template(planned)))

    def convert(self, planned: PlannedStep, state: ScheduledState) -> ApproxState:
        cap = planned.captured
        abstract = is_abstract(state)
        params, opts = map(jax.tree.leaves, placed_user_layout(planned, state))
        pending = tuple(getattr(state, "pending", ()) or ())
        num_pending = getattr(state, "num_pending", 0)
        slot_arrays: list[tuple[tuple[int, ...], np.dtype]] = []
        if self.staleness:
            slot_arrays = [
                ((planned.axis_size,) + a.shape, np.dtype(a.dtype)) for a in self.pending_layout(planned).arrays
            ]
        if pending:
            if (
                not self.staleness
                or len(pending) != self.staleness
                or any([(tuple(np.shape(a)), np.dtype(a.dtype)) for a in slot] != slot_arrays for slot in pending)
            ):
                got = _arrays_summary([(np.shape(a), np.dtype(a.dtype)) for a in pending[0]])
                want = _arrays_summary(slot_arrays)
                raise JaxschedValueError(
                    f"the state's pending gradients do not fit this step with "
                    f"staleness={self.staleness}: it holds {len(pending)} slots of {got}, where this "
                    f"step's layout is {self.staleness} slots of {want} (each large gradient its "
                    "own array, the small ones packed per dtype; a state of jaxsched 0.1.0 before "
                    "2026-11-28 held one array per gradient). Resume with the strategy options and "
                    "step the state was saved with, or finalize it with the version that saved it"
                )
            pending = tuple(tuple(planned.placed(a, P(planned.axis_name)) for a in slot) for slot in pending)
        elif self.staleness:
            if not abstract and int(np.asarray(num_pending)) != 0:
                raise JaxschedValueError("the state says gradients are pending but holds none")
            pending = tuple(
                tuple(planned.zeros(shape, dtype, P(planned.axis_name), abstract) for shape, dtype in slot_arrays)
                for _ in range(self.staleness)
            )
        previous: Any = ()
        if self.method == "extrapolate" and self.staleness:
            previous = jax.tree.leaves(getattr(state, "previous_params", ()))
            if len(previous) != cap.num_params:
                previous = params  # nothing applied yet: θ_{-1} = θ_0
            previous = [planned.placed(v, planned.input_spec("params", i)) for i, v in enumerate(previous)]
            previous = jax.tree.unflatten(cap.params_tree, previous)
        num_pending = (
            planned.zeros((), jnp.int32, P(), abstract=True)
            if abstract
            else planned.placed(jnp.asarray(num_pending, jnp.int32), P())
        )
        return ApproxState(
            jax.tree.unflatten(cap.params_tree, params),
            jax.tree.unflatten(cap.opt_tree, opts),
            self.collective_state(planned, getattr(state, "collective_state", None), abstract),
            pending,
            num_pending,
            previous,
        )

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        """The true parameters and optimizer state: every pending gradient reduced and applied.

        Args:
          planned: the captured and planned step.
          state: an `ApproxState`.

        Returns:
          ``(params, opt_state)`` in the user's layout.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.strategies import Approx
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Approx(staleness=1), None, engine.make_engine("xla"))
          >>> approx, planned = chosen.strategy, chosen.planned
          >>> state = approx.convert(planned, jaxsched.SchedState(params, tx.init(params)))
          >>> final, _ = approx.finalize(planned, state)  # nothing pending yet: the params as they are
          >>> jax.tree.structure(final) == jax.tree.structure(params)
          True
        """
        count = int(np.asarray(getattr(state, "num_pending", 0)))
        if not count or not self.staleness:
            return state.params, state.opt_state
        state = self.convert(planned, state)
        drain = planned.memo(("approx.drain", count), lambda: self._drain_program(planned, count))
        cap = planned.captured
        outs = drain(
            *jax.tree.leaves(state.params),
            *jax.tree.leaves(state.opt_state),
            *jax.tree.leaves(state.collective_state),
            *[a for slot in state.pending[self.staleness - count :] for a in slot],
            *[planned.placed(c, s) for c, s in zip(cap.consts, planned.const_specs, strict=True)],
        )
        return (
            jax.tree.unflatten(cap.params_tree, outs[: cap.num_params]),
            jax.tree.unflatten(cap.opt_tree, outs[cap.num_params :]),
        )

    def _drain_program(self, planned: PlannedStep, count: int) -> Callable[..., tuple]:
        """Reduce and apply the ``count`` pending gradients; compiled by the step's engine
        (`Engine.compile`) with XLA's default options, as DiLoCo's finalize is."""
        cap = planned.captured
        n_p, n_o = cap.num_params, cap.num_opt
        coll_specs = self.collective_state_specs(planned)
        layout = self.pending_layout(planned)
        n_c, n_g = len(coll_specs), len(layout.arrays)
        self.update_split(planned)  # refuse before tracing

        def drain(*inputs):
            params, opts = list(inputs[:n_p]), list(inputs[n_p : n_p + n_o])
            carried = list(self.local_collective_state(planned, inputs[n_p + n_o : n_p + n_o + n_c]))
            flat = inputs[n_p + n_o + n_c : n_p + n_o + n_c + count * n_g]
            consts = inputs[n_p + n_o + n_c + count * n_g :]
            for slot in range(count):
                local = layout.unpack(unstack_local(flat[slot * n_g : (slot + 1) * n_g]))
                reduced = self._reduce_all(planned, local, carried)
                params, opts, _ = self._run_update(planned, params, opts, reduced, consts)
            return tuple(params) + tuple(opts)

        in_specs = (
            tuple(planned.input_spec("params", i) for i in range(n_p))
            + tuple(planned.input_spec("opt_state", j) for j in range(n_o))
            + coll_specs
            + (P(planned.axis_name),) * (count * n_g)
            + planned.const_specs
        )
        out_specs = tuple(planned.output_spec(k) for k in range(n_p + n_o))
        program = PerDeviceProgram(
            drain,
            planned.mesh,
            planned.axis_name,
            in_specs,
            out_specs,
            compiler_defaults=True,
            manual_axes=cap.manual_axes,  # model axes stay XLA's, as in the step's own program
        )
        return planned.compiling_engine.compile(program)

    # -- rewrite ----------------------------------------------------------------------------
    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        cap = planned.captured
        n_p, n_o = cap.num_params, cap.num_opt
        k = self.staleness
        coll_specs = self.collective_state_specs(planned)
        layout = self.pending_layout(planned)
        n_c, n_g = len(coll_specs), len(layout.arrays)
        n_prev = n_p if (self.method == "extrapolate" and k) else 0
        param_specs = tuple(planned.input_spec("params", i) for i in range(n_p))
        opt_specs = tuple(planned.input_spec("opt_state", j) for j in range(n_o))
        pending_specs = (P(planned.axis_name),) * (k * n_g)
        specs = param_specs + opt_specs + coll_specs + pending_specs + (P(),) + param_specs[:n_prev]
        n_state = len(specs)
        if k:
            self.update_split(planned)  # refuse before tracing

        def body(*inputs):
            state, batch, consts = self.split_inputs(planned, inputs, n_state)
            params, opts = state[:n_p], state[n_p : n_p + n_o]
            carried = list(self.local_collective_state(planned, state[n_p + n_o : n_p + n_o + n_c]))
            rest = state[n_p + n_o + n_c :]
            if k == 0:
                new_params, new_opts, aux = self._synchronous(planned, params, opts, batch, consts, carried)
                return new_params + new_opts + self.stacked_collective_leaves(tuple(carried)) + [rest[0]] + aux
            packed = [list(rest[i * n_g : (i + 1) * n_g]) for i in range(k)]
            slots = [layout.unpack(unstack_local(slot)) for slot in packed]
            num_pending, previous = rest[k * n_g], list(rest[k * n_g + 1 :])
            outs = self._delayed(planned, params, opts, slots, num_pending, previous, batch, consts, carried)
            new_params, new_opts, new_local, aux = outs
            arrived = num_pending >= k
            new_slots = [a for slot in packed[1:] for a in slot] + stack_local(layout.pack(new_local))
            new_count = jnp.minimum(num_pending + 1, k).astype(jnp.int32)
            new_previous = select(arrived, params, previous) if n_prev else []
            return (
                list(new_params)
                + list(new_opts)
                + self.stacked_collective_leaves(tuple(carried))
                + new_slots
                + [new_count]
                + list(new_previous)
                + aux
            )

        return RewrittenBody(body, specs, specs, [], False)

    @staticmethod
    def _warm_up_gate(planned: PlannedStep):
        """How θ̃ skips the slots that hold no gradient yet (the first ``staleness`` steps).

        Where gradients are reduced, θ̃'s replayed update must not fuse with the update at the
        end of the step, which reads the same parameters and waits for the reduction: forward
        and backward would wait too. A ``lax.cond`` (`gated`) is such a boundary, but on a
        GPU it reads its predicate on the host on every step, and XLA:GPU's estimate prices
        neither that nor its branches; there a select behind an optimization barrier
        (`fenced`) keeps the reduction async without a conditional. XLA:TPU kept a reduction
        async only behind the conditional. With nothing to reduce (one device) a plain select
        (`selected`) fuses into the update's own pass."""
        if planned.axis_size == 1:
            return selected
        if platform_family(planned.mesh.devices.flat[0].platform) == "gpu":
            return fenced
        return gated

    def _synchronous(self, planned, params, opts, batch, consts, carried):
        """``staleness=0``: one all-reduce per bucket in backward, then the update (as wfbp)."""
        cap, analysis = planned.captured, planned.analysis
        body, reds = cap.body, analysis.reductions
        env = dict(zip(body.invars, planned.body_arguments(params, opts, batch, consts), strict=True))

        def emit(bucket) -> None:
            k = planned.buckets.index(bucket)
            sums = self._reduce_bucket(planned, k, [read(env, reds[j].operand) for j in bucket.reductions], carried)
            for j, s in zip(bucket.reductions, sums):
                env[reds[j].result] = s

        walk_backward(analysis, env, {}, planned.buckets, emit)
        interpret_batching_sums([body.eqns[i] for i in analysis.update], lambda x: read(env, x), env.__setitem__)
        outs = [read(env, body.outvars[i]) for i in cap.outputs]
        n_p, n_o = cap.num_params, cap.num_opt
        return outs[:n_p], outs[n_p : n_p + n_o], outs[n_p + n_o :]

    def _delayed(self, planned, params, opts, slots, num_pending, previous, batch, consts, carried):
        cap, analysis = planned.captured, planned.analysis
        body, reds = cap.body, analysis.reductions
        size = planned.axis_size

        # 1. the oldest pending gradients' reduction, first in the program
        reduced = self._reduce_all(planned, slots[0], carried)

        # 2. θ̃: the local estimate of a psum is this device's gradient times the axis size (of
        # a sharded parameter's block: the block times the size of the axes it is summed over)
        factors = [size if not r.scattered else math.prod(planned.mesh.shape[a] for a in r.sum_axes) for r in reds]

        def local_step(p, s, grads):
            p, s, _ = self._run_update(planned, p, s, [g * f for g, f in zip(grads, factors)], consts)
            return p, s

        gate = self._warm_up_gate(planned)
        approx = approximated_point(
            self.method, self.staleness, list(params), list(opts), list(previous), slots, num_pending, local_step, gate
        )

        # 3. forward and backward at θ̃ on this step's batch; nothing reads `reduced`
        env = dict(zip(body.invars, planned.body_arguments(approx, opts, batch, consts), strict=True))
        interpret((body.eqns[i] for i in analysis.backward), lambda x: read(env, x), env.__setitem__)
        new_local = [
            jnp.broadcast_to(read(env, r.operand), r.operand.aval.shape).astype(r.operand.aval.dtype) for r in reds
        ]
        new_local = [scatter_block(g, r, planned.mesh) if r.scattered else g for g, r in zip(new_local, reds)]

        # 4. the update on the true parameters with ḡ_{t-k}; metrics from this step's forward.
        # Until k gradients have arrived it runs on zeros and is discarded. A select, not a
        # cond: leaf by leaf, so a staged engine applies each gradient as soon as its sum
        # arrives instead of after the last one.
        arrived = num_pending >= self.staleness
        new_params, new_opts, update_env = self._run_update(planned, params, opts, reduced, consts)
        new_params, new_opts = select(arrived, new_params, params), select(arrived, new_opts, opts)
        for v in body.invars:
            update_env.pop(v, None)
        env.update(update_env)
        interpret((body.eqns[i] for i in self.update_split(planned).aux_eqns), lambda x: read(env, x), env.__setitem__)
        aux = [read(env, body.outvars[i]) for i in cap.outputs[cap.num_params + cap.num_opt :]]
        return new_params, new_opts, new_local, aux


#: Loop primitives: a scanned layer stack's backward is one.
_LOOPS = frozenset({"scan", "while"})


def _arrays_summary(arrays: Sequence[tuple[Sequence[int], np.dtype]], shown: int = 4) -> str:
    """``n arrays: float32[8, 1023], ...`` for a message (the first ``shown`` named)."""
    names = [f"{np.dtype(d)}{list(shape)}" for shape, d in arrays]
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return f"{len(names)} arrays ({', '.join(names[:shown])}{more})"


def nested_eqns_of(eqn):
    """The equations nested in ``eqn``'s parameters (calls, loops), recursively.

    Args:
      eqn: a jaxpr equation.

    Returns:
      An iterator over the nested equations (none for a primitive without sub-jaxprs).

    Example:
        >>> import jax
        >>> jaxpr = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> [e.primitive.name for e in nested_eqns_of(jaxpr.eqns[0])]
        ['sin']
    """
    for sub in jex_core.jaxprs_in_params(eqn.params):
        yield from nested_eqns(sub)
