"""Optax wrappers for training on approximated parameters with delayed gradients.

Data-parallel training waits for each step's gradient reduction before the next forward.
`approximate` removes that wait: the gradient of step ``t`` is applied to the
*true* parameters ``staleness`` steps later, and meanwhile gradients are computed at
*approximated* parameters. With ``k = staleness``, ``U`` the inner transformation and
``g_t`` the gradient computed at ``θ̃_t``, the true parameters follow

    θ_{s+1} = θ_s + U(g_s)            (g_s is applied at the end of step s + k)

and during step ``t`` only ``θ_{t-k}`` is known (``g_{t-k}, ..., g_{t-1}`` are pending), so
the gradient of step ``t`` is computed at

* ``"stale"``: ``θ̃_t = θ_{t-k}``, a k-step delayed gradient;
* ``"local"``: ``θ̃_t = θ_{t-k}`` plus ``U`` applied, in order, to the pending gradients as
  this worker knows them (its own, unreduced ones in data-parallel training), starting
  from the true optimizer state;
* ``"extrapolate"``: ``θ̃_t = θ_{t-k} + k (θ_{t-k} - θ_{t-k-1})``, linear extrapolation.

The first ``k`` steps have fewer than ``k`` gradients pending and change nothing (the
true parameters wait for the first gradient to arrive). ``staleness=0`` is the inner
transformation exactly. This is Jin's approximated-parameter all-reduce scheduling
(HKU thesis, 2023) and DaSGD's delayed averaging, written as an optax wrapper in the
style of `optax.lookahead`; ``jaxsched.schedule(step, strategy="approx")`` runs the
same recurrences on the user's own step (`jaxsched.strategies._approx`).

`staleness_aware` scales a transformation's step by a rule of the staleness ``τ``
of the gradient it applies, by default ``1/τ`` (Zhang, Gupta, Lian and Liu,
"Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016,
arXiv:1511.05950): ``α_τ = α / τ`` for ``τ ≥ 1``, and ``α`` for a fresh gradient.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxsched.strategies._approximation import ApproxParams, approximate
    >>> tx = approximate(optax.sgd(0.1), method="stale", staleness=1)
    >>> params = ApproxParams.init_synced(jnp.array([1.0, -2.0]))
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p ** 2)
    >>> for _ in range(3):
    ...     grads = jax.grad(loss)(params.approx)   # always at the approximated point
    ...     updates, state = tx.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params.true    # g_0 and g_1 applied, both computed at θ_0 (θ̃_1 = θ_0); g_2 pending
    Array([ 0.6, -1.2], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxsched._errors import JaxschedTypeError, JaxschedValueError

METHODS = ("stale", "local", "extrapolate")

#: ``(params, inner_state, gradients) -> (new params, new inner_state)``: one step of ``U``.
LocalStep = Callable[[Any, Any, Any], tuple[Any, Any]]


class ApproxParams(NamedTuple):
    """The two parameter sets of `approximate` (pass them as ``params`` to ``update``).

    Attributes:
      true: ``θ``: the parameters of the recurrence, with every arrived gradient applied.
        Evaluate and checkpoint these.
      approx: ``θ̃``: where the next gradient must be computed.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched import strategies
      >>> params = strategies.ApproxParams.init_synced(jnp.ones(2))
      >>> bool((params.true == params.approx).all())  # equal until a gradient is pending
      True
    """

    true: optax.Params
    approx: optax.Params

    @classmethod
    def init_synced(cls, params: optax.Params) -> "ApproxParams":
        """Both sets equal to ``params`` (the start of training).

        Args:
          params: the initial parameters.

        Returns:
          ``ApproxParams(true=params, approx=params)``.

        Example:
            >>> ApproxParams.init_synced({"w": 1.0})
            ApproxParams(true={'w': 1.0}, approx={'w': 1.0})
        """
        return cls(true=params, approx=params)


class ApproximateState(NamedTuple):
    """State of `approximate`.

    Attributes:
      inner_state: the inner transformation's state, at the true parameters.
      pending: ``staleness`` gradients not yet applied to the true parameters, oldest
        first, each a tree like the parameters; a slot holds zeros until a gradient
        reaches it (see ``num_pending``).
      num_pending: int32 scalar, how many of the last slots of ``pending`` hold a gradient
        (below ``staleness`` only during the first steps).
      previous_true: ``θ_{t-k-1}``, the true parameters before the last applied gradient
        (``"extrapolate"`` only; ``()`` for the other methods).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxsched import strategies
      >>> tx = strategies.approximate(optax.sgd(0.1), staleness=2)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> len(state.pending), int(state.num_pending)  # two slots, both empty
      (2, 0)
    """

    inner_state: optax.OptState
    pending: tuple
    num_pending: jax.Array
    previous_true: Any


def check_transformation(tx: Any, where: str) -> None:
    """Refuse anything that is not an optax transformation, with a hint.

    Args:
      tx: what the caller passed as the transformation.
      where: the caller, for the message (``"approximate()"``).

    Raises:
      JaxschedTypeError: ``tx`` is not an ``optax.GradientTransformation``.

    Example:
        >>> import optax
        >>> check_transformation(optax.sgd(0.1), "approximate()")
        >>> try:
        ...     check_transformation(optax.sgd, "approximate()")
        ... except TypeError as error:
        ...     print(str(error).split(" (")[-1])
        sgd is a function: did you pass optax.sgd instead of optax.sgd(learning_rate)?)
    """
    if isinstance(tx, optax.GradientTransformation):
        return
    hint = ""
    if callable(tx):
        hint = (
            f" ({getattr(tx, '__name__', type(tx).__name__)} is a function: did you pass "
            "optax.sgd instead of optax.sgd(learning_rate)?)"
        )
    raise JaxschedTypeError(
        f"{where} needs an optax.GradientTransformation such as optax.sgd(0.1), got {type(tx).__name__}{hint}"
    )


def check_method(method: Any) -> str:
    if method not in METHODS:
        raise JaxschedValueError(
            f"approximation method {method!r} is unknown; choose one of {', '.join(map(repr, METHODS))}"
        )
    return method


def check_staleness(staleness: Any) -> int:
    if isinstance(staleness, bool) or not isinstance(staleness, int):
        raise JaxschedTypeError(
            f"staleness must be an int (the number of steps a gradient may lag), "
            f"got {type(staleness).__name__} {staleness!r}"
        )
    if staleness < 0:
        raise JaxschedValueError(f"staleness={staleness} is negative; use 0 (synchronous) or more steps of delay")
    return staleness


def select(condition: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``condition`` holds, else ``old``, leaf by leaf (exact: no arithmetic).

    In ``new``'s dtype: an update that changes a leaf's dtype (adam's ``mu_dtype``) changes
    it from the first step, applied or not, as the plain step does.

    Args:
      condition: a boolean scalar.
      new: a tree.
      old: a tree of ``new``'s structure.

    Returns:
      The selected tree.

    Example:
        >>> import jax.numpy as jnp
        >>> select(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
        Array([0., 0.], dtype=float32)
    """
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o).astype(jnp.result_type(n)), new, old)


