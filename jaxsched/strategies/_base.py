"""The strategy seam: what a strategy owns, and the state of the built-in ones.

A strategy owns four things (one module each, see `jaxsched.strategies`):

* its **state**, a ``NamedTuple`` with documented fields, with room for carried state
  (a collective wrapper's residuals live in ``collective_state``);
* the conversions from the user's trees and back (`Strategy.convert`,
  `Strategy.finalize`);
* its **rewrite**: a per-device body with one signature for every strategy,
  ``(*state leaves, *batch leaves, *consts) -> (*state leaves, *aux leaves)``;
* its **cost description**, a `CommPattern` that the planners
  and the simulator read.

Example:
    >>> state = SchedState(params={"w": 1.0}, opt_state=())
    >>> state.collective_state
    ()
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import math
from typing import Any, Callable, ClassVar, NamedTuple, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.core._analyze import Reduction
from jaxsched.core._bucketing import Bucket
from jaxsched.core._capture import CapturedStep
from jaxsched.runtime.collectives._base import (
    BucketSpec,
    Collective,
    CollectiveState,
    nbytes,
    stack_local,
    stacked_zeros,
    unstack_local,
)
from jaxsched.core._torus import block_scatter_stages
from jaxsched.runtime.collectives._torus import scatter_lanes, scatter_stages, staged_psum_scatter
from jaxsched.sim._costmodel import CommPattern
from jaxsched.plan._planned_step import PlannedStep, is_abstract

__all__ = [
    "bucket_sum_axes",
    "reduce_gradients",
    "scatter_block",
    "ScheduledState",
    "BucketReport",
    "check_leaf_counts",
    "placed_user_layout",
    "RewrittenBody",
    "SchedState",
    "Strategy",
    "UserLayoutStrategy",
]


class ScheduledState(Protocol):
    """What every strategy's state offers ([`SchedState`][jaxsched._schedule.SchedState] and the strategies' own
    NamedTuples): the user's trees, in the strategy's layout."""

    @property
    def params(self) -> Any: ...

    @property
    def opt_state(self) -> Any: ...


class SchedState(NamedTuple):
    """The state a built-in strategy carries between calls.

    Attributes:
      params: the user's params tree. A strategy may keep its leaves in its own layout
        between steps (``dear``: each leaf a flat, sharded ``(P * chunk,)`` array).
      opt_state: the user's optimizer state tree, in the strategy's layout.
      collective_state: what the collective (a compression wrapper) carries between
        steps, per bucket, every leaf stacked on a leading device axis; ``()`` when the
        collective carries nothing.

    Example:
        >>> import jaxsched
        >>> state = jaxsched.SchedState(params={"w": 1.0}, opt_state=())
        >>> state._replace(params={"w": 2.0}).params, state.collective_state
        ({'w': 2.0}, ())
    """

    params: Any
    opt_state: Any
    collective_state: CollectiveState = ()


@dataclasses.dataclass(frozen=True)
class RewrittenBody:
    """A strategy's per-device body and the specs of its state leaves.

    Attributes:
      body: ``(*state leaves, *batch leaves, *consts) -> (*state leaves, *aux leaves)``.
      state_in_specs, state_out_specs: one ``PartitionSpec`` per state leaf.
      fallbacks: ``(primitive, source line)`` pairs the rewrite could not run as planned
        (see [`FallbackWarning`][jaxsched.core.rewrite._rules.FallbackWarning]).
      check_vma: the ``shard_map`` typing mode the body is written for.
      compiler_defaults: compile with XLA's own default options, not the engine's
        per-target set (the identity strategy: the user's step as XLA compiles it alone).
      global_body: the same step on global arrays (same flat inputs and outputs), for an
        engine that can run it as it is: the identity strategy on a ``jax.jit`` step is the
        user's own program, partitioned by XLA.
      bucket_report: a function giving one `BucketReport` per bucket once the body
        has been traced (strategies that run the update on shards); None otherwise.
    """

    body: Callable[..., Sequence[Any]]
    state_in_specs: tuple[P, ...]
    state_out_specs: tuple[P, ...]
    fallbacks: list = dataclasses.field(default_factory=list)
    check_vma: bool = False
    compiler_defaults: bool = False
    global_body: Callable[..., Sequence[Any]] | None = None
    bucket_report: Callable[[], list] | None = None


@dataclasses.dataclass(frozen=True)
class BucketReport:
    """Whether one bucket's update ran on shards (``dear``), as data a test can read.

    Attributes:
      bucket: the bucket's index in the plan.
      params: the paths of its parameters.
      on_shards: True when no equation of the update that reads the bucket's gradients,
        parameters or optimizer state had to gather them.
      fallbacks: ``(primitive, source line)`` of each equation that did (the same as the
        [`FallbackWarning`][jaxsched.core.rewrite._rules.FallbackWarning] says).
    """

    bucket: int
    params: tuple[str, ...]
    on_shards: bool
    fallbacks: tuple[tuple[str, str], ...] = ()


class Strategy(abc.ABC):
    """One way of scheduling gradient communication. Subclass, then register with
    `jaxsched.strategies.register_strategy`.

    Class attributes:
      name: the registry name (``schedule(step, strategy=name)``).
      cost: what it sends per bucket, for the planners and the simulator.
      accepts_collective: False for strategies that issue no bucket collectives (the
        identity), which therefore cannot carry compression.

    Args:
      collective: how each bucket travels (a [`Collective`][jaxsched.runtime.collectives.Collective], e.g. a
        compressor's wrapper); default: a plain sum, or the `Hierarchical` one the mesh calls for
        (`for_mesh`).

    Example:
        >>> import jaxsched
        >>> from jaxsched.runtime.compress import TopK
        >>> strategy = jaxsched.strategies.Wfbp(collective=TopK(density=0.1))
        >>> strategy.name, isinstance(strategy, jaxsched.Strategy)
        ('wfbp', True)
    """

    name: ClassVar[str] = ""
    cost: CommPattern = CommPattern()
    accepts_collective: ClassVar[bool] = True
    #: whether the program compiles with XLA's default options (see `RewrittenBody`)
    compiler_defaults: ClassVar[bool] = False
    #: XLA options set over the engine's choice for this strategy's program (a variant of
    #: the compile-and-choose planner sets them; empty: the engine's set as it is)
    compiler_overrides: ClassVar[dict] = {}
    #: on GPU/TPU with ``buckets="auto"``: what each compiled candidate was estimated at
    #: (a `CompiledChoice`, set by selection)
    last_bucket_choice: Any = None
    #: whether params and opt_state stay in the user's layout between steps (so an adapter
    #: may hand them to the user after every step without a ``finalize``)
    keeps_user_layout: ClassVar[bool] = False
    #: whether capture computes a ``psum`` of a device-invariant value as ``x * axis size``
    #: (no communication; see `jaxsched.core._replay.invariant_sums_as_products`). Off by
    #: default: the user's own arithmetic, rounding included, is kept.
    folds_invariant_sums: ClassVar[bool] = False
    #: whether the program donates its state where the user's step donates its own
    #: (`jaxsched.core._capture.CapturedStep.donates_state`): off for a strategy whose
    #: program reads a state input after it wrote the output that would take its buffer, so
    #: that XLA copies every such input first and donation saves no memory
    donates_state: ClassVar[bool] = True

    def __init__(self, collective: Collective | None = None):
        if collective is not None and not self.accepts_collective:
            raise JaxschedValueError(
                f"strategy {self.name!r} issues no bucket collectives, so it cannot "
                f"carry {type(collective).__name__}; use wfbp or dear"
            )
        if collective is not None and not isinstance(collective, Collective):
            raise JaxschedTypeError(
                f"collective must be a jaxsched.runtime.collectives.Collective, got {type(collective).__name__}"
            )
        self.collective = collective if collective is not None else Collective()
        #: whether the collective is jaxsched's choice (then `for_mesh` may pick a
        #: hierarchical one), not the user's
        self.default_collective = collective is None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(collective={type(self.collective).__name__})"

    def for_mesh(self, captured: CapturedStep) -> "Strategy":
        """This strategy with the collective the mesh calls for.

        When the step is data parallel over several mesh axes and the devices say which
        are slow (another host), a `Hierarchical` sum, unless the user chose a collective.
        On TPU, XLA lowers the flat sum in two levels itself (`default_collective_for`).

        Args:
          captured: the captured step (its ``mesh`` and ``axis_name``).

        Returns:
          ``self``, or a copy with the hierarchical collective.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Wfbp(TopK(0.5)), None, engine.make_engine("xla"))
          >>> wfbp, planned = chosen.strategy, chosen.planned
          >>> wfbp.for_mesh(captured) is wfbp  # one data axis, a chosen collective: unchanged
          True
        """
        from jaxsched.runtime.collectives._hierarchical import default_collective_for

        if not (self.accepts_collective and getattr(self, "default_collective", False)):
            return self
        hierarchy = default_collective_for(captured.mesh, captured.axis_name)
        if hierarchy is None:
            return self
        chosen = copy.copy(self)
        chosen.collective, chosen.default_collective = hierarchy, False
        return chosen

    def initial_state(self, params: Any, opt_state: Any) -> Any:
        """The user's trees as this strategy's state, before any step was traced.

        Args:
          params: the user's params tree.
          opt_state: the user's optimizer state tree.

        Returns:
          The strategy's state ([`SchedState`][jaxsched._schedule.SchedState] for the built-in strategies).

        Example:
            >>> from jaxsched.strategies import Dear
            >>> Dear().initial_state({"w": 1.0}, ())
            SchedState(params={'w': 1.0}, opt_state=(), collective_state=())
        """
        return SchedState(params, opt_state)

    def finalize_untraced(self, state: ScheduledState) -> tuple[Any, Any]:
        """``finalize`` before any step was traced in this process.

        Only a state still in the user's layout can be returned; anything carried would be
        lost, so refuse.

        Args:
          state: a state from `initial_state` (or restored from a checkpoint).

        Returns:
          ``(params, opt_state)``.

        Example:
            >>> from jaxsched.strategies import Wfbp
            >>> Wfbp().finalize_untraced(SchedState({"w": 1.0}, ()))
            ({'w': 1.0}, ())
        """

        def holds_something(tree: Any) -> bool:
            return any(np.size(x) > 1 or bool(np.any(np.asarray(x) != 0)) for x in jax.tree.leaves(tree))

        carried = [
            f
            for f in getattr(state, "_fields", ())
            if f not in ("params", "opt_state") and holds_something(getattr(state, f))
        ]
        if carried:
            raise JaxschedValueError(
                f"this {self.name!r} state carries {', '.join(carried)} but no step "
                "has been traced in this process, so it cannot be drained; call "
                "sched.init(params, opt_state, example_batch) (the checkpoint restore "
                "target) or one step first"
            )
        return state.params, state.opt_state

    @abc.abstractmethod
    def convert(self, planned: PlannedStep, state: ScheduledState) -> NamedTuple:
        """The state in this strategy's layout for ``planned``, placed on the mesh.

        Args:
          planned: the captured and planned step.
          state: a state in the user's layout or this strategy's own (idempotent).

        Returns:
          The strategy's state NamedTuple.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Wfbp(TopK(0.5)), None, engine.make_engine("xla"))
          >>> wfbp, planned = chosen.strategy, chosen.planned
          >>> state = wfbp.convert(planned, jaxsched.SchedState(params, tx.init(params)))
          >>> type(state).__name__, [s.residual.shape for s, _ in state.collective_state]  # zeros, per device
          ('SchedState', [(2, 23)])
        """

    @abc.abstractmethod
    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        """Back to the user's trees.

        Args:
          planned: the captured and planned step.
          state: this strategy's state.

        Returns:
          ``(params, opt_state)`` in the user's layout.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Wfbp(TopK(0.5)), None, engine.make_engine("xla"))
          >>> wfbp, planned = chosen.strategy, chosen.planned
          >>> state = wfbp.convert(planned, jaxsched.SchedState(params, tx.init(params)))
          >>> final, _ = wfbp.finalize(planned, state)
          >>> jax.tree.structure(final) == jax.tree.structure(params)
          True
        """

    @abc.abstractmethod
    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        """The scheduled per-device body.

        Args:
          planned: the captured and planned step (its jaxpr, buckets and mesh).

        Returns:
          A `RewrittenBody`: the body and the specs of its state leaves.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Wfbp(TopK(0.5)), None, engine.make_engine("xla"))
          >>> wfbp, planned = chosen.strategy, chosen.planned
          >>> rewritten = wfbp.rewrite(planned)
          >>> callable(rewritten.body), len(rewritten.state_in_specs)  # params, opt_state, collective state
          (True, 8)
        """

    # -- helpers for subclasses ---------------------------------------------------------
    def bucket_specs(
        self,
        planned: PlannedStep,
        sizes: Sequence[int],
        dtypes: Sequence,
        shapes: Sequence[tuple] | None = None,
        interleaved: bool = False,
        op: str = "all_reduce",
    ) -> list[BucketSpec]:
        shapes = shapes if shapes is not None else [()] * len(sizes)
        scatters = op == "reduce_scatter"
        stages = scatter_stages(planned.mesh, planned.axis_name) if scatters else ()
        lanes = scatter_lanes(planned.mesh) if scatters else 0
        return [
            BucketSpec(
                k,
                int(n),
                np.dtype(d),
                planned.axis_size,
                tuple(map(tuple, s)),
                interleaved,
                form=planned.collective_form(op),
                mesh_axes=planned.data_mesh_axes,
                scatter_stages=stages,
                scatter_lanes=lanes,
            )
            for k, (n, d, s) in enumerate(zip(sizes, dtypes, shapes, strict=True))
        ]

    def concatenated_gradient_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        """Each bucket as the gradients its all-reduce sums, flattened and concatenated.

        One dtype per bucket: whole gradients over the data axes, or the blocks of sharded
        parameters over the data axes they are not sharded over (HSDP's replica axis).

        Args:
          planned: the captured and planned step.

        Returns:
          One `BucketSpec` per bucket.

        Example:
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> [b.size for b in wfbp.concatenated_gradient_buckets(planned)]  # one bucket of 23 floats
          [23]
        """
        reds = planned.analysis.reductions
        sizes, dtypes, shapes = [], [], []
        for bucket in planned.buckets:
            ops = [(reds[j].result if reds[j].scattered else reds[j].operand).aval for j in bucket.reductions]
            dtypes.append(ops[0].dtype if ops else np.float32)
            sizes.append(sum(math.prod(a.shape) for a in ops))
            shapes.append([a.shape for a in ops])
        specs = self.bucket_specs(planned, sizes, dtypes, [tuple(s) for s in shapes])
        return [_over_sum_axes(planned, spec, bucket) for spec, bucket in zip(specs, planned.buckets, strict=True)]

    def collective_template(self, planned: PlannedStep) -> tuple:
        """One device's carried collective state for each bucket of ``planned``.

        Args:
          planned: the captured and planned step.

        Returns:
          The collective's ``init`` of `collective_buckets` (memoised); ``()`` per bucket
          for a collective that carries nothing.

        Example:
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> [state.residual.shape for state, _ in wfbp.collective_template(planned)]  # TopK's error feedback
          [(23,)]
        """
        return planned.memo("collective.template", lambda: self.collective.init(self.collective_buckets(planned)))

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        """What the collective is told of each bucket; strategies that bucket override it.

        Args:
          planned: the captured and planned step.

        Returns:
          One `BucketSpec` per bucket (none here).

        Example:
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> [(b.size, b.axis_size) for b in wfbp.collective_buckets(planned)]
          [(23, 2)]
        """
        return []

    def collective_state(
        self, planned: PlannedStep, current: CollectiveState, abstract: bool = False
    ) -> CollectiveState:
        """The carried collective state on the mesh: fresh zeros, or ``current`` placed.

        Args:
          planned: the captured and planned step.
          current: the state carried so far, or None for fresh zeros.
          abstract: give abstract leaves (see `PlannedStep.zeros`).

        Returns:
          The state, every leaf stacked on a leading device axis.

        Example:
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> [state.residual.shape for state, _ in wfbp.collective_state(planned, None)]  # one row per device
          [(2, 23)]
        """
        template = self.collective_template(planned)
        if not jax.tree.leaves(template):
            return template
        spec = P(planned.axis_name)
        if current is None or not jax.tree.leaves(current):
            if abstract:
                return jax.tree.map(
                    lambda a: planned.zeros(
                        (planned.axis_size,) + tuple(np.shape(a)), jax.numpy.result_type(a), spec, abstract=True
                    ),
                    template,
                )
            current = stacked_zeros(template, planned.axis_size)
        return jax.tree.map(lambda leaf: planned.placed(leaf, spec), current)

    def split_inputs(
        self, planned: PlannedStep, inputs: Sequence[jax.Array], num_state: int
    ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        """A body's flat inputs split into their three parts.

        Args:
          planned: the captured and planned step.
          inputs: the body's flat inputs.
          num_state: how many of them are state leaves.

        Returns:
          ``(state leaves, batch leaves, consts)``.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.core import _capture as capture
          >>> from jaxsched.demo import steps
          >>> from jaxsched.pipeline import _selection as selection
          >>> from jaxsched.runtime import engine
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.zoo import models
          >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> tx = optax.sgd(0.1)
          >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
          >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
          >>> chosen = selection.select(captured, Wfbp(TopK(0.5)), None, engine.make_engine("xla"))
          >>> wfbp, planned = chosen.strategy, chosen.planned
          >>> captured.num_batch
          2
          >>> wfbp.split_inputs(planned, list(range(8)), 5)
          ([0, 1, 2, 3, 4], [5, 6], [7])
        """
        n_batch = planned.captured.num_batch
        return (
            list(inputs[:num_state]),
            list(inputs[num_state : num_state + n_batch]),
            list(inputs[num_state + n_batch :]),
        )

    def local_collective_state(self, planned: PlannedStep, leaves: Sequence[jax.Array]) -> CollectiveState:
        """Inside the body: this device's collective state, as the collective's tree.

        Args:
          planned: the captured and planned step.
          leaves: the body's collective state leaves (a leading device axis of 1).

        Returns:
          The collective's state tree, without the device axis.

        Example:
          >>> import jax, optax
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> leaves = [jax.numpy.zeros((1, *x.shape)) for x in jax.tree.leaves(wfbp.collective_template(planned))]
          >>> [state.residual.shape for state, _ in wfbp.local_collective_state(planned, leaves)]
          [(23,)]
        """
        treedef = jax.tree.structure(self.collective_template(planned))
        return jax.tree.unflatten(treedef, unstack_local(leaves))

    @staticmethod
    def stacked_collective_leaves(state: CollectiveState) -> list[jax.Array]:
        return stack_local(jax.tree.leaves(state))

    def collective_state_specs(self, planned: PlannedStep) -> tuple[P, ...]:
        n = len(jax.tree.leaves(self.collective_template(planned)))
        return (P(planned.axis_name),) * n


def bucket_sum_axes(planned: PlannedStep, bucket: Bucket) -> tuple[str, ...] | None:
    """The mesh axes a bucket's all-reduce sums over: the data axes (None), those a sharded
    parameter's block is not split over (HSDP's replica axis), or none (``()``: FSDP over
    every data axis, whose reduce-scatter is the whole reduction)."""
    reds = [planned.analysis.reductions[j] for j in bucket.reductions]
    return reds[0].sum_axes if reds and reds[0].scattered else None


def _over_sum_axes(planned: PlannedStep, spec: BucketSpec, bucket: Bucket) -> BucketSpec:
    axes = bucket_sum_axes(planned, bucket)
    if axes is None:
        return spec
    sizes = tuple((a, int(planned.mesh.shape[a])) for a in axes)
    return dataclasses.replace(spec, axis_size=math.prod(n for _, n in sizes), mesh_axes=sizes)


def reduce_gradients(
    collective: Collective,
    planned: PlannedStep,
    bucket: Bucket,
    grads: Sequence[jax.Array],
    spec: BucketSpec,
    state: CollectiveState,
    *,
    scattered: bool = False,
) -> tuple[list[jax.Array], CollectiveState]:
    """One bucket's gradients summed as the user's step sums them: all-reduced over the data
    axes through ``collective``; or, for parameters sharded over data axes, reduce-scattered
    into their blocks and those summed over the remaining data axes through ``collective``
    (compression and hierarchy apply to that sum, HSDP's replica axis). ``scattered``: the
    gradients of sharded parameters are their blocks already (`scatter_block`)."""
    reds = [planned.analysis.reductions[j] for j in bucket.reductions]
    if not reds or not reds[0].scattered:
        if planned.axis_size == 1:  # a sum over one device is the identity
            return list(grads), state
        return collective.all_reduce_tensors(list(grads), planned.axis_name, spec, state)
    mesh = planned.mesh
    blocks = list(grads) if scattered else [scatter_block(g, r, mesh) for g, r in zip(grads, reds, strict=True)]
    axes = reds[0].sum_axes
    if not axes:
        return blocks, state
    return collective.all_reduce_tensors(blocks, axes[0] if len(axes) == 1 else tuple(axes), spec, state)


def scatter_block(gradient: jax.Array, reduction: Reduction, mesh: Mesh | None = None) -> jax.Array:
    """A gradient reduce-scattered into its parameter's block (the sum over the block's axes).

    On a TPU torus where one reduce-scatter over the block's axes would span a 3-D block of
    chips (XLA:TPU then decomposes it into an all-reduce of the whole gradient), it runs in
    the two stages `block_scatter_stages` gives for
    ``mesh`` (a stage over pairs of chips as an exchange of halves, see
    `jaxsched.runtime.collectives.staged_psum_scatter`): each device ends with the same block."""
    axes = reduction.scatter_axes
    name = axes[0] if len(axes) == 1 else tuple(axes)
    # A layer's gradient sliced from a stacked one ([1, rows, cols], unrolled layers) is sent
    # without its unit dimensions: XLA:TPU otherwise computes the weight-gradient matmul into
    # a [1, rows, cols] fusion, which it priced at 1.6x the [rows, cols] one of the plain step.
    block_dim = reduction.scatter_dim
    if block_dim is None:
        raise AssertionError("jaxsched: a gradient without a block dimension was scattered; this is a bug")
    units = tuple(d for d, n in enumerate(gradient.shape) if n == 1 and d != block_dim)
    flat = jax.lax.squeeze(gradient, units)
    dim = block_dim - sum(d < block_dim for d in units)
    stages = block_scatter_stages(mesh, axes, nbytes(gradient))
    return jax.lax.expand_dims(staged_psum_scatter(flat, name, dim, stages), units)


class UserLayoutStrategy(Strategy):
    """Base of strategies whose params and optimizer state keep the user's layout.

    Subclasses implement `per_device`: the user's body inputs in, the user's body
    outputs out (plus the collective's new state).

    Args:
      collective: how each bucket travels (as for [`Strategy`][jaxsched.strategies.Strategy]).

    Example:
        >>> from jaxsched.strategies import AllReduce, Wfbp, Dear
        >>> [issubclass(s, UserLayoutStrategy) for s in (AllReduce, Wfbp, Dear)]
        [True, True, False]
    """

    keeps_user_layout = True

    def convert(self, planned: PlannedStep, state: ScheduledState) -> SchedState:
        params, opts = placed_user_layout(planned, state)
        return SchedState(
            params, opts, self.collective_state(planned, getattr(state, "collective_state", None), is_abstract(state))
        )

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        return state.params, state.opt_state

    @abc.abstractmethod
    def per_device(
        self, planned: PlannedStep, values: list[jax.Array], collective_state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        """Run the user's body on this device, with this strategy's collectives.

        Args:
          planned: the captured and planned step.
          values: values of the user's body inputs.
          collective_state: this device's collective state.

        Returns:
          ``(values of the body's outputs, new collective state)``.

        Example:
          >>> import jaxsched
          >>> from jaxsched.runtime.compress import TopK
          >>> from jaxsched.strategies import Wfbp
          >>> from jaxsched.demo import steps
          >>> wfbp, planned = steps.planned_example(Wfbp(TopK(0.5)))
          >>> wfbp.rewrite(planned).body is not None  # the body `rewrite` builds around `per_device`
          True
        """

    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        cap = planned.captured
        n_p, n_o = cap.num_params, cap.num_opt
        coll_specs = self.collective_state_specs(planned)
        n_state = n_p + n_o + len(coll_specs)

        def body(*inputs):
            state, batch, consts = self.split_inputs(planned, inputs, n_state)
            values = planned.body_arguments(state[:n_p], state[n_p : n_p + n_o], batch, consts)
            carried = self.local_collective_state(planned, state[n_p + n_o :])
            outs, carried = self.per_device(planned, values, carried)
            results = [outs[k] for k in cap.outputs]
            return results[: n_p + n_o] + self.stacked_collective_leaves(carried) + results[n_p + n_o :]

        in_specs = (
            tuple(planned.input_spec("params", i) for i in range(n_p))
            + tuple(planned.input_spec("opt_state", j) for j in range(n_o))
            + coll_specs
        )
        out_specs = tuple(planned.output_spec(k) for k in range(n_p + n_o)) + coll_specs
        return RewrittenBody(body, in_specs, out_specs, [], self.check_vma(planned), self.compiler_defaults)

    def check_vma(self, planned: PlannedStep) -> bool:
        return False


def placed_user_layout(planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
    """``state``'s params and opt_state in the user's layout, each leaf on the mesh with the
    spec the user's step gives it."""
    cap = planned.captured
    params, opts = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)
    check_leaf_counts(planned, params, opts)
    params = [planned.placed(v, planned.input_spec("params", i)) for i, v in enumerate(params)]
    opts = [planned.placed(v, planned.input_spec("opt_state", j)) for j, v in enumerate(opts)]
    return jax.tree.unflatten(cap.params_tree, params), jax.tree.unflatten(cap.opt_tree, opts)


def check_leaf_counts(planned: PlannedStep, params: Sequence, opts: Sequence) -> None:
    cap = planned.captured
    if len(params) != cap.num_params or len(opts) != cap.num_opt:
        raise JaxschedValueError(
            "the state does not match the step it was traced with: "
            f"{len(params)} params / {len(opts)} opt_state leaves, expected "
            f"{cap.num_params} / {cap.num_opt}"
        )
