"""``kfac``: K-FAC preconditioning with factor all-reduces pipelined into backward and
inversions placed across workers by a load-balancing plan (SPD-KFAC).

The user's step is the ordinary one (``value_and_grad``, ``pmean`` of the gradients, an
optax update). This strategy replays its backward region and, per dense or convolution
layer found in the jaxpr (`jaxsched.core.rewrite._layers`), forms the Kronecker factors
from the layer input ``a`` and output cotangent ``g`` that backward already computes:

* ``A = [a, 1]^T [a, 1] / R`` (``R``: rows, i.e. examples times spatial positions or
  tokens; the ones column is the bias, present when the layer has one),
* ``G = B g^T g`` (``B``: this device's examples; ``g`` is the cotangent of the mean
  loss, so ``B g`` is the per-example gradient): the empirical Fisher, with KFC's
  convention for convolutions (Grosse & Martens, 2016).

Each factor bucket is all-reduced (a mean over the data axis) as soon as its layers'
cotangents exist, in backward order, while backward continues (``pipeline=False`` issues
them after backward, as kfac-jax does). Factors are exponential moving averages (the first
update takes the batch's factors as they are). Every ``inverse_interval`` steps the damped
factors are inverted, each on the worker the placement plan assigns
(`jaxsched.sim._kfac_placement`), and shared with one all-gather. The reduced kernel gradient
``V`` (with the bias gradient as an extra row) becomes
``(A + pi sqrt(lambda) I)^-1 V (G + sqrt(lambda)/pi I)^-1`` (factored Tikhonov damping,
``pi^2 = (tr A / d_A) / (tr G / d_G)``; Martens & Grosse, 2015), and the user's optax
update runs unchanged on it. Parameters outside recognised layers keep the plain
gradient; each is reported once with a `KFACFallbackWarning`.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="kfac",
    ...                           damping=1e-2, inverse_interval=5, factor_buckets="per_layer")
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> state, aux = sched(state, batch)
    >>> int(state.step), [tuple(a.shape) for a in state.factors[0]]
    (1, [(65, 65), (16, 16)])
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsched._errors import JaxschedValueError, JaxschedWarning
from jaxsched.core._axes import as_axes, spec_axes
from jaxsched.core._capture import UnsupportedStepError
from jaxsched.runtime.collectives._base import BucketSpec, Collective
from jaxsched.sim._costmodel import KFAC_PATTERN
from jaxsched.sim._kfac_placement import check_placement, plan_placement
from jaxsched.plan._planned_step import PlannedStep, is_abstract, zero_count
from jaxsched.core._replay import interpret, is_var, read
from jaxsched.core.rewrite._pending_sums import interpret_batching_sums
from jaxsched.core.rewrite._layers import LayerMatch, MatchedLayer, match_layers
from jaxsched.strategies._base import RewrittenBody, ScheduledState, Strategy, placed_user_layout
from jaxsched.strategies._registry import register_strategy

INVERSES = ("eigh", "cholesky")


class KFACFallbackWarning(JaxschedWarning):
    """A parameter is not part of a layer K-FAC recognises: it gets the plain gradient.

    Example:
        >>> import jaxsched
        >>> issubclass(KFACFallbackWarning, jaxsched.JaxschedWarning)
        True
    """


class KFACState(NamedTuple):
    """The state of the ``kfac`` strategy.

    Attributes:
      params: the user's params tree (user layout).
      opt_state: the user's optimizer state tree (user layout).
      collective_state: the gradient collective's carried state per bucket, stacked on a
        leading device axis (see [`SchedState`][jaxsched._schedule.SchedState]).
      factors: per recognised layer (forward order), ``(A, G)``: the moving averages of
        the Kronecker factors, replicated. ``()`` before the step is traced.
      inverses: per layer, ``(A_inv, G_inv)``: the damped inverses of the last refresh.
      step: int32, steps taken (inverses refresh when ``step % inverse_interval == 0``).
      factor_updates: int32, how many times the factors were updated (0: the next update
        takes the batch's factors without averaging).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsched.strategies import KFAC
      >>> state = KFAC().initial_state({"w": jnp.ones(2)}, ())
      >>> state.factors, int(state.step)  # factors appear when the step is traced
      ((), 0)
    """

    params: Any
    opt_state: Any
    collective_state: Any = ()
    factors: tuple = ()
    inverses: tuple = ()
    step: Any = 0
    factor_updates: Any = 0


def check_options(
    damping: float,
    factor_interval: int,
    inverse_interval: int,
    ema_decay: float,
    inverse: str,
    placement: str,
    factor_buckets: Any,
) -> None:
    """Refuse bad K-FAC options with a message that says what to pass instead.

    Args:
      damping: ``lambda > 0``.
      factor_interval: ``>= 1``.
      inverse_interval: ``>= 1``.
      ema_decay: in ``[0, 1)``.
      inverse: one of ``INVERSES``.
      placement: one of `jaxsched.sim._kfac_placement.PLACEMENTS`.
      factor_buckets: ``"auto"``, ``"per_layer"``, a byte threshold, or lists of layer names.

    Raises:
      JaxschedValueError: an option out of range, naming it.

    Example:
        >>> try:
        ...     check_options(0.0, 1, 10, 0.95, "eigh", "balanced", "auto")
        ... except ValueError as error:
        ...     print(str(error).split(":")[0])
        damping=0.0 must be a finite number > 0
    """
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping <= 0:
        raise JaxschedValueError(
            f"damping={damping!r} must be a finite number > 0: K-FAC adds it to the "
            "factors so that they can be inverted; try damping=1e-3"
        )
    for name, value in (("factor_interval", factor_interval), ("inverse_interval", inverse_interval)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            what = "factors are updated" if name == "factor_interval" else "inverses are refreshed"
            raise JaxschedValueError(
                f"{name}={value!r} must be an int >= 1 ({what} every {name} steps); use {name}=1 for every step"
            )
    if not isinstance(ema_decay, (int, float)) or not 0 <= ema_decay < 1:
        raise JaxschedValueError(f"ema_decay={ema_decay!r} must be in [0, 1) (0: no averaging)")
    if inverse not in INVERSES:
        raise JaxschedValueError(f"inverse={inverse!r} is unknown; choose one of {', '.join(INVERSES)}")
    check_placement(placement)
    ok = (
        factor_buckets in ("auto", "per_layer")
        or (isinstance(factor_buckets, int) and not isinstance(factor_buckets, bool) and factor_buckets > 0)
        or (isinstance(factor_buckets, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in factor_buckets))
    )
    if not ok:
        raise JaxschedValueError(
            f"factor_buckets={factor_buckets!r} is not understood; pass 'auto' (cost "
            "model), 'per_layer', a byte threshold, or lists of layer names"
        )


@register_strategy
class KFAC(Strategy):
    """K-FAC preconditioned gradients into the user's optax update (see the module doc).

    The options also pass through ``jaxsched.schedule(step, strategy="kfac", ...)``.

    Args:
      damping: ``lambda > 0``, Tikhonov damping of the Kronecker-factored curvature.
      factor_interval: update the factors every this many steps (``>= 1``).
      inverse_interval: refresh the inverses every this many steps (``>= 1``).
      ema_decay: moving-average decay of the factors, in ``[0, 1)``.
      placement: ``"balanced"`` (LPT on ``n**3``), ``"round_robin"`` (kfac-jax's) or
        ``"naive"`` (every worker inverts every factor).
      inverse: ``"eigh"`` or ``"cholesky"`` (the same damped inverse, two factorizations).
      pipeline: issue each factor bucket's all-reduce in backward as soon as it is ready
        (True) or all of them after backward (False, the baseline).
      factor_buckets: ``"auto"`` (MG-WFBP merging against the cost model: the step's
        static compute estimate and the ``network_profile`` plan option, or a network
        measured on the mesh), ``"per_layer"``, a byte threshold, or lists of layer names.
      collective: what the *gradient* buckets are sent through (as for ``wfbp``).

    Example:
        >>> kfac = KFAC(damping=1e-2, inverse_interval=5, placement="round_robin")
        >>> kfac.name, kfac.damping, kfac.inverse_interval
        ('kfac', 0.01, 5)
    """

    name = "kfac"
    cost = KFAC_PATTERN

    def __init__(
        self,
        collective: Collective | None = None,
        damping: float = 1e-3,
        factor_interval: int = 1,
        inverse_interval: int = 10,
        ema_decay: float = 0.95,
        placement: str = "balanced",
        inverse: str = "eigh",
        pipeline: bool = True,
        factor_buckets: Any = "auto",
    ):
        super().__init__(collective)
        check_options(damping, factor_interval, inverse_interval, ema_decay, inverse, placement, factor_buckets)
        self.damping, self.factor_interval = float(damping), int(factor_interval)
        self.inverse_interval, self.ema_decay = int(inverse_interval), float(ema_decay)
        self.placement, self.inverse, self.pipeline = placement, inverse, bool(pipeline)
        self.factor_buckets_option = factor_buckets
        self._reported: set[str] = set()
        # the simulator and planners see this instance's variant of the pattern
        self.cost = dataclasses.replace(KFAC_PATTERN, factors_in_backward=self.pipeline, inverse_placement=placement)

    def __repr__(self) -> str:
        return (
            f"KFAC(damping={self.damping}, factor_interval={self.factor_interval}, "
            f"inverse_interval={self.inverse_interval}, ema_decay={self.ema_decay}, "
            f"placement={self.placement!r}, inverse={self.inverse!r}, pipeline={self.pipeline})"
        )

    # -- what the step holds -----------------------------------------------------------------
    def layers(self, planned: PlannedStep) -> LayerMatch:
        """The recognised layers (forward order); refuses a step with none.

        Args:
          planned: the captured and planned step.

        Returns:
          The `LayerMatch` (memoised on ``planned``); `jaxsched.integrations.kfac.find_layers`
          gives the same for a step.

        Example:
          >>> from jaxsched.strategies import KFAC
          >>> from jaxsched.demo import steps
          >>> kfac, planned = steps.planned_example(KFAC())
          >>> [(layer.name, layer.dims) for layer in kfac.layers(planned).layers]
          [('hidden/0', (5, 3)), ('head', (4, 2))]
        """
        return planned.memo("kfac.layers", lambda: self._layers(planned))

    def _layers(self, planned: PlannedStep) -> LayerMatch:
        if planned.captured.kind == "pmap":
            raise UnsupportedStepError(
                "kfac schedules jax.shard_map steps; this is a jax.pmap step, whose parameters "
                "carry a device axis. Write the same body with jax.shard_map over a mesh "
                "(jaxsched.demo.steps.make_step shows how)"
            )
        sharded = {
            planned.paths[i]: axes
            for i in range(planned.captured.num_params)
            if (axes := planned.model_axes("params", i))
        }
        if sharded:
            path, axes = next(iter(sharded.items()))
            raise UnsupportedStepError(
                f"kfac preconditions whole layers, but params/{path} is sharded over the model "
                f"axes {axes} (and {len(sharded) - 1} more leaves): its Kronecker factors would "
                "need activations and cotangents from every device of those axes. Schedule "
                "tensor- or expert-parallel steps with wfbp, dear or approx"
            )
        data = set(as_axes(planned.axis_name))
        blocks = {
            planned.paths[i]: axes
            for i in range(planned.captured.num_params)
            if (axes := tuple(a for a in spec_axes(planned.input_spec("params", i)) if a in data))
        }
        if blocks:
            path, axes = next(iter(blocks.items()))
            raise UnsupportedStepError(
                f"kfac preconditions whole layers, but params/{path} is sharded over {axes}, a data "
                f"axis (FSDP; and {len(blocks) - 1} more leaves): its Kronecker factors and their "
                "inverses would be as large as the layer on every device. Schedule FSDP and HSDP "
                "steps with wfbp, dear or approx, or keep the parameters replicated for kfac"
            )
        found = match_layers(planned.analysis, planned.paths)
        if not found.layers:
            raise UnsupportedStepError(
                "kfac found no dense or convolution layer in the step (parameters "
                f"{', '.join(planned.paths[:6])}{', ...' if len(planned.paths) > 6 else ''}): K-FAC "
                "preconditions layers whose weight gradient is a dot_general or "
                "conv_general_dilated of the layer input and output cotangent; use a plain "
                "strategy (wfbp, dear) for this model"
            )
        for path in found.unmatched:
            if path not in self._reported:
                self._reported.add(path)
                warnings.warn(
                    f"kfac: params/{path} is not part of a dense or convolution layer "
                    "that K-FAC recognises; it gets the plain gradient",
                    KFACFallbackWarning,
                    stacklevel=2,
                )
        return found

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        return planned.memo("kfac.buckets", lambda: self.concatenated_gradient_buckets(planned))

    def factor_dtype(self, planned: PlannedStep, layer: MatchedLayer):
        dtype = planned.captured.body.invars[planned.captured.body_input("params", layer.kernel)].aval.dtype
        return jnp.promote_types(dtype, jnp.float32)

    def factor_templates(self, planned: PlannedStep) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
        out = []
        for layer in self.layers(planned).layers:
            dtype = self.factor_dtype(planned, layer)
            out.append(tuple(jax.ShapeDtypeStruct((n, n), dtype) for n in layer.dims))
        return out

    def factor_buckets(self, planned: PlannedStep) -> list[list[int]]:
        """Factor buckets as lists of layer indices, in the order they become ready.

        Args:
          planned: the captured and planned step.

        Returns:
          The buckets, as `plan_factor_buckets` makes them from the ``factor_buckets`` option.

        Example:
          >>> from jaxsched.strategies import KFAC
          >>> from jaxsched.demo import steps
          >>> kfac, planned = steps.planned_example(KFAC())
          >>> buckets = kfac.factor_buckets(planned)  # measured costs decide how many
          >>> [i for bucket in buckets for i in bucket]  # the head's factors are ready first
          [1, 0]
        """
        return planned.memo(
            "kfac.factor_buckets",
            lambda: plan_factor_buckets(planned, self.layers(planned).layers, self.factor_buckets_option),
        )

    def placement_plan(self, planned: PlannedStep) -> tuple[int, ...] | None:
        """Which worker inverts which factor.

        Args:
          planned: the captured and planned step.

        Returns:
          The worker of each factor ``[A_0, G_0, A_1, G_1, ...]``
          (`jaxsched.sim._kfac_placement.plan_placement`), or None: every worker inverts all.

        Example:
          >>> from jaxsched.strategies import KFAC
          >>> from jaxsched.demo import steps
          >>> kfac, planned = steps.planned_example(KFAC())
          >>> kfac.placement_plan(planned)  # the worker of A_0, G_0, A_1, G_1
          (0, 1, 1, 1)
        """
        dims = [n for layer in self.layers(planned).layers for n in layer.dims]
        if planned.axis_size == 1:
            return None
        layers = [i for i, _ in enumerate(self.layers(planned).layers) for _ in range(2)]
        return plan_placement(dims, planned.axis_size, self.placement, layers)

    # -- state -------------------------------------------------------------------------------
    def initial_state(self, params: Any, opt_state: Any) -> KFACState:
        return KFACState(params, opt_state, (), (), (), zero_count(params, opt_state), zero_count(params, opt_state))

    def convert(self, planned: PlannedStep, state: ScheduledState) -> KFACState:
        params, opts = placed_user_layout(planned, state)
        templates = self.factor_templates(planned)
        abstract = is_abstract(state)

        def filled(given: Any, what: str) -> tuple:
            given = tuple(given or ())
            if not given:
                return tuple(tuple(planned.zeros(t.shape, t.dtype, P(), abstract) for t in pair) for pair in templates)
            if [tuple(tuple(np.shape(a)) for a in pair) for pair in given] != [
                tuple(t.shape for t in pair) for pair in templates
            ]:
                raise JaxschedValueError(
                    f"the state's K-FAC {what} do not fit this step's layers "
                    f"({[l.name for l in self.layers(planned).layers]}); resume with "
                    "the step the state was saved with"
                )
            return tuple(tuple(planned.placed(a, P()) for a in pair) for pair in given)

        scalar = lambda v: (
            planned.zeros((), jnp.int32, P(), abstract=True)
            if abstract
            else planned.placed(jnp.asarray(v, jnp.int32), P())
        )
        return KFACState(
            params,
            opts,
            self.collective_state(planned, getattr(state, "collective_state", None), abstract),
            filled(getattr(state, "factors", ()), "factors"),
            filled(getattr(state, "inverses", ()), "inverses"),
            scalar(getattr(state, "step", 0)),
            scalar(getattr(state, "factor_updates", 0)),
        )

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        return state.params, state.opt_state

    def finalize_untraced(self, state: ScheduledState) -> tuple[Any, Any]:
        return state.params, state.opt_state  # factors are statistics, not pending work

    # -- rewrite -----------------------------------------------------------------------------
    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        cap = planned.captured
        n_p, n_o = cap.num_params, cap.num_opt
        coll_specs = self.collective_state_specs(planned)
        n_c = len(coll_specs)
        layers = self.layers(planned).layers
        n_l = len(layers)
        self.factor_buckets(planned)  # plan before tracing
        param_specs = tuple(planned.input_spec("params", i) for i in range(n_p))
        opt_specs = tuple(planned.input_spec("opt_state", j) for j in range(n_o))
        specs = param_specs + opt_specs + coll_specs + (P(),) * (4 * n_l + 2)
        n_state = len(specs)

        def body(*inputs):
            state, batch, consts = self.split_inputs(planned, inputs, n_state)
            params, opts = state[:n_p], state[n_p : n_p + n_o]
            carried = list(self.local_collective_state(planned, state[n_p + n_o : n_p + n_o + n_c]))
            rest = state[n_p + n_o + n_c :]
            factors = [(rest[2 * i], rest[2 * i + 1]) for i in range(n_l)]
            inverses = [(rest[2 * n_l + 2 * i], rest[2 * n_l + 2 * i + 1]) for i in range(n_l)]
            step, count = rest[4 * n_l], rest[4 * n_l + 1]
            outs, factors, inverses, count = self._step(
                planned, params, opts, batch, consts, carried, factors, inverses, step, count
            )
            results = [outs[k] for k in cap.outputs]
            return (
                results[: n_p + n_o]
                + self.stacked_collective_leaves(tuple(carried))
                + [a for pair in factors for a in pair]
                + [a for pair in inverses for a in pair]
                + [step + 1, count]
                + results[n_p + n_o :]
            )

        return RewrittenBody(body, specs, specs, [], False)

    def _step(self, planned, params, opts, batch, consts, carried, factors, inverses, step, count):
        cap, analysis = planned.captured, planned.analysis
        body, reds, axis = cap.body, analysis.reductions, planned.axis_name
        layers = self.layers(planned).layers
        env = dict(zip(body.invars, planned.body_arguments(params, opts, batch, consts), strict=True))
        specs = self.collective_buckets(planned)
        pending_grads = [b for b in planned.buckets if b.reductions]
        pending_factors = list(self.factor_buckets(planned))
        new_factors = list(factors)
        update = None if self.factor_interval == 1 else (step % self.factor_interval == 0)
        decay = jnp.where(count == 0, 0.0, self.ema_decay)

        def emit_gradients(bucket) -> None:
            k = planned.buckets.index(bucket)
            grads = [read(env, reds[j].operand) for j in bucket.reductions]
            if planned.axis_size == 1:
                sums = grads
            else:
                sums, carried[k] = self.collective.all_reduce_tensors(grads, axis, specs[k], carried[k])
            for j, s in zip(bucket.reductions, sums):
                env[reds[j].result] = s

        def emit_factors(group: Sequence[int]) -> None:
            inputs = [(env[layers[i].inputs], env[layers[i].cotangent]) for i in group]
            old = [factors[i] for i in group]

            def compute():
                local = [
                    local_factors(layers[i], a, g, self.factor_dtype(planned, layers[i]))
                    for i, (a, g) in zip(group, inputs)
                ]
                flat = [m for pair in local for m in pair]
                if planned.axis_size > 1:
                    buf = jnp.concatenate([jnp.ravel(m) for m in flat])
                    buf = lax.psum(buf, axis) / planned.axis_size
                    out, offset = [], 0
                    for m in flat:
                        out.append(buf[offset : offset + m.size].reshape(m.shape))
                        offset += m.size
                    flat = out
                ema = [decay * o + (1 - decay) * m for o, m in zip([m for pair in old for m in pair], flat)]
                return tuple(ema)

            if update is None:
                result = compute()
            else:
                result = lax.cond(update, compute, lambda: tuple(m for pair in old for m in pair))
            for k, i in enumerate(group):
                new_factors[i] = (result[2 * k], result[2 * k + 1])

        def ready(i: int) -> bool:
            return all(not is_var(v) or v in env for v in (layers[i].inputs, layers[i].cotangent))

        def after(_eqn=None) -> None:
            for b in list(pending_grads):
                if all(not is_var(reds[j].operand) or reds[j].operand in env for j in b.reductions):
                    pending_grads.remove(b)
                    emit_gradients(b)
            if self.pipeline:
                for group in list(pending_factors):
                    if all(ready(i) for i in group):
                        pending_factors.remove(group)
                        emit_factors(group)

        after()
        interpret((body.eqns[i] for i in analysis.backward), lambda x: read(env, x), env.__setitem__, after=after)
        for group in pending_factors:  # pipeline=False: every factor bucket after backward
            emit_factors(group)
        if pending_grads:
            raise AssertionError(f"gradient buckets never became ready: {pending_grads}")
        count = count + 1 if update is None else count + update.astype(count.dtype)

        refresh = step % self.inverse_interval == 0
        flat_inv = lax.cond(
            refresh,
            lambda: tuple(self._inverses(planned, new_factors)),
            lambda: tuple(m for pair in inverses for m in pair),
        )
        new_inverses = [(flat_inv[2 * i], flat_inv[2 * i + 1]) for i in range(len(layers))]

        for layer, (a_inv, g_inv) in zip(layers, new_inverses):
            kernel_red = reds[layer.kernel_reduction]
            bias_red = reds[layer.bias_reduction] if layer.bias_reduction is not None else None
            grad_w = env[kernel_red.result]
            grad_b = env[bias_red.result] if bias_red is not None else None
            new_w, new_b = precondition(layer, grad_w, grad_b, a_inv, g_inv)
            env[kernel_red.result] = new_w
            if bias_red is not None:
                env[bias_red.result] = new_b
        interpret_batching_sums([body.eqns[i] for i in analysis.update], lambda x: read(env, x), env.__setitem__)
        return [read(env, x) for x in body.outvars], new_factors, new_inverses, count

    def _inverses(self, planned: PlannedStep, factors: Sequence[tuple]) -> list:
        """Damped inverses of every factor ``[A_0, G_0, ...]``, each computed on the worker
        the placement assigns and shared by one all-gather of zero-padded buffers."""
        mats, damps = [], []
        for a, g in factors:
            da, dg = damped_terms(a, g, self.damping)
            mats += [a, g]
            damps += [da, dg]
        owners = self.placement_plan(planned)
        if owners is None:
            return [damped_inverse(m, d, self.inverse) for m, d in zip(mats, damps)]
        size = planned.axis_size
        mine = [[b for b, w in enumerate(owners) if w == worker] for worker in range(size)]
        length = max(1, max(sum(mats[b].size for b in blocks) for blocks in mine))
        dtype = mats[0].dtype

        def branch(blocks: list[int]):
            def run():
                parts = [jnp.ravel(damped_inverse(mats[b], damps[b], self.inverse)) for b in blocks]
                used = sum(p.size for p in parts)
                return jnp.concatenate(parts + [jnp.zeros((length - used,), dtype)])

            return run

        local = lax.switch(lax.axis_index(planned.axis_name), [branch(blocks) for blocks in mine])
        gathered = lax.all_gather(local, planned.axis_name)  # (P, length)
        out: list[Any] = [None] * len(mats)
        for worker, blocks in enumerate(mine):
            offset = 0
            for b in blocks:
                n = mats[b].shape[0]
                out[b] = gathered[worker, offset : offset + n * n].reshape(n, n)
                offset += n * n
        return out


# ------------------------------------------------------------------------------ the maths
def local_factors(layer: MatchedLayer, x: jax.Array, g: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """This device's Kronecker factors for one layer.

    Args:
      layer: the matched layer (dense or convolution).
      x: the layer's input on this device.
      g: the cotangent of the layer's output.
      dtype: the factors' dtype.

    Returns:
      ``(A, G)``: the input factor (with a ones column for a bias) and the output factor.

    Example:
      >>> import jax, optax
      >>> from jaxsched.strategies import KFAC
      >>> from jaxsched.demo import steps
      >>> kfac, planned = steps.planned_example(KFAC())
      >>> from jaxsched import strategies
      >>> layer = kfac.layers(planned).layers[0]  # hidden/0: 4 inputs and a bias, 3 outputs
      >>> a, g = strategies.local_factors(layer, jax.numpy.ones((2, 4)), jax.numpy.ones((2, 3)), "float32")
      >>> a.shape, g.shape
      ((5, 5), (3, 3))
    """
    p = layer.params
    if layer.kind == "conv":
        patches = lax.conv_general_dilated_patches(
            x,
            p["filter_shape"],
            p["window_strides"],
            p["padding"],
            p["lhs_dilation"],
            p["rhs_dilation"],
            p["dimension_numbers"],
        )
        a = jnp.moveaxis(patches, p["dimension_numbers"].out_spec[1], -1)
    else:
        a = x
    a = a.reshape(-1, a.shape[-1]).astype(dtype)
    if layer.bias is not None:
        a = jnp.concatenate([a, jnp.ones((a.shape[0], 1), dtype)], axis=1)
    g = jnp.moveaxis(g, p["out_axis"], -1)
    g = g.reshape(-1, g.shape[-1]).astype(dtype)
    hi = lax.Precision.HIGHEST
    big_a = jnp.matmul(a.T, a, precision=hi) / a.shape[0]
    big_g = jnp.matmul(g.T, g, precision=hi) * p["batch"]
    return big_a, big_g


def damped_terms(a: jax.Array, g: jax.Array, damping: float) -> tuple[jax.Array, jax.Array]:
    """Factored Tikhonov damping, split between the two factors by their mean eigenvalues.

    Args:
      a: the input factor.
      g: the output factor.
      damping: ``lambda``.

    Returns:
      ``(pi sqrt(lambda), sqrt(lambda) / pi)``, ``pi = sqrt(tr(A)/d_A / (tr(G)/d_G))``.

    Example:
        >>> import jax.numpy as jnp
        >>> da, dg = damped_terms(4 * jnp.eye(2), jnp.eye(3), 1e-2)
        >>> round(float(da), 3), round(float(dg), 3)
        (0.2, 0.05)
    """
    ta = jnp.trace(a) / a.shape[0]
    tg = jnp.trace(g) / g.shape[0]
    pi = jnp.where((ta > 0) & (tg > 0), jnp.sqrt(jnp.abs(ta) / jnp.where(tg > 0, tg, 1.0)), 1.0)
    root = math.sqrt(damping)
    return pi * root, root / pi


def damped_inverse(m: jax.Array, damping: jax.Array, method: str) -> jax.Array:
    """``(m + damping I)^-1`` of a symmetric positive semi-definite ``m``.

    Args:
      m: the factor.
      damping: the damping term added to its diagonal.
      method: ``"eigh"`` (negative eigenvalues clipped to 0 first) or ``"cholesky"``.

    Returns:
      The damped inverse.

    Example:
        >>> import jax.numpy as jnp
        >>> damped_inverse(jnp.diag(jnp.array([1.0, 3.0])), jnp.array(1.0), "cholesky").diagonal().round(4).tolist()
        [0.5, 0.25]
    """
    m = (m + m.T) / 2
    if method == "eigh":
        w, q = jnp.linalg.eigh(m)
        w = jnp.maximum(w, 0) + damping
        return jnp.matmul(q / w, q.T, precision=lax.Precision.HIGHEST)
    eye = jnp.eye(m.shape[0], dtype=m.dtype)
    chol = jnp.linalg.cholesky(m + damping * eye)
    inv_l = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
    return jnp.matmul(inv_l.T, inv_l, precision=lax.Precision.HIGHEST)


def kernel_matrix(layer: MatchedLayer, w: jax.Array) -> jax.Array:
    """The kernel (or its gradient) as the matrix K-FAC acts on.

    Args:
      layer: the matched layer.
      w: its kernel, or the kernel's gradient.

    Returns:
      The ``(d_A without bias, d_G)`` matrix (a convolution's spatial and input axes flattened).

    Example:
      >>> import jax, optax
      >>> from jaxsched.core import _capture as capture
      >>> from jaxsched.demo import steps
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime import engine
      >>> from jaxsched.strategies import KFAC
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> chosen = selection.select(captured, KFAC(), None, engine.make_engine("xla"))
      >>> kfac, planned = chosen.strategy, chosen.planned
      >>> from jaxsched.strategies import _kfac as kfac_module
      >>> layer = kfac.layers(planned).layers[0]
      >>> kfac_module.kernel_matrix(layer, params["hidden"][0]["kernel"]).shape
      (4, 3)
    """
    if layer.kind == "dense":
        return w if layer.params["in_axis"] == 0 else w.T
    o, i, *spatial = layer.params["dimension_numbers"].rhs_spec
    return jnp.transpose(w, (i, *spatial, o)).reshape(-1, w.shape[o])


def kernel_from_matrix(layer: MatchedLayer, m: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if layer.kind == "dense":
        return m if layer.params["in_axis"] == 0 else m.T
    o, i, *spatial = layer.params["dimension_numbers"].rhs_spec
    perm = (i, *spatial, o)
    blocked = m.reshape(tuple(shape[d] for d in perm))
    return jnp.transpose(blocked, tuple(int(d) for d in np.argsort(perm)))


def precondition(
    layer: MatchedLayer, grad_w: jax.Array, grad_b: jax.Array | None, a_inv: jax.Array, g_inv: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """One layer's preconditioned gradient, ``A_inv [grad_w; grad_b] G_inv``.

    Args:
      layer: the matched layer.
      grad_w: the kernel's gradient.
      grad_b: the bias's gradient, or None.
      a_inv: the damped inverse of the input factor.
      g_inv: the damped inverse of the output factor.

    Returns:
      ``(kernel, bias)`` of the preconditioned gradient, in their own shapes and dtypes.

    Example:
      >>> import jax, optax
      >>> from jaxsched.strategies import KFAC
      >>> from jaxsched.demo import steps
      >>> kfac, planned = steps.planned_example(KFAC())
      >>> import jax.numpy as jnp
      >>> from jaxsched import strategies
      >>> layer = kfac.layers(planned).layers[0]
      >>> kernel, bias = strategies.precondition(layer, jnp.ones((4, 3)), None, jnp.eye(4), 2 * jnp.eye(3))
      >>> kernel.shape, float(kernel[0, 0]), bias
      ((4, 3), 2.0, None)
    """
    dtype = a_inv.dtype
    v = kernel_matrix(layer, grad_w).astype(dtype)
    if grad_b is not None:
        v = jnp.concatenate([v, grad_b.reshape(1, -1).astype(dtype)], axis=0)
    hi = lax.Precision.HIGHEST
    u = jnp.matmul(jnp.matmul(a_inv, v, precision=hi), g_inv, precision=hi)
    new_b = None
    if grad_b is not None:
        new_b = u[-1].reshape(grad_b.shape).astype(grad_b.dtype)
        u = u[:-1]
    return kernel_from_matrix(layer, u, grad_w.shape).astype(grad_w.dtype), new_b


# ------------------------------------------------------------------------ factor buckets
def factor_bytes(layer: MatchedLayer, itemsize: int = 4) -> int:
    return sum(n * n for n in layer.dims) * itemsize


def plan_factor_buckets(planned: PlannedStep, layers: Sequence[MatchedLayer], option: Any) -> list[list[int]]:
    """Factor buckets from the ``factor_buckets`` option.

    Args:
      planned: the captured and planned step.
      layers: the matched layers.
      option: ``"auto"``, ``"per_layer"``, a byte threshold, or lists of layer names.

    Returns:
      Lists of layer indices, in the order their cotangents appear.

    Example:
      >>> from jaxsched.strategies import KFAC
      >>> from jaxsched.demo import steps
      >>> kfac, planned = steps.planned_example(KFAC())
      >>> from jaxsched import strategies
      >>> layers = kfac.layers(planned).layers
      >>> strategies.plan_factor_buckets(planned, layers, "per_layer")
      [[1], [0]]
      >>> strategies.plan_factor_buckets(planned, layers, 10**9)  # a byte threshold
      [[1, 0]]
    """
    order = sorted(range(len(layers)), key=lambda i: layers[i].grad_eqn)
    if planned.axis_size == 1:
        return [order]  # nothing is sent
    if option == "per_layer":
        return [[i] for i in order]
    if isinstance(option, int):
        groups: list[list[int]] = [[]]
        size = 0
        for i in order:
            if groups[-1] and size + factor_bytes(layers[i]) > option:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += factor_bytes(layers[i])
        return groups
    if isinstance(option, (list, tuple)):
        names = {layer.name: i for i, layer in enumerate(layers)}
        groups = []
        for k, group in enumerate(option):
            unknown = [n for n in group if n not in names]
            if unknown:
                raise JaxschedValueError(
                    f"factor_buckets[{k}] names {unknown}, not a K-FAC layer; the layers are {', '.join(names)}"
                )
            groups.append(sorted((names[n] for n in group), key=order.index))
        covered = sorted(i for g in groups for i in g)
        if covered != list(range(len(layers))):
            raise JaxschedValueError(f"factor_buckets must name every K-FAC layer once ({', '.join(names)})")
        return sorted(groups, key=lambda g: order.index(g[-1]))
    return auto_factor_buckets(planned, layers, order)


def auto_factor_buckets(planned: PlannedStep, layers: Sequence[MatchedLayer], order: list[int]) -> list[list[int]]:
    """MG-WFBP merging of factor all-reduces against the cost model (see `KFAC`).

    Args:
      planned: the captured and planned step (its network profile, or its mesh to measure).
      layers: the matched layers.
      order: layer indices in the order their cotangents appear.

    Returns:
      Lists of layer indices, in readiness order.

    Example:
      >>> from jaxsched.strategies import KFAC
      >>> from jaxsched.demo import steps
      >>> kfac, planned = steps.planned_example(KFAC())
      >>> from jaxsched.strategies import _kfac as kfac_module
      >>> groups = kfac_module.auto_factor_buckets(planned, kfac.layers(planned).layers, [1, 0])
      >>> [i for group in groups for i in group]  # merged or not as the measured network says
      [1, 0]
    """
    from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    from jaxsched.plan import plan_buckets
    from jaxsched.plan._from_step import measure_flops_per_s

    network = planned.plan_options.get("network_profile") or planned.network_profile
    if isinstance(network, str):
        network = network_preset(network, planned.axis_size)
    elif network is None:
        from jaxsched.plan._profiling import profile_network

        network, _ = profile_network(planned.mesh, planned.axis_name, repeats=3)  # type: ignore[arg-type]
    rate = planned.memo("flops_per_s", lambda: measure_flops_per_s(planned.mesh.devices.flat[0]))
    forward_order = list(reversed(order))  # the planners take layers in forward order
    profile = []
    for i in forward_order:
        layer = layers[i]
        rows = layer.params["rows"]
        flops = 2.0 * rows * layer.dims[0] * layer.dims[1]
        factor_flops = 2.0 * rows * sum(n * n for n in layer.dims)
        profile.append(
            Layer(
                layer.name,
                sum(n * n for n in layer.dims),
                factor_bytes(layer),
                flops / rate,
                (2 * flops + factor_flops) / rate,
            )
        )
    groups = plan_buckets(LayerProfile(profile), network, "mgwfbp", "wfbp")
    # forward-order groups of profile positions -> readiness-order groups of layer indices
    buckets = [[forward_order[k] for k in reversed(group)] for group in reversed(groups)]
    return buckets


__all__ = [
    "INVERSES",
    "KFAC",
    "KFACFallbackWarning",
    "KFACState",
    "check_options",
    "damped_inverse",
    "damped_terms",
    "local_factors",
    "plan_factor_buckets",
    "precondition",
]