def slot_holds_gradient(slot: int, staleness: int, num_pending: jax.Array) -> jax.Array:
    """Whether slot ``slot`` of a ``staleness``-slot queue (oldest first) holds a gradient.

    Args:
      slot: the slot's index, ``0`` the oldest.
      staleness: the queue's length.
      num_pending: how many of the last slots hold a gradient.

    Returns:
      A boolean (an array when ``num_pending`` is one).

    Example:
        >>> import jax.numpy as jnp
        >>> [bool(slot_holds_gradient(s, 3, jnp.array(1))) for s in range(3)]
        [False, False, True]
    """
    return slot >= staleness - num_pending


def approximated_point(
    method: str,
    staleness: int,
    true_params: Any,
    inner_state: Any,
    previous_true: Any,
    pending: Sequence[Any],
    num_pending: jax.Array,
    local_step: LocalStep,
    gate: Gate | None = None,
) -> Any:
    """``θ̃``: where the next gradient is computed, given the true parameters ``θ_{t-k}``.

    Shared by `approximate` and the ``approx`` strategy, which pass their own
    ``local_step`` (the inner transformation; the user's replayed update region).

    Args:
      method: ``"stale"``, ``"local"`` or ``"extrapolate"``.
      staleness: ``k``.
      true_params: ``θ_{t-k}``.
      inner_state: the inner transformation's state at the true parameters.
      previous_true: ``θ_{t-k-1}`` (``"extrapolate"`` only).
      pending: the ``k`` pending gradients, oldest first.
      num_pending: how many of the last slots of ``pending`` hold a gradient.
      local_step: ``(params, state, grads) -> (params, state)``, one step of ``U``.
      gate: how a slot that holds no gradient yet is skipped: `gated` (the default),
        `fenced` where the step reduces on a GPU, or `selected` where it reduces nothing.

    Returns:
      ``θ̃``, a tree like ``true_params``.

    Example:
        >>> import jax.numpy as jnp
        >>> step = lambda p, s, g: (p - g, s)
        >>> theta = approximated_point("local", 2, jnp.array(1.0), (), (), [jnp.array(0.5), jnp.array(0.25)],
        ...                            jnp.array(2), step)
        >>> float(theta)
        0.25
    """
    if staleness == 0 or method == "stale":
        return true_params
    if method == "extrapolate":
        return jax.tree.map(
            lambda p, q: (p + staleness * (p - q)).astype(jnp.result_type(p)), true_params, previous_true
        )
    gate = gated if gate is None else gate
    params, state = true_params, inner_state
    for slot, grads in enumerate(pending):
        holds = slot_holds_gradient(slot, staleness, num_pending)
        params, state = gate(holds, lambda p, s, g=grads: local_step(p, s, g), lambda p, s: (p, s), params, state)
    return params


