"""``diloco``: synchronize the slow data axes only every H steps (DiLoCo, Streaming DiLoCo).

When replicas are joined by a slow network (slices over DCN, GPU nodes over Ethernet),
even a perfectly overlapped all-reduce every step can cost more than the compute. DiLoCo
(Douillard et al., 2023) lets every replica take ``H = inner_steps`` steps of the user's
own step and optimizer on its own data, then averages the *outer gradient* (the
parameters at the last synchronization minus the replica's parameters) and applies it to
a global copy with an outer optimizer (Nesterov SGD, lr 0.7, in the paper). Streaming
DiLoCo (Douillard et al., 2025) splits the parameters into ``fragments`` synchronized on
a staggered schedule, lets a fragment's outer all-reduce run during ``overlap_steps``
(τ) inner steps, and sends the outer gradients in 4 bits
(`jaxsched.runtime.compress.Quantize`).

The user's step is unchanged: it reduces its gradients over every data axis. Under this
strategy each gradient reduction runs only over the data axes not in ``sync_axes`` (the
fast ones) and its result is scaled by the number of replicas along ``sync_axes``, so the
user's ``pmean`` becomes the mean over the replica's own devices. Every other collective
(a loss ``pmean`` for the metrics, synchronized batch statistics) runs where the user
wrote it.

The schedule, with ``s`` inner steps done: fragment ``p`` (parameter leaves in flatten
order, cut into ``fragments`` contiguous groups of about equal size) sends when
``s ≡ d_p (mod H)``, ``d_p = ((p + 1) H) // fragments``, ``s ≥ 1``; its reduced outer
gradient ``Δ̄`` arrives τ inner steps later, when the outer optimizer updates the global
copy (``g ← g + outer(Δ̄)``) and the replica's fragment becomes ``α·local + (1-α)·g``
(``α = mixing``). With τ ≥ 1 the send is the first thing of the next step's program, its
operands ready before any compute, so the collective can run during that step's forward
and backward. The programs of different steps differ only in which fragment is sent and
which arrives, so each such phase is compiled once, without a condition around a
collective (`DiLoCo.phase_key`); the step that picks it is counted on the host.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="diloco",
    ...                           inner_steps=2)
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> for _ in range(4):
    ...     state, aux = sched(state, batch)
    >>> int(state.step)
    4
    >>> params, opt_state = sched.finalize(state)   # the same on every replica
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.core._axes import AxisName, as_axes, spec_axes
from jaxsched.core._capture import CapturedStep, UnsupportedStepError
from jaxsched.runtime.collectives._base import BucketSpec, Collective, CollectiveState, stack_local, unstack_local
from jaxsched.runtime.engine._base import PerDeviceProgram
from jaxsched.sim._costmodel import DILOCO_PATTERN
from jaxsched.plan._planned_step import PlannedStep, is_abstract
from jaxsched.core._primitives import SUM_REDUCTIONS, reduction_axes
from jaxsched.core._replay import read
from jaxsched.core.rewrite._pending_sums import interpret_batching_sums
from jaxsched.core.rewrite._backward import walk_backward
from jaxsched.strategies._diloco_fragments import FragmentSchedule, PhaseKey, fragment_of_leaves, sync_schedule
from jaxsched.strategies._base import RewrittenBody, ScheduledState, Strategy, check_leaf_counts, scatter_block
from jaxsched.strategies._registry import register_strategy

__all__ = ["DiLoCo", "DiLoCoState", "fragment_of_leaves", "sync_schedule"]

#: Inner strategies DiLoCo can run (their gradients are reduced per bucket in backward and
#: the update runs on full tensors, on each replica).
INNER_STRATEGIES = ("wfbp", "allreduce")


class _PartCounts(NamedTuple):
    """How many flat leaves each part of the per-device state has, in state order."""

    params: int
    opt: int
    coll: int
    glob: int
    outer: int
    flight: int


class _StateParts(NamedTuple):
    """The per-device state's flat leaves cut into its parts (`DiLoCoState`'s fields)."""

    params: list[jax.Array]
    opt: list[jax.Array]
    coll: list[jax.Array]
    glob: list[jax.Array]
    outer: list[jax.Array]
    flight: list[jax.Array]
    step: jax.Array


class _Unpacked(NamedTuple):
    """The per-device state as a phase's body works on it.

    Attributes:
      local: this replica's parameters (unstacked).
      opts: this replica's inner optimizer state leaves (unstacked).
      carried: the outer collective's carried state, per bucket.
      glob: the globally synchronized parameters.
      outer: one outer optimizer state per fragment.
      flight: the reduced outer gradient of the fragment in flight (``τ >= 2``).
      step: the inner steps taken.
    """

    local: list[jax.Array]
    opts: list[jax.Array]
    carried: list[CollectiveState]
    glob: list[jax.Array]
    outer: list[optax.OptState]
    flight: list[jax.Array]
    step: jax.Array


class DiLoCoState(NamedTuple):
    """The state of the ``diloco`` strategy.

    Attributes:
      params: this replica's parameters (the user's tree); once converted every leaf is
        stacked on a leading device axis over the data axes (``P(data axes)``): replicas
        differ between synchronizations.
      opt_state: this replica's inner optimizer state (the user's tree), stacked likewise.
      collective_state: what the outer collective (a compressor's error feedback) carries,
        per outer bucket, stacked on a leading device axis.
      global_params: the globally synchronized parameters (user layout, replicated): each
        fragment's value after its last outer update.
      outer_state: one outer optimizer state per fragment (replicated); ``()`` before the
        first conversion.
      in_flight: with ``overlap_steps >= 2``, one array per parameter leaf holding the
        reduced (mean) outer gradient of the fragment in flight (replicated); ``()``
        otherwise (with τ = 1 the send and the arrival are in one program).
      step: int32 scalar, the number of inner steps taken.

    Example:
      >>> from jaxsched.strategies import DiLoCo
      >>> state = DiLoCo(inner_steps=4).initial_state({"w": 1.0}, ())
      >>> state.params, state.step  # the user's trees; the first step stacks them per device
      ({'w': 1.0}, 0)
    """

    params: Any
    opt_state: Any
    collective_state: Any = ()
    global_params: Any = ()
    outer_state: tuple = ()
    in_flight: tuple = ()
    step: Any = 0


def _cut_rows(shape: Sequence[int], n: int) -> bool:
    """Whether a leaf of ``shape`` is cut into ``n`` shards along its leading dimension (it
    splits evenly), rather than flattened and padded."""
    return len(shape) >= 1 and shape[0] % n == 0


def _outer_shard_shape(shape: Sequence[int], n: int) -> tuple[int, ...]:
    """The shape of one of the ``n`` shards of a leaf's outer gradient that a replica's
    devices send: ``1/n`` of its rows, or ``1/n`` of it flattened and padded.

    >>> _outer_shard_shape((4096, 1000), 8), _outer_shard_shape((3, 5), 2)
    ((512, 1000), (8,))
    """
    if _cut_rows(shape, n):
        return (shape[0] // n, *shape[1:])
    return (-(-math.prod(shape) // n),)


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise JaxschedTypeError(f"DiLoCo({name}={value!r}): {name} must be an int")
    if value < minimum:
        raise JaxschedValueError(f"DiLoCo({name}={value!r}): {name} must be >= {minimum}")
    return int(value)


@register_strategy
class DiLoCo(Strategy):
    """Inner steps on the fast axes, an outer optimizer step on ``sync_axes`` every H steps.

    Args:
      collective: how the outer gradients cross ``sync_axes`` (``compression=`` in
        `jaxsched._schedule`): e.g. ``jaxsched.runtime.compress.Quantize(bits=4)``,
        ``Cast(jnp.bfloat16)``, ``TopK``. Inner reductions are plain sums.
      inner_steps: H >= 1, the inner steps between two synchronizations of a fragment.
      outer: the outer optimizer (an optax transformation), applied to the mean outer
        gradient; the paper's ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` by default.
      fragments: 1 (DiLoCo) or more (Streaming DiLoCo: staggered fragments).
      overlap_steps: τ, the inner steps a fragment's outer all-reduce is in flight; needs
        ``τ < inner_steps / fragments`` (at most one fragment in flight).
      mixing: α in [0, 1), the weight of the replica's own parameters when its fragment's
        synchronized value arrives (0 takes the synchronized value).
      sync_axes: the data mesh axes synchronized only every H steps (a name or a tuple);
        by default the slow axis of a data axis over several mesh axes (the one whose
        devices change slice or process, else the first), else the whole data axis.
      inner_strategy: how the inner steps reduce their gradients: ``"wfbp"`` (per bucket
        in backward) or ``"allreduce"`` (the same sums). Strategies that shard the
        optimizer (``dear``) or delay the update (``approx``) are refused.

    Example:
        >>> DiLoCo(inner_steps=50, fragments=4, overlap_steps=1)
        DiLoCo(inner_steps=50, fragments=4, overlap_steps=1, mixing=0.0, sync_axes=None, collective=Collective)
    """

    name = "diloco"
    cost = DILOCO_PATTERN
    folds_invariant_sums = True

    def __init__(
        self,
        collective: Collective | None = None,
        inner_steps: int = 50,
        outer: optax.GradientTransformation | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        mixing: float = 0.0,
        sync_axes: Any = None,
        inner_strategy: Any = "wfbp",
    ):
        super().__init__(collective)
        self.inner_steps = _check_int(inner_steps, "inner_steps", 1)
        self.fragments = _check_int(fragments, "fragments", 1)
        self.overlap_steps = _check_int(overlap_steps, "overlap_steps", 0)
        if self.fragments > self.inner_steps:
            raise JaxschedValueError(
                f"DiLoCo(fragments={fragments}, inner_steps={inner_steps}): each "
                "fragment needs its own step in the H-step cycle; use fragments <= "
                "inner_steps"
            )
        if self.overlap_steps * self.fragments >= self.inner_steps:
            raise JaxschedValueError(
                f"DiLoCo(overlap_steps={overlap_steps}): τ must be < inner_steps / fragments = "
                f"{self.inner_steps}/{self.fragments}, so that a fragment's outer all-reduce "
                "arrives before the next fragment is sent; lower overlap_steps or raise inner_steps"
            )
        if (
            isinstance(mixing, bool)
            or not isinstance(mixing, (int, float, np.floating))
            or not 0.0 <= float(mixing) < 1.0
        ):
            raise JaxschedValueError(
                f"DiLoCo(mixing={mixing!r}): mixing (α, the weight of the local "
                "parameters when the synchronized ones arrive) must be in [0, 1)"
            )
        self.mixing = float(mixing)
        self._schedule = FragmentSchedule(self.inner_steps, self.fragments, self.overlap_steps)
        if outer is None:
            outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        if not (hasattr(outer, "init") and hasattr(outer, "update")):
            raise JaxschedTypeError(
                f"DiLoCo(outer={outer!r}): outer must be an optax "
                "GradientTransformation, e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)"
            )
        self.outer = outer
        self.sync_axes_option = None if sync_axes is None else as_axes(sync_axes)
        if self.sync_axes_option == ():
            raise JaxschedValueError(
                f"DiLoCo(sync_axes={sync_axes!r}) names no axis, so no replica would ever be "
                "averaged with another; pass the data axes to average over (e.g. sync_axes='data'), "
                "or leave sync_axes=None for the default (the slow one of several data axes, else every data axis)"
            )
        self.inner_strategy = self._check_inner(inner_strategy)

    @staticmethod
    def _check_inner(inner: Any) -> str:
        name = inner.name if isinstance(inner, Strategy) else inner
        if isinstance(inner, Strategy) and inner.cost.sharded_update or name == "dear":
            raise JaxschedValueError(
                f"DiLoCo(inner_strategy={name!r}): {name} shards the optimizer over the data "
                "axis, but DiLoCo keeps a whole replica of the parameters and optimizer state per "
                "replica group and synchronizes them itself; use inner_strategy='wfbp'"
            )
        if name not in INNER_STRATEGIES:
            raise JaxschedValueError(
                f"DiLoCo(inner_strategy={name!r}): the inner steps run as "
                f"{' or '.join(INNER_STRATEGIES)}; {name!r} cannot be combined with "
                "DiLoCo (it delays or reshapes the update)"
            )
        return name

    def __repr__(self) -> str:
        sync = None if self.sync_axes_option is None else self.sync_axes_option
        return (
            f"DiLoCo(inner_steps={self.inner_steps}, fragments={self.fragments}, "
            f"overlap_steps={self.overlap_steps}, mixing={self.mixing}, sync_axes={sync}, "
            f"collective={type(self.collective).__name__})"
        )

    def for_mesh(self, captured: CapturedStep) -> "DiLoCo":
        """The outer sum crosses ``sync_axes`` only: no hierarchical collective.

        Args:
          captured: the captured step.

        Returns:
          ``self``, unchanged.

        Example:
        >>> import jax, optax
        >>> import jaxsched
        >>> from jaxsched.core import _capture as capture
        >>> from jaxsched.demo import steps
        >>> from jaxsched.pipeline import _selection as selection
        >>> from jaxsched.runtime import engine
        >>> from jaxsched.strategies import DiLoCo
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> chosen = selection.select(captured, strategy, None, engine.make_engine("xla"))
        >>> diloco, planned = chosen.strategy, chosen.planned
        >>> diloco.for_mesh(captured) is diloco
        True
        """
        return self

    # -- axes -----------------------------------------------------------------------------
    def sync_axes(self, planned: PlannedStep) -> tuple[str, ...]:
        """The data axes synchronized every H steps, checked against the step's data axes.

        Args:
          planned: the captured and planned step.

        Returns:
          The axis names: ``sync_axes`` as given, else the slow one of several data axes,
          else every data axis.

        Raises:
          JaxschedValueError: ``sync_axes`` names an axis that is not a data axis of the step.

        Example:
        >>> import jaxsched
        >>> from jaxsched.strategies import DiLoCo
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> from jaxsched.demo import steps
        >>> diloco, planned = steps.planned_example(strategy)
        >>> diloco.sync_axes(planned)
        ('data',)
        """
        data = as_axes(planned.axis_name)
        if self.sync_axes_option is not None:
            bad = [a for a in self.sync_axes_option if a not in data]
            if bad:
                raise JaxschedValueError(
                    f"DiLoCo(sync_axes={self.sync_axes_option!r}): {bad} is not among "
                    f"the step's data axes {data} (the mesh axes its batch is sharded over); pass "
                    f"some of {data}, e.g. sync_axes={data[0]!r}"
                )
            return tuple(a for a in data if a in self.sync_axes_option)
        if len(data) < 2:
            return data
        from jaxsched.runtime.collectives._hierarchical import slow_axes

        slow = slow_axes(planned.mesh, data)
        if slow and len(slow) < len(data):
            return tuple(slow)
        return data[:1]

    def _axes(self, planned: PlannedStep) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """(sync axes, fast axes, replicas along the sync axes)."""

        def build():
            sync = self.sync_axes(planned)
            fast = tuple(a for a in as_axes(planned.axis_name) if a not in sync)
            return sync, fast, math.prod(planned.mesh.shape[a] for a in sync)

        return planned.memo("diloco.axes", build)

    @staticmethod
    def _axis(axes: tuple[str, ...]) -> AxisName:
        return axes[0] if len(axes) == 1 else axes

    # -- parameter blocks (FSDP inside a replica) ---------------------------------------------
    def _block_axes(self, planned: PlannedStep, role: str, i: int) -> tuple[str, ...]:
        """The data axes leaf ``i`` of ``role`` is split over (FSDP inside a replica; empty
        for a replicated leaf)."""
        data = set(as_axes(planned.axis_name))
        return tuple(a for a in spec_axes(planned.input_spec(role, i)) if a in data)

    def _is_block(self, planned: PlannedStep, i: int) -> bool:
        return bool(self._block_axes(planned, "params", i))

    def _global_spec(self, planned: PlannedStep, role: str, i: int) -> P:
        """Where the synchronized copy of a leaf lives: as the user placed it."""
        return planned.input_spec(role, i)

    def _local_spec(self, planned: PlannedStep, role: str, i: int) -> P:
        """The per-replica copies of a leaf: one per device on a leading axis over the data
        axes, the leaf's model axes kept on its own dimensions."""
        data = set(as_axes(planned.axis_name))
        entries = []
        for entry in planned.input_spec(role, i):
            axes = () if entry is None else tuple(a for a in as_axes(entry) if a not in data)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(planned.axis_name, *entries)

    def _user_shapes(self, planned: PlannedStep, role: str) -> list[tuple[int, ...]]:
        """The global shapes of the user's leaves of ``role``."""
        params, opts, _ = planned.captured.example_inputs
        return [tuple(x.shape) for x in jax.tree.leaves(params if role == "params" else opts)]

    # -- fragments and outer buckets -------------------------------------------------------
    def _param_avals(self, planned: PlannedStep) -> list[jax.ShapeDtypeStruct]:
        cap = planned.captured
        avals = []
        for i in range(cap.num_params):
            v = planned.body_invar("params", i).aval
            avals.append(jax.ShapeDtypeStruct(tuple(v.shape), v.dtype))
        return avals

    def _fragments(self, planned: PlannedStep) -> tuple[int, ...]:
        return planned.memo(
            "diloco.fragments",
            lambda: fragment_of_leaves([math.prod(a.shape) for a in self._param_avals(planned)], self.fragments),
        )

    def _outer_groups(self, planned: PlannedStep) -> list[tuple[int, list[int]]]:
        """The outer buckets: (fragment, its param leaf indices of one dtype), in order."""

        def build():
            avals, frag = self._param_avals(planned), self._fragments(planned)
            groups = []
            for p in range(self.fragments):
                by_dtype: dict = {}
                for i, f in enumerate(frag):
                    if f == p:
                        key = (np.dtype(avals[i].dtype), self._is_block(planned, i))
                        by_dtype.setdefault(key, []).append(i)
                groups.extend((p, leaves) for leaves in by_dtype.values())
            return groups

        return planned.memo("diloco.groups", build)

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        """One outer bucket per fragment and dtype. With fast axes, the replica's devices
        hold the same outer gradient, so each sends only its ``1/n_fast`` shard of every leaf
        over the slow axes (then the shards are all-gathered over the fast ones): the
        bucket is those shards.

        Args:
          planned: the captured and planned step.

        Returns:
          One `BucketSpec` per fragment and dtype: what the outer collective sends.

        Example:
        >>> import jaxsched
        >>> from jaxsched.strategies import DiLoCo
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> from jaxsched.demo import steps
        >>> diloco, planned = steps.planned_example(strategy)
        >>> [b.size for b in diloco.collective_buckets(planned)]  # two fragments, 11 and 12 floats
        [11, 12]
        """
        sync, fast, n_sync = self._axes(planned)
        n_fast = math.prod(planned.mesh.shape[a] for a in fast)
        avals = self._param_avals(planned)
        form = planned.collective_form("all_reduce")
        specs = []
        for k, (_, leaves) in enumerate(self._outer_groups(planned)):
            shapes = tuple(tuple(avals[i].shape) for i in leaves)
            size = sum(math.prod(s) for s in shapes)
            if n_fast > 1 and not self._is_block(planned, leaves[0]):  # each leaf's 1/n_fast shard
                shapes = tuple(_outer_shard_shape(sh, n_fast) for sh in shapes)
                size = sum(math.prod(sh) for sh in shapes)
            specs.append(
                BucketSpec(
                    k,
                    size,
                    np.dtype(avals[leaves[0]].dtype),
                    n_sync,
                    shapes,
                    False,
                    form=form,
                    mesh_axes=tuple((a, planned.mesh.shape[a]) for a in sync),
                )
            )
        return specs

    def _outer_specs_memo(self, planned: PlannedStep) -> list[BucketSpec]:
        return planned.memo("diloco.buckets", lambda: self.collective_buckets(planned))

    def _outer_treedefs(self, planned: PlannedStep) -> list:
        def build():
            avals, frag = self._param_avals(planned), self._fragments(planned)
            return [
                jax.tree.structure(
                    jax.eval_shape(self.outer.init, tuple(avals[i] for i in range(len(frag)) if frag[i] == p))
                )
                for p in range(self.fragments)
            ]

        return planned.memo("diloco.outer_treedefs", build)

    # -- checks ---------------------------------------------------------------------------
    def _check_step(self, planned: PlannedStep) -> None:
        cap = planned.captured
        if cap.kind == "pmap":
            raise UnsupportedStepError(
                "diloco keeps one copy of the parameters per replica on a "
                "leading device axis; write the step with jax.shard_map "
                "(or jax.jit) instead of jax.pmap"
            )
        sync, _, _ = self._axes(planned)
        for role, count in (("params", cap.num_params), ("opt_state", cap.num_opt)):
            for i in range(count):
                over_sync = [a for a in self._block_axes(planned, role, i) if a in sync]
                if over_sync:
                    name = f"params/{planned.paths[i]}" if role == "params" else f"opt_state[{i}]"
                    raise UnsupportedStepError(
                        f"diloco keeps a whole replica of the parameters per group of devices along "
                        f"sync_axes {sync}, but {name} is sharded over {tuple(over_sync)}, one of "
                        "them; shard it over the other data axes only (FSDP inside a replica, "
                        "HSDP), or synchronize other axes (sync_axes=...)"
                    )
        for r in planned.analysis.reductions:
            eqn = cap.body.eqns[r.eqn_index]
            if eqn.primitive.name not in SUM_REDUCTIONS and not r.scattered:
                raise UnsupportedStepError(
                    f"diloco replaces gradient sums, but a gradient reduction is {eqn.primitive.name}"
                )

    # -- state ----------------------------------------------------------------------------
    def initial_state(self, params: Any, opt_state: Any) -> DiLoCoState:
        return DiLoCoState(params, opt_state, (), (), (), (), 0)

    def _stacked(self, planned: PlannedStep, value: Any, role: str, i: int) -> Any:
        """One leaf of the user's layout as a stacked leaf: one copy per device, each device's
        its own block of a leaf sharded over the data axes."""
        from jaxsched.core.partition import manual_shard_map

        spec = planned.input_spec(role, i)
        value = planned.placed(value, spec)
        stack = manual_shard_map(
            lambda x: (x[None],),
            planned.mesh,
            (spec,),
            (self._local_spec(planned, role, i),),
            planned.captured.manual_axes,
        )
        return jax.jit(stack)(value)[0]

    def _is_stacked(self, planned: PlannedStep, leaves: Sequence[Any], role: str) -> bool:
        if not leaves:
            return False
        local = [tuple(planned.body_invar(role, i).aval.shape) for i in range(len(leaves))]
        got = [tuple(getattr(x, "shape", np.shape(x))) for x in leaves]
        if got == self._user_shapes(planned, role):
            return False
        if got == [(planned.axis_size,) + w for w in local]:
            return True
        want = self._user_shapes(planned, role)
        raise JaxschedValueError(
            f"the state's {role} do not fit this step: leaf shapes {got}, expected "
            f"{want} (user layout) or with a leading axis of {planned.axis_size} "
            f"(one copy per device); resume with the step it was saved with"
        )

    def convert(self, planned: PlannedStep, state: ScheduledState) -> DiLoCoState:
        """The user's ``(params, opt_state)`` or a saved `DiLoCoState` in this step's layout:
        per-replica copies stacked over the data axes, the global copy, one outer state per
        fragment, the fragment in flight and the step count, each placed on the mesh.

        Args:
          planned: the captured and planned step.
          state: ``SchedState(params, opt_state)`` in the user's layout, or a `DiLoCoState`.

        Returns:
          The `DiLoCoState`.

        Raises:
          JaxschedValueError: a saved state that does not fit these options (fragments,
            outer optimizer, overlap steps).

        Example:
        >>> import jax, optax
        >>> import jaxsched
        >>> from jaxsched.core import _capture as capture
        >>> from jaxsched.demo import steps
        >>> from jaxsched.pipeline import _selection as selection
        >>> from jaxsched.runtime import engine
        >>> from jaxsched.strategies import DiLoCo
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> chosen = selection.select(captured, strategy, None, engine.make_engine("xla"))
        >>> diloco, planned = chosen.strategy, chosen.planned
        >>> state = diloco.convert(planned, jaxsched.SchedState(params, tx.init(params)))
        >>> type(state).__name__, diloco.host_step(state), state.params["head"]["bias"].shape  # one copy per device
        ('DiLoCoState', 0, (2, 2))
        """
        self._check_step(planned)
        cap = planned.captured
        abstract = is_abstract(state)
        params, opts = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)
        check_leaf_counts(planned, params, opts)
        stacked = self._is_stacked(planned, params, "params")
        if self._is_stacked(planned, opts, "opt_state") != stacked and opts:
            raise JaxschedValueError("the state's params and opt_state are in different layouts")
        global_leaves = self._converted_global(planned, state, params, stacked)
        local_params = [self._converted_local(planned, x, "params", i, stacked, abstract) for i, x in enumerate(params)]
        local_opts = [self._converted_local(planned, x, "opt_state", j, stacked, abstract) for j, x in enumerate(opts)]
        return DiLoCoState(
            jax.tree.unflatten(cap.params_tree, local_params),
            jax.tree.unflatten(cap.opt_tree, local_opts),
            self.collective_state(planned, getattr(state, "collective_state", None), abstract),
            jax.tree.unflatten(cap.params_tree, global_leaves),
            self._converted_outer(planned, state, global_leaves, abstract),
            self._converted_in_flight(planned, state, abstract),
            self._converted_step(planned, state, abstract),
        )

    def _converted_local(self, planned: PlannedStep, x: Any, role: str, i: int, stacked: bool, abstract: bool) -> Any:
        """One replica-local leaf, stacked on a leading device axis over the data axes."""
        spec = self._local_spec(planned, role, i)
        if abstract:
            local = tuple(planned.body_invar(role, i).aval.shape)
            shape = tuple(x.shape) if stacked else (planned.axis_size,) + local
            return planned.zeros(shape, x.dtype, spec, abstract=True)
        return planned.placed(x, spec) if stacked else self._stacked(planned, x, role, i)

    def _converted_global(self, planned: PlannedStep, state: ScheduledState, params: list, stacked: bool) -> list:
        """The globally synchronized parameters: the saved ones, or the user's at the start."""
        global_leaves = jax.tree.leaves(getattr(state, "global_params", ()))
        if not stacked or not global_leaves:
            if stacked:
                raise JaxschedValueError(
                    "a diloco state with per-replica params needs its global_params; resume from a complete checkpoint"
                )
            global_leaves = params
        if len(global_leaves) != planned.captured.num_params:
            raise JaxschedValueError("the state's global_params do not match the step's params")
        return [planned.placed(x, self._global_spec(planned, "params", i)) for i, x in enumerate(global_leaves)]

    def _converted_outer(
        self, planned: PlannedStep, state: ScheduledState, global_leaves: list[jax.Array], abstract: bool
    ) -> tuple[optax.OptState, ...]:
        """One outer optimizer state per fragment: the saved ones (checked against this
        outer optimizer), or fresh ones for the fragment's global parameters."""
        outer_specs = self._outer_state_specs(planned)
        outer_state = tuple(getattr(state, "outer_state", ()) or ())
        if outer_state:
            treedefs = self._outer_treedefs(planned)
            if len(outer_state) != self.fragments or any(
                jax.tree.structure(s) != t for s, t in zip(outer_state, treedefs)
            ):
                raise JaxschedValueError(
                    f"the state's outer_state does not fit fragments={self.fragments} and "
                    "this outer optimizer; resume with the options it was saved with"
                )
            return tuple(
                jax.tree.unflatten(
                    jax.tree.structure(o), [planned.placed(a, spec) for a, spec in zip(jax.tree.leaves(o), specs)]
                )
                for o, specs in zip(outer_state, outer_specs)
            )
        frag = self._fragments(planned)
        fresh = []
        for p in range(self.fragments):
            mine = tuple(global_leaves[i] for i in range(len(frag)) if frag[i] == p)
            if abstract:
                shapes = jax.eval_shape(self.outer.init, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in mine))
                leaves = [
                    planned.zeros(a.shape, a.dtype, spec, abstract=True)
                    for a, spec in zip(jax.tree.leaves(shapes), outer_specs[p])
                ]
                fresh.append(jax.tree.unflatten(jax.tree.structure(shapes), leaves))
            else:
                init = self.outer.init(mine)
                leaves = [planned.placed(a, spec) for a, spec in zip(jax.tree.leaves(init), outer_specs[p])]
                fresh.append(jax.tree.unflatten(jax.tree.structure(init), leaves))
        return tuple(fresh)

    def _converted_in_flight(self, planned: PlannedStep, state: ScheduledState, abstract: bool) -> tuple:
        """With ``overlap_steps >= 2``, the reduced outer gradient of the fragment in flight
        (zeros at the start); ``()`` otherwise."""
        cap = planned.captured
        in_flight = tuple(getattr(state, "in_flight", ()) or ())
        if self.overlap_steps < 2:
            if in_flight:
                raise JaxschedValueError(
                    f"the state holds an outer gradient in flight, but overlap_steps="
                    f"{self.overlap_steps}; resume with the overlap_steps it was saved with"
                )
            return in_flight
        flight_specs = [self._global_spec(planned, "params", i) for i in range(cap.num_params)]
        if not in_flight:
            shapes, avals = self._user_shapes(planned, "params"), self._param_avals(planned)
            return tuple(
                planned.zeros(shape, a.dtype, spec, abstract) for shape, a, spec in zip(shapes, avals, flight_specs)
            )
        if len(in_flight) != cap.num_params:
            raise JaxschedValueError("the state's in_flight does not fit this step")
        return tuple(planned.placed(x, spec) for x, spec in zip(in_flight, flight_specs))

    @staticmethod
    def _converted_step(planned: PlannedStep, state: ScheduledState, abstract: bool) -> Any:
        """The inner steps taken, an int32 scalar on the mesh."""
        if abstract:
            return planned.zeros((), jnp.int32, P(), abstract=True)
        return planned.placed(jnp.asarray(getattr(state, "step", 0), jnp.int32), P())

    def finalize_untraced(self, state: ScheduledState) -> tuple[Any, Any]:
        if (
            not jax.tree.leaves(getattr(state, "global_params", ()))
            and not getattr(state, "outer_state", ())
            and int(np.asarray(getattr(state, "step", 0))) == 0
        ):
            return state.params, state.opt_state
        raise JaxschedValueError(
            "this 'diloco' state holds per-replica parameters but no step has been "
            "traced in this process, so they cannot be averaged; call "
            "sched.init(params, opt_state, example_batch) or one step first"
        )

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        """Parameters synchronized across every replica: a fragment in flight is applied as
        it would arrive, then every replica's drift since its fragment's last
        synchronization is averaged (``g + mean(local - g)``: exactly the global copy when
        nothing drifted). The inner optimizer states are averaged over the replicas (kept
        as they are where every replica holds the same value).

        Args:
          planned: the captured and planned step.
          state: a `DiLoCoState` (or a state in the user's layout, converted first).

        Returns:
          ``(params, opt_state)`` in the user's layout, the same on every replica.

        Example:
        >>> import jax, optax
        >>> import jaxsched
        >>> from jaxsched.core import _capture as capture
        >>> from jaxsched.demo import steps
        >>> from jaxsched.pipeline import _selection as selection
        >>> from jaxsched.runtime import engine
        >>> from jaxsched.strategies import DiLoCo
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> chosen = selection.select(captured, strategy, None, engine.make_engine("xla"))
        >>> diloco, planned = chosen.strategy, chosen.planned
        >>> state = diloco.convert(planned, jaxsched.SchedState(params, tx.init(params)))
        >>> final, _ = diloco.finalize(planned, state)
        >>> jax.tree.structure(final) == jax.tree.structure(params), final["head"]["bias"].shape
        (True, (2,))
        """
        state = self.convert(planned, state)
        cap = planned.captured
        step = self.host_step(state)
        in_flight = None if step is None else self.schedule.in_flight_after(step)
        drain = planned.memo(("diloco.finalize", in_flight), lambda: self._finalize_program(planned, in_flight))
        outs = drain(*jax.tree.leaves(state))
        return (
            jax.tree.unflatten(cap.params_tree, outs[: cap.num_params]),
            jax.tree.unflatten(cap.opt_tree, outs[cap.num_params :]),
        )

    # -- the per-device body ----------------------------------------------------------------
    def _state_specs(self, planned: PlannedStep) -> tuple[tuple[P, ...], "_PartCounts"]:
        cap = planned.captured
        n_p, n_o = cap.num_params, cap.num_opt
        coll = self.collective_state_specs(planned)
        n_outer = sum(t.num_leaves for t in self._outer_treedefs(planned))
        n_flight = n_p if self.overlap_steps >= 2 else 0
        counts = _PartCounts(params=n_p, opt=n_o, coll=len(coll), glob=n_p, outer=n_outer, flight=n_flight)
        glob = tuple(self._global_spec(planned, "params", i) for i in range(n_p))
        specs = (
            tuple(self._local_spec(planned, "params", i) for i in range(n_p))
            + tuple(self._local_spec(planned, "opt_state", j) for j in range(n_o))
            + coll
            + glob
            + tuple(spec for specs in self._outer_state_specs(planned) for spec in specs)
            + glob[:n_flight]
            + (P(),)
        )
        return specs, counts

    def _outer_state_specs(self, planned: PlannedStep) -> list[tuple[P, ...]]:
        """Per fragment, the spec of each outer-state leaf: that of the parameter it mirrors
        (a momentum of an FSDP parameter is a block too), else replicated."""

        def build():
            frag = self._fragments(planned)
            params_shapes = self._user_shapes(planned, "params")
            out = []
            for p in range(self.fragments):
                mine = [i for i in range(len(frag)) if frag[i] == p]
                avals = tuple(jax.ShapeDtypeStruct(params_shapes[i], self._param_avals(planned)[i].dtype) for i in mine)
                shapes = jax.eval_shape(self.outer.init, avals)
                structure = jax.tree.structure(avals)
                specs = jax.tree.map(lambda _: P(), shapes)
                like = lambda t: not isinstance(t, P) and jax.tree.structure(t) == structure
                # leaves inside a subtree shaped like the fragment's parameters mirror them
                marked = jax.tree.map(
                    lambda sub: tuple(self._global_spec(planned, "params", i) for i in mine) if like(sub) else sub,
                    jax.tree.map(lambda _: P(), shapes),
                    is_leaf=lambda t: like(t),
                )
                specs = tuple(leaf for leaf in jax.tree.leaves(marked, is_leaf=lambda t: isinstance(t, P)))
                out.append(specs)
            return out

        return planned.memo("diloco.outer_specs", build)

    @staticmethod
    def _split_state(leaves: Sequence[Any], counts: "_PartCounts") -> "_StateParts":
        parts, k = [], 0
        for count in counts:
            parts.append(list(leaves[k : k + count]))
            k += count
        params, opt, coll, glob, outer, flight = parts
        return _StateParts(params, opt, coll, glob, outer, flight, leaves[k])

    # -- one program per phase ---------------------------------------------------------------
    @property
    def schedule(self) -> FragmentSchedule:
        """When each fragment sends and arrives (`jaxsched.strategies._diloco_fragments`)."""
        return self._schedule

    def phase_key(self, step: int | None) -> PhaseKey:
        """Which fragment sends at the start and which arrives at the end of the program for
        inner step ``step`` (`FragmentSchedule.phase_key`): every phase with the same key
        shares one compiled program, with no condition around a collective (a staged engine
        cuts at them; XLA overlaps them).

        Args:
          step: inner steps taken (None: the representative phase, for tracing).

        Returns:
          ``(sender, arriver)``: fragment indices, None where no fragment sends or arrives.

        Example:
          >>> from jaxsched.strategies import DiLoCo
          >>> diloco = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
          >>> [diloco.phase_key(s) for s in range(1, 5)]  # fragment 0 after step 2, fragment 1 after step 4
          [(None, None), (0, 0), (None, None), (1, 1)]
        """
        return self._schedule.phase_key(step)

    def host_step(self, state: ScheduledState) -> int | None:
        """The inner steps ``state`` has taken, read on the host (None for an abstract state).

        The host picks the phase's program from it (`phase_key`), so that no program holds
        a condition around a collective.

        Args:
          state: the strategy's state.

        Returns:
          The step count, or None for an abstract state.

        Example:
          >>> from jaxsched.strategies import DiLoCo
          >>> diloco = DiLoCo(inner_steps=4)
          >>> diloco.host_step(diloco.initial_state({"w": 1.0}, ()))
          0
        """
        if is_abstract(state):
            return None
        return int(np.asarray(jax.device_get(getattr(state, "step", 0))))

    def _reduce_fragment(self, planned: PlannedStep, p: int, local: list, glob: list, carried: list) -> dict[int, Any]:
        """The mean over ``sync_axes`` of fragment ``p``'s outer gradients (``glob - local``)."""
        sync, fast, n_sync = self._axes(planned)
        n_fast = math.prod(planned.mesh.shape[a] for a in fast)
        specs = self._outer_specs_memo(planned)
        out = {}
        for k, (frag, leaves) in enumerate(self._outer_groups(planned)):
            if frag != p:
                continue
            if n_sync == 1:
                sums = [glob[i] - local[i] for i in leaves]
            elif n_fast == 1 or self._is_block(planned, leaves[0]):  # a block: this device's own
                deltas = [glob[i] - local[i] for i in leaves]
                sums, carried[k] = self.collective.all_reduce_tensors(deltas, self._axis(sync), specs[k], carried[k])
            else:
                # this device's shard of each leaf of the (identical within the replica) outer
                # gradient, summed over the slow axes, divided, then gathered over the fast
                # ones. A leaf whose leading dimension splits evenly is cut along it: its
                # shard and the gathered mean keep the leaf's layout (a flat, padded shard
                # costs XLA:TPU a relayout of the whole leaf after the gather: 5 ms for a
                # 4096x4096 float32 leaf in its estimate, on the step's critical path)
                index = lax.axis_index(self._axis(fast))
                shards = []
                for i, shape in zip(leaves, specs[k].shapes):
                    if _cut_rows(glob[i].shape, n_fast):
                        rows = shape[0]
                        cut = lambda x: lax.dynamic_slice_in_dim(x, index * rows, rows)
                        shards.append(cut(glob[i]) - cut(local[i]))
                    else:
                        (chunk,) = shape
                        d = glob[i] - local[i]
                        flat = jnp.pad(jnp.ravel(d), (0, chunk * n_fast - d.size))
                        shards.append(lax.dynamic_slice_in_dim(flat, index * chunk, chunk))
                totals, carried[k] = self.collective.all_reduce_tensors(shards, self._axis(sync), specs[k], carried[k])
                for i, t in zip(leaves, totals):
                    mean = lax.all_gather((t / n_sync).astype(glob[i].dtype), self._axis(fast), tiled=True)
                    if not _cut_rows(glob[i].shape, n_fast):
                        mean = mean[: glob[i].size].reshape(glob[i].shape)
                    out[i] = mean
                continue
            for i, s in zip(leaves, sums):
                out[i] = (s / n_sync).astype(glob[i].dtype)
        return out

    def _apply_fragment(
        self, planned: PlannedStep, p: int, reduced: dict, local: list, glob: list, outer: list
    ) -> None:
        """The outer update of fragment ``p`` from its mean outer gradient (in place on lists)."""
        frag = self._fragments(planned)
        mine = [i for i in range(len(frag)) if frag[i] == p]
        grads = tuple(reduced[i] for i in mine)
        values = tuple(glob[i] for i in mine)
        updates, outer[p] = self.outer.update(grads, outer[p], values)
        new = optax.apply_updates(values, updates)
        for i, g in zip(mine, new):
            g = g.astype(glob[i].dtype)
            glob[i] = g
            local[i] = (
                g if self.mixing == 0.0 else (self.mixing * local[i] + (1.0 - self.mixing) * g).astype(local[i].dtype)
            )

    def _inner_step(
        self, planned: PlannedStep, params: list, opts: list, batch: list, consts: list
    ) -> tuple[list, list, list]:
        """The user's body with each gradient sum restricted to the fast axes (times the
        replicas along the sync axes, so that a ``pmean`` is the replica's own mean)."""
        cap, analysis = planned.captured, planned.analysis
        body, reds = cap.body, analysis.reductions
        sync, _, _ = self._axes(planned)
        env = dict(zip(body.invars, planned.body_arguments(params, opts, batch, consts), strict=True))

        def emit(bucket) -> None:
            groups: dict = {}
            for j in bucket.reductions:
                r = reds[j]
                axes = r.sum_axes if r.scattered else reduction_axes(body.eqns[r.eqn_index])
                fast = tuple(a for a in axes if a not in sync)
                factor = math.prod(planned.mesh.shape[a] for a in axes if a in sync)
                groups.setdefault((fast, factor), []).append(j)
            for (fast, factor), js in groups.items():
                # a sharded parameter's gradient is reduce-scattered into its block over the
                # fast axes it is split over, as the user's step does inside a replica
                grads = [
                    scatter_block(read(env, reds[j].operand), reds[j], planned.mesh)
                    if reds[j].scattered
                    else read(env, reds[j].operand)
                    for j in js
                ]
                sums = list(lax.psum(tuple(grads), self._axis(fast))) if fast else grads
                for j, s in zip(js, sums):
                    aval = reds[j].result.aval
                    value = s * factor if factor != 1 else s
                    env[reds[j].result] = jnp.broadcast_to(value, aval.shape).astype(aval.dtype)

        walk_backward(analysis, env, {}, planned.buckets, emit)
        interpret_batching_sums([body.eqns[i] for i in analysis.update], lambda x: read(env, x), env.__setitem__)
        outs = [read(env, body.outvars[i]) for i in cap.outputs]
        n_p, n_o = cap.num_params, cap.num_opt
        return outs[:n_p], outs[n_p : n_p + n_o], outs[n_p + n_o :]

    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        """The program of the representative phase (see `phase_key`); an engine program
        per phase comes from `rewrite_phase`.

        Args:
          planned: the captured and planned step.

        Returns:
          A `RewrittenBody` of the phase ``phase_key(None)``.

        Example:
        >>> import jaxsched
        >>> from jaxsched.strategies import DiLoCo
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> from jaxsched.demo import steps
        >>> diloco, planned = steps.planned_example(strategy)
        >>> rewritten = diloco.rewrite(planned)
        >>> rewritten.state_in_specs == rewritten.state_out_specs
        True
        """
        self._check_step(planned)
        specs, _ = self._state_specs(planned)
        return RewrittenBody(self.rewrite_phase(planned, self.phase_key(None)), specs, specs, [], False)

    def _unpack(self, planned: PlannedStep, leaves: Sequence[Any]) -> "_Unpacked":
        _, counts = self._state_specs(planned)
        st = self._split_state(leaves, counts)
        outer, k = [], 0
        for t in self._outer_treedefs(planned):
            outer.append(jax.tree.unflatten(t, st.outer[k : k + t.num_leaves]))
            k += t.num_leaves
        return _Unpacked(
            local=unstack_local(st.params),
            opts=unstack_local(st.opt),
            carried=list(self.local_collective_state(planned, st.coll)),
            glob=list(st.glob),
            outer=outer,
            flight=list(st.flight),
            step=st.step,
        )

    def rewrite_phase(self, planned: PlannedStep, key: tuple):
        """The per-device body of the phase ``key = (sender, arriver)``.

        Args:
          planned: the captured and planned step.
          key: from `phase_key`.

        Returns:
          The body: the send first (its operands are ready before any compute), then the
          inner step, then the arrival.

        Example:
        >>> import jaxsched
        >>> from jaxsched.strategies import DiLoCo
        >>> strategy = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
        >>> from jaxsched.demo import steps
        >>> diloco, planned = steps.planned_example(strategy)
        >>> callable(diloco.rewrite_phase(planned, diloco.phase_key(2)))
        True
        """
        specs, _ = self._state_specs(planned)
        n_state = len(specs)
        tau = self.overlap_steps
        sender, arriver = key
        frag = self._fragments(planned)

        def body(*inputs):
            state_leaves, batch, consts = self.split_inputs(planned, inputs, n_state)
            v = self._unpack(planned, state_leaves)
            reduced = {}
            if sender is not None:
                # 1. the send, first in the program: its operands are ready before any compute
                reduced = self._reduce_fragment(planned, sender, v.local, v.glob, v.carried)
                if tau >= 2:
                    for i, r in reduced.items():
                        v.flight[i] = r
            # 2. the inner step: the user's step on this replica
            local, opts, aux = self._inner_step(planned, v.local, v.opts, batch, consts)
            local = list(local)
            # 3. the arrival
            if arriver is not None:
                if tau == 0:
                    red = self._reduce_fragment(planned, arriver, local, v.glob, v.carried)
                elif tau == 1:
                    red = reduced
                else:
                    red = {i: v.flight[i] for i in range(len(frag)) if frag[i] == arriver}
                self._apply_fragment(planned, arriver, red, local, v.glob, v.outer)
            outer_leaves = [x for o in v.outer for x in jax.tree.leaves(o)]
            new_state = (
                stack_local(local)
                + stack_local(list(opts))
                + self.stacked_collective_leaves(tuple(v.carried))
                + v.glob
                + outer_leaves
                + v.flight
                + [(v.step + 1).astype(jnp.int32)]
            )
            return new_state + list(aux)

        return body

    def _finalize_program(self, planned: PlannedStep, in_flight: int | None) -> Callable[..., tuple]:
        """Apply the fragment in flight (if any), then average every replica's drift; compiled
        by the step's engine (`Engine.compile`), with XLA's default options."""
        specs, _ = self._state_specs(planned)
        cap = planned.captured
        frag = self._fragments(planned)
        data, n = planned.axis_name, planned.axis_size

        sync, _, n_sync = self._axes(planned)
        # a block differs across the axes it is split over: it is averaged over the replicas
        # only (the sync axes); a whole leaf is the same on a replica's devices
        over = [
            (self._axis(sync), n_sync) if self._block_axes(planned, "params", i) else (data, n)
            for i in range(cap.num_params)
        ]
        opt_over = [self._axis(sync) if self._block_axes(planned, "opt_state", j) else data for j in range(cap.num_opt)]
        opt_count = [n_sync if self._block_axes(planned, "opt_state", j) else n for j in range(cap.num_opt)]

        def drain(*leaves):
            v = self._unpack(planned, leaves)
            local, glob = v.local, v.glob
            if in_flight is not None:
                red = {i: v.flight[i] for i in range(len(frag)) if frag[i] == in_flight}
                self._apply_fragment(planned, in_flight, red, local, glob, v.outer)
            params = [
                (g + lax.psum(x - g, axes) / count).astype(g.dtype) for x, g, (axes, count) in zip(local, glob, over)
            ]
            new_opts = []
            for o, axes, count in zip(v.opts, opt_over, opt_count):
                if jnp.issubdtype(o.dtype, jnp.floating):
                    same = lax.pmax(o, axes) == lax.pmin(o, axes)
                    new_opts.append(jnp.where(same, o, (lax.psum(o, axes) / count).astype(o.dtype)))
                else:
                    new_opts.append(lax.pmax(o, axes))
            return tuple(params) + tuple(new_opts)

        out_specs = tuple(planned.input_spec("params", i) for i in range(cap.num_params)) + tuple(
            planned.input_spec("opt_state", j) for j in range(cap.num_opt)
        )
        program = PerDeviceProgram(
            drain,
            planned.mesh,
            planned.axis_name,
            specs,
            out_specs,
            compiler_defaults=True,
            manual_axes=cap.manual_axes,
        )
        return planned.compiling_engine.compile(program)