def gated(condition: jax.Array, compute: Callable, otherwise: Callable, *operands: Any) -> Any:
    """``compute(*operands)`` where ``condition`` holds, else ``otherwise(*operands)``.

    A ``lax.cond``: the first steps of a delayed recurrence skip work, and the conditional
    is a fusion boundary. Where the step also reduces gradients that matters: XLA would
    otherwise fuse ``θ̃``'s computation with the update's (both read the parameters), and
    forward and backward would wait for the reduction the update waits for (seen in the
    schedules XLA compiles for GPU and TPU). On a GPU a conditional costs a round trip of
    its predicate to the host on every step: there `fenced` is the gate, and `selected`
    where nothing is reduced. Results keep the dtypes of ``otherwise``'s.

    Args:
      condition: a boolean scalar.
      compute: the work done when ``condition`` holds.
      otherwise: the result when it does not (of ``compute``'s structure).
      *operands: the arguments of both.

    Returns:
      One of the two results.

    Example:
        >>> import jax.numpy as jnp
        >>> float(gated(jnp.array(True), lambda x: x * 2, lambda x: x, jnp.array(3.0)))
        6.0
    """

    def matched(*args):
        like = jax.eval_shape(otherwise, *args)
        return jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), compute(*args), like)

    return lax.cond(condition, matched, otherwise, *operands)


def selected(condition: jax.Array, compute: Callable, otherwise: Callable, *operands: Any) -> Any:
    """`gated` without a conditional: both computed, one chosen leaf by leaf.

    The choice fuses into ``compute``'s own elementwise pass, and no predicate goes to the
    host, which on a GPU is most of `approx`'s per-call cost on one device (measured on the
    benchmarks page). For steps that reduce nothing (one device); see `gated`.

    Example:
        >>> import jax.numpy as jnp
        >>> float(selected(jnp.array(False), lambda x: x * 2, lambda x: x, jnp.array(3.0)))
        3.0
    """
    kept = otherwise(*operands)
    return jax.tree.map(
        lambda n, o: jnp.where(condition, jnp.asarray(n).astype(jnp.result_type(o)), o), compute(*operands), kept
    )


def fenced(condition: jax.Array, compute: Callable, otherwise: Callable, *operands: Any) -> Any:
    """`selected` on operands behind an optimization barrier: no conditional, and still a
    fusion boundary.

    XLA fuses computations that read the same buffer. ``θ̃``'s replayed update reads the
    true parameters, and so does the update at the end of the step, which waits for the
    reduction: fused together, forward and backward would wait for it as well. Behind the
    barrier, ``θ̃`` reads values XLA does not identify with the parameters. For steps that
    reduce on a GPU, where a conditional (`gated`) reads its predicate on the host on every
    step.

    Args:
      condition: a boolean scalar.
      compute: the work done when ``condition`` holds.
      otherwise: the result when it does not (of ``compute``'s structure).
      *operands: the arguments of both.

    Returns:
      One of the two results, in ``otherwise``'s dtypes.

    Example:
        >>> import jax.numpy as jnp
        >>> float(fenced(jnp.array(True), lambda x: x * 2, lambda x: x, jnp.array(3.0)))
        6.0
    """
    return selected(condition, compute, otherwise, *lax.optimization_barrier(operands))


#: ``(condition, compute, otherwise, *operands) -> result``: `gated`, `selected` or `fenced`.
Gate = Callable[..., Any]


def approximate(
    tx: optax.GradientTransformation, method: str = "local", staleness: int = 1
) -> optax.GradientTransformationExtraArgs:
    """Apply each gradient ``staleness`` steps late and compute gradients at ``θ̃``.

    Args:
      tx: the inner transformation ``U`` (any optax transformation). It receives the
        extra argument ``staleness=k`` (so `staleness_aware` inside it knows ``τ``).
      method: how the approximated parameters are formed: ``"stale"``, ``"local"`` or
        ``"extrapolate"`` (see the module docstring).
      staleness: ``k``, how many steps a gradient lags; ``0`` is ``tx`` exactly.

    Returns:
      A transformation whose ``params`` are `ApproxParams` and whose updates are
      `ApproxParams` of updates. Compute each gradient at ``params.approx``, pass
      it to ``update`` and apply the updates with ``optax.apply_updates`` without changing
      them. ``params.true`` is exactly ``U`` applied to the arrived gradients;
      ``params.approx`` is ``θ̃`` up to the rounding of ``apply_updates``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = approximate(optax.sgd(1.0), method="stale", staleness=1)
        >>> params = ApproxParams.init_synced(jnp.array([1.0]))
        >>> state = tx.init(params)
        >>> updates, state = tx.update(jnp.array([0.5]), state, params)  # g_0 pending
        >>> optax.apply_updates(params, updates).true
        Array([1.], dtype=float32)
        >>> params = optax.apply_updates(params, updates)
        >>> updates, state = tx.update(jnp.array([0.25]), state, params)  # g_0 arrives
        >>> optax.apply_updates(params, updates).true
        Array([0.5], dtype=float32)
    """
    check_transformation(tx, "approximate()")
    method, staleness = check_method(method), check_staleness(staleness)
    inner = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> ApproximateState:
        true = params.true if isinstance(params, ApproxParams) else params
        zeros = tuple(jax.tree.map(jnp.zeros_like, true) for _ in range(staleness))
        previous = true if method == "extrapolate" and staleness else ()
        return ApproximateState(inner.init(true), zeros, jnp.zeros((), jnp.int32), previous)

    def update_fn(
        updates: optax.Updates, state: ApproximateState, params: Any = None, **extra_args: Any
    ) -> tuple[ApproxParams, ApproximateState]:
        if not isinstance(params, ApproxParams):
            raise JaxschedTypeError(
                "approximate(...).update needs params=ApproxParams(true=..., approx=...) "
                f"(see ApproxParams.init_synced), got {type(params).__name__}"
            )
        extra_args.setdefault("staleness", staleness)
        if staleness == 0:
            step, inner_state = inner.update(updates, state.inner_state, params.true, **extra_args)
            return ApproxParams(step, step), state._replace(inner_state=inner_state)

        queue = tuple(state.pending) + (updates,)
        arrived = state.num_pending >= staleness
        step, inner_state = inner.update(queue[0], state.inner_state, params.true, **extra_args)
        step = jax.tree.map(lambda u: jnp.where(arrived, u, jnp.zeros_like(u)), step)
        inner_state = select(arrived, inner_state, state.inner_state)
        true = optax.apply_updates(params.true, step)
        previous = select(arrived, params.true, state.previous_true) if method == "extrapolate" else ()
        num_pending = jnp.minimum(state.num_pending + 1, staleness).astype(jnp.int32)

        def local_step(p, s, g):
            u, s = inner.update(g, s, p, **extra_args)
            return optax.apply_updates(p, u), s

        # the user's step reduced its gradients before this update: no fusion boundary to
        # keep, and a select spares a GPU the conditional's host round trip every step
        approx = approximated_point(
            method, staleness, true, inner_state, previous, queue[1:], num_pending, local_step, selected
        )
        approx_step = jax.tree.map(lambda new, old: new - old, approx, params.approx)
        return (ApproxParams(step, approx_step), ApproximateState(inner_state, queue[1:], num_pending, previous))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- staleness rule
def _inverse(tau: jax.Array) -> jax.Array:
    return 1.0 / jnp.maximum(tau, 1)


def _inverse_sqrt(tau: jax.Array) -> jax.Array:
    return jax.lax.rsqrt(jnp.maximum(tau, 1).astype(jnp.float32))


def _constant(tau: jax.Array) -> jax.Array:
    return jnp.ones((), jnp.float32)


#: Named rules ``τ -> step scale``. ``inverse`` is Zhang et al. (2016); ``inverse_sqrt`` a
#: milder variant; ``constant`` switches the rule off (for ablations).
STALENESS_RULES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "inverse": _inverse,
    "inverse_sqrt": _inverse_sqrt,
    "constant": _constant,
}


class StalenessAwareState(NamedTuple):
    """State of `staleness_aware`.

    Attributes:
      inner_state: the wrapped transformation's state.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxsched import strategies
      >>> strategies.staleness_aware(optax.sgd(0.1), staleness=2).init(jnp.ones(2))
      StalenessAwareState(inner_state=(EmptyState(), EmptyState()))
    """

    inner_state: optax.OptState


def staleness_aware(
    tx: optax.GradientTransformation,
    rule: str | Callable[[jax.Array], jax.Array] = "inverse",
    staleness: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scale ``tx``'s updates by ``rule(τ)``, ``τ`` the staleness of the gradient applied.

    Args:
      tx: any optax transformation.
      rule: ``"inverse"`` (``1/τ``, Zhang et al., IJCAI 2016; ``1`` for ``τ = 0``),
        ``"inverse_sqrt"``, ``"constant"`` (no scaling), or a function ``τ -> scale``.
      staleness: ``τ`` when ``update`` is not given one. `approximate` passes its
        own ``staleness`` as the extra argument; inside a step that
        ``jaxsched.schedule(..., strategy="approx", staleness=k)`` runs, set it to ``k``.

    Returns:
      A transformation whose updates are ``tx``'s scaled by ``rule(τ)``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = staleness_aware(optax.sgd(1.0), staleness=4)
        >>> updates, _ = tx.update(jnp.array([2.0]), tx.init(jnp.zeros(1)))
        >>> updates
        Array([-0.5], dtype=float32)
    """
    check_transformation(tx, "staleness_aware()")
    if isinstance(rule, str):
        if rule not in STALENESS_RULES:
            raise JaxschedValueError(
                f"staleness rule {rule!r} is unknown; choose one of "
                f"{', '.join(map(repr, STALENESS_RULES))} or pass a function tau -> scale"
            )
        rule_fn = STALENESS_RULES[rule]
    elif callable(rule):
        rule_fn = rule
    else:
        raise JaxschedTypeError(f"rule must be a name or a function tau -> scale, got {type(rule).__name__}")
    default = None if staleness is None else check_staleness(staleness)
    inner = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> StalenessAwareState:
        return StalenessAwareState(inner.init(params))

    def update_fn(
        updates: optax.Updates, state: StalenessAwareState, params: Any = None, **extra_args: Any
    ) -> tuple[optax.Updates, StalenessAwareState]:
        tau = extra_args.get("staleness")
        tau = default if tau is None else tau
        if tau is None:
            raise JaxschedValueError(
                "staleness_aware() does not know the staleness of this gradient: "
                "construct it with staleness=k, pass update(..., staleness=k), or "
                "wrap it in approximate(...), which passes its own"
            )
        scale = rule_fn(jnp.asarray(tau))
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        updates = jax.tree.map(lambda u: (u * scale).astype(jnp.result_type(u)), updates)
        return updates, StalenessAwareState(inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = [
    "ApproxParams",
    "ApproximateState",
    "METHODS",
    "STALENESS_RULES",
    "StalenessAwareState",
    "approximate",
    "approximated_point",
    "staleness_aware",
]
