"""``jaxsched.integrations.nnx``: schedule a training step written the Flax NNX way.

NNX users write ``train_step(model, optimizer, batch)``: it mutates the model and the
``nnx.Optimizer`` in place and returns metrics. `schedule` wraps such a step:

* the step may be an ``nnx.shard_map`` (usually under ``nnx.jit``), an ``nnx.pmap``, or any
  function that runs ``jax.shard_map`` over ``nnx.split``/``nnx.merge`` state;
* gradients are reduced with ``lax.pmean``/``psum`` inside it, as usual.

The adapter turns the step into the pure ``(params, rest, batch) -> (params, rest, aux)``
form that [`jaxsched.schedule`][jaxsched._schedule.schedule] schedules. ``params`` are the ``nnx.Param`` variables;
``rest`` is everything else the objects hold (optimizer state and step counter, RNG
streams, BatchNorm statistics, any other ``nnx.Variable``), so non-parameter state flows
through the step exactly as the unscheduled step would move it.

**When are the objects up to date?** Strategies that keep the user's layout between steps
(``allreduce``, ``wfbp``) write every variable back into the objects after each call.
Strategies that keep their own layout (``dear``: parameters and optimizer state sharded
across devices; ``approx``: gradients still in flight) hold the state inside the
scheduled step; the objects are brought up to date by ``sched.finalize(model,
optimizer)``, which you call before evaluating, checkpointing or reading the model.
Training may go on after ``finalize``. If you assign new values to the objects between
calls (load a checkpoint, run the plain step on them), the next call notices and starts
again from the objects' values.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> import jaxsched.integrations.nnx
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> model = models.MLP(8, 3, hidden=(16,), rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    >>> @nnx.jit
    ... @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
    ... def train_step(model, optimizer, batch):
    ...     x, y = batch
    ...     loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
    ...     optimizer.update(model, jax.lax.pmean(grads, "data"))
    ...     return jax.lax.pmean(loss, "data")
    >>> sched = jaxsched.integrations.nnx.schedule(train_step, strategy="dear")
    >>> batch = steps.shard_batch((jnp.ones((4, 8)), jnp.zeros(4, "int32")), mesh)
    >>> loss = sched(model, optimizer, batch)
    >>> sched.finalize(model, optimizer)   # dear keeps params sharded: bring objects up to date
    >>> int(optimizer.step[...])
    1
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
from flax import nnx
from flax.nnx import graphlib

from jaxsched._errors import JaxschedRuntimeError, JaxschedTypeError, JaxschedValueError
from jaxsched.runtime.collectives._base import Collective
from jaxsched.runtime.engine import Engine
from jaxsched._schedule import Scheduled
from jaxsched.strategies import Strategy

__all__ = ["NNXScheduled", "schedule"]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one object-graph structure maps to the pure step's dict trees and back.

    Attributes:
      graphdef: the structure of ``(model, optimizer, ...)`` as ``nnx.split`` sees it.
      params_template, rest_template: ``nnx.State`` skeletons refilled with new values.
      single_owner: params all belong to the first object, so their paths drop its index
        (``hidden/0/kernel`` rather than ``0/hidden/0/kernel``).
    """

    graphdef: Any
    params_template: Any
    rest_template: Any
    single_owner: bool

    def pure(self, params: Any, rest: Any) -> tuple[dict, dict]:
        """``nnx.State`` of params and of the rest -> the pure step's dicts."""
        pure_params: dict[Any, Any] = nnx.to_pure_dict(params)
        return (pure_params[0] if self.single_owner else pure_params), nnx.to_pure_dict(rest)

    def states(self, params: dict, rest: dict) -> tuple[Any, Any]:
        """The pure step's dicts -> fresh ``nnx.State`` objects of params and of the rest."""
        return (
            _refill(self.params_template, {0: params} if self.single_owner else params),
            _refill(self.rest_template, rest),
        )


@dataclasses.dataclass
class _Session:
    """What the adapter keeps for one object-graph structure: its layout, the scheduled pure
    step, that step's state (``None`` before the first call), and the leaf arrays the
    objects held when the adapter last touched them."""

    layout: _Layout
    scheduled: Scheduled
    state: Any = None
    written: tuple = ()


def _refill(template: Any, pure: dict) -> Any:
    """A fresh ``nnx.State`` shaped like ``template`` holding ``pure``'s values."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _leaves(*states: Any) -> tuple:
    return tuple(leaf for s in states for leaf in jax.tree.leaves(s))


def _split_params(nodes: Any) -> tuple[Any, Any, Any]:
    """``nnx.split(nodes, nnx.Param, ...)``: the graph, the params' state, the rest's state."""
    graphdef, params, rest = nnx.split(nodes, nnx.Param, ...)  # type: ignore[misc]
    return graphdef, params, rest


class NNXScheduled:
    """A scheduled NNX step: ``sched(model, optimizer, batch)`` and ``sched.finalize(...)``.

    Build it with `schedule`. Attributes: ``train_step`` (the user's step) and, after
    the first call, ``scheduled`` (the underlying [`jaxsched.Scheduled`][jaxsched._schedule.Scheduled], whose
    ``program``, ``verify`` and ``lower`` are available).

    Args:
      train_step: the NNX step, ``train_step(model, optimizer, *inputs)``.
      strategy: a registered strategy's name or a [`Strategy`][jaxsched.strategies.Strategy] instance.
      **schedule_options: the other arguments of [`jaxsched.schedule`][jaxsched._schedule.schedule] (checked now).

    Example:
        >>> sched = NNXScheduled(lambda model, optimizer, batch: 0.0, strategy="dear")
        >>> sched.strategy
        'dear'
    """

    def __init__(self, train_step: Callable, strategy: str | Strategy = "wfbp", **schedule_options: Any):
        if not callable(train_step):
            raise JaxschedTypeError(
                "jaxsched.integrations.nnx.schedule() needs the NNX train step "
                f"train_step(model, optimizer, batch), got {type(train_step).__name__}"
            )
        self.train_step = train_step
        self.strategy = strategy
        self.schedule_options = schedule_options
        Scheduled(train_step, strategy, **schedule_options)  # validates options now, not later
        self._session: _Session | None = None
        self._num_inputs: int | None = None  # arguments after the objects (the batch's parts)

    # -- public API -----------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        """One training step: updates the objects (see the module doc).

        Args:
          *args: the step's arguments, ``(model, optimizer, ..., batch)``.

        Returns:
          What the step returns (its metrics).
        """
        nodes, batch = self._split_args(args, "call")
        graphdef, params, rest = _split_params(nodes)
        session = self._session_for(graphdef, params, rest)
        if session.state is None or not _same_arrays(_leaves(params, rest), session.written):
            if session.state is not None and _carries_something(session.state):
                warnings.warn(
                    "the model or optimizer was changed outside the scheduled step; "
                    "starting again from the objects' values (state the strategy "
                    "carried, such as in-flight gradients or compression residuals, "
                    "is dropped)",
                    stacklevel=2,
                )
            session.state = session.scheduled.init(*session.layout.pure(params, rest), batch)
            session.written = _leaves(params, rest)
        session.state, aux = session.scheduled(session.state, batch)
        if session.scheduled.program.strategy.keeps_user_layout:
            self._write_back(session, nodes, session.state.params, session.state.opt_state)
        return aux

    def finalize(self, *nodes: Any) -> None:
        """Bring ``model``, ``optimizer`` (and any other object of the step) up to date.

        Performs what the strategy still holds back (``dear``'s all-gathers, ``approx``'s
        pending update) and writes every variable into the objects. Training may go on.
        The module's example calls it.

        Args:
          *nodes: the same objects the step was last called with, ``(model, optimizer, ...)``.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from flax import nnx
          >>> from jax.sharding import PartitionSpec as P
          >>> import jaxsched
          >>> from jaxsched.demo import steps
          >>> from jaxsched.zoo import models
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> model = models.MLP(8, 3, hidden=(16,), rngs=nnx.Rngs(0))
          >>> optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
          >>> @nnx.jit
          ... @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
          ... def train_step(model, optimizer, batch):
          ...     x, y = batch
          ...     loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
          ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
          ...     optimizer.update(model, jax.lax.pmean(grads, "data"))
          ...     return jax.lax.pmean(loss, "data")
          >>> sched = jaxsched.nnx.schedule(train_step, strategy="dear")
          >>> batch = steps.shard_batch((jnp.ones((4, 8)), jnp.zeros(4, "int32")), mesh)
          >>> loss = sched(model, optimizer, batch)
          >>> sched.finalize(model, optimizer)  # dear held the parameters sharded until now
          >>> int(optimizer.step[...]), model.head.kernel.shape
          (1, (16, 3))
        """
        nodes = tuple(nodes)
        session = self._session
        if session is None or session.state is None:
            return
        graphdef, params, rest = _split_params(nodes)
        if graphdef != session.layout.graphdef:
            raise JaxschedValueError(
                "finalize() got objects of another structure than the scheduled "
                "step was called with; pass the same (model, optimizer, ...)"
            )
        if not _same_arrays(_leaves(params, rest), session.written):
            raise JaxschedValueError(
                "the objects passed to finalize() were changed since the last "
                "scheduled step (or are other objects); finalize the objects you "
                "train with, right after training them"
            )
        user_params, user_rest = session.scheduled.finalize(session.state)
        self._write_back(session, nodes, user_params, user_rest)

    def lower(self, *args: Any):
        """``jax.stages.Lowered`` of the scheduled step for ``(model, optimizer, ..., batch)``.

        Ahead of time: objects built under ``nnx.eval_shape`` (abstract variables) and a
        batch of ``jax.ShapeDtypeStruct`` leaves lower on compile-only devices
        (`jaxsched.tools.aot`) without touching one. The objects are not changed.

        Args:
          *args: ``(model, optimizer, ..., batch)``, concrete or abstract.

        Returns:
          The ``jax.stages.Lowered`` program.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from flax import nnx
          >>> from jax.sharding import PartitionSpec as P
          >>> import jaxsched
          >>> from jaxsched.demo import steps
          >>> from jaxsched.zoo import models
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> model = models.MLP(8, 3, hidden=(16,), rngs=nnx.Rngs(0))
          >>> optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
          >>> @nnx.jit
          ... @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
          ... def train_step(model, optimizer, batch):
          ...     x, y = batch
          ...     loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
          ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
          ...     optimizer.update(model, jax.lax.pmean(grads, "data"))
          ...     return jax.lax.pmean(loss, "data")
          >>> sched = jaxsched.nnx.schedule(train_step, strategy="wfbp")
          >>> batch = steps.shard_batch((jnp.ones((4, 8)), jnp.zeros(4, "int32")), mesh)
          >>> lowered = sched.lower(model, optimizer, batch)
          >>> "all-reduce" in lowered.compile().as_text(), int(optimizer.step[...])  # nothing ran
          (True, 0)
        """
        session, state, batch = self._abstract_call(args, "lower")
        return session.scheduled.lower(state, batch)

    def inspect(self, *args: Any, baseline: bool = True):
        """Compile and read the scheduled step (see `jaxsched.Scheduled.inspect`).

        Args:
          *args: ``(model, optimizer, ..., batch)``, concrete or abstract; the objects are
            not changed.
          baseline: also compile the plain step, for the ratios.

        Returns:
          The `jaxsched.check._inspection.Inspection` report.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from flax import nnx
          >>> from jax.sharding import PartitionSpec as P
          >>> import jaxsched
          >>> from jaxsched.demo import steps
          >>> from jaxsched.zoo import models
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> model = models.MLP(8, 3, hidden=(16,), rngs=nnx.Rngs(0))
          >>> optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
          >>> @nnx.jit
          ... @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
          ... def train_step(model, optimizer, batch):
          ...     x, y = batch
          ...     loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
          ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
          ...     optimizer.update(model, jax.lax.pmean(grads, "data"))
          ...     return jax.lax.pmean(loss, "data")
          >>> sched = jaxsched.nnx.schedule(train_step, strategy="wfbp")
          >>> batch = steps.shard_batch((jnp.ones((4, 8)), jnp.zeros(4, "int32")), mesh)
          >>> report = sched.inspect(model, optimizer, batch, baseline=False).report
          >>> report.platform, report.num_sync > 0  # XLA:CPU: synchronous collectives, no estimate
          ('cpu', True)
        """
        session, state, batch = self._abstract_call(args, "inspect")
        return session.scheduled.inspect(state, batch, baseline=baseline)

    @property
    def scheduled(self) -> Scheduled:
        if self._session is None:
            raise JaxschedRuntimeError("the step has not been called yet")
        return self._session.scheduled

    # -- internals ------------------------------------------------------------------------
    def _abstract_call(self, args: tuple, what: str) -> tuple[_Session, Any, Any]:
        nodes, batch = self._split_args(args, what)
        graphdef, params, rest = _split_params(nodes)
        session = self._session_for(graphdef, params, rest)
        return session, session.scheduled.init(*session.layout.pure(params, rest)), batch

    def _split_args(self, args: tuple, what: str) -> tuple[tuple, Any]:
        """The leading NNX objects, and the inputs after them as one batch pytree (one input
        as it is; several, as the Flax guide's ``train_step(model, optimizer, x, y)``, as a
        tuple)."""
        count = 0
        while count < len(args) and graphlib.is_graph_node(args[count]):
            count += 1
        nodes, inputs = tuple(args[:count]), tuple(args[count:])
        if not nodes and args:
            raise JaxschedTypeError(
                f"argument 0 of the scheduled NNX step is a {type(args[0]).__name__}, "
                "not an NNX object (nnx.Module, nnx.Optimizer, ...); the step takes "
                "(model, optimizer, ..., batch): the objects first, then the batch"
            )
        if not nodes or not inputs:
            raise JaxschedTypeError(
                f"the scheduled NNX step takes (model, optimizer, ..., batch): NNX "
                f"objects first (nnx.Module, nnx.Optimizer), then the batch; the "
                f"{what} got {len(nodes)} NNX object(s) and {len(inputs)} other "
                "argument(s)"
            )
        for i, arg in enumerate(inputs):
            if graphlib.is_graph_node(arg):
                raise JaxschedTypeError(
                    f"argument {count + i} of the scheduled NNX step is an NNX object "
                    "after the batch's inputs; pass the objects first"
                )
        if self._num_inputs not in (None, len(inputs)):
            raise JaxschedTypeError(
                f"the scheduled NNX step was called with {self._num_inputs} input(s) "
                f"after the objects before; the {what} got {len(inputs)}"
            )
        self._num_inputs = len(inputs)
        return nodes, inputs[0] if len(inputs) == 1 else inputs

    def _session_for(self, graphdef: Any, params: Any, rest: Any) -> _Session:
        if self._session is not None and self._session.layout.graphdef == graphdef:
            return self._session
        pure_params = nnx.to_pure_dict(params)
        if not jax.tree.leaves(pure_params):
            raise JaxschedValueError(
                "the objects passed to the scheduled NNX step hold no nnx.Param: "
                "nothing to train, so nothing to schedule"
            )
        layout = _Layout(graphdef, params, rest, single_owner=list(pure_params) == [0])
        self._session = _Session(layout, Scheduled(self._pure_step_for(layout), self.strategy, **self.schedule_options))
        return self._session

    def _pure_step_for(self, layout: _Layout) -> Callable:
        train_step = self.train_step

        def pure_step(params: dict, rest: dict, batch: Any):
            nodes = nnx.merge(layout.graphdef, *layout.states(params, rest))
            inputs = batch if (self._num_inputs or 0) > 1 else (batch,)
            aux = train_step(*nodes, *inputs)
            _, new_params, new_rest = _split_params(nodes)
            return (*layout.pure(new_params, new_rest), aux)

        pure_step.__name__ = getattr(train_step, "__name__", "train_step")
        pure_step.__wrapped__ = train_step  # type: ignore[attr-defined]  # source lines in errors point at the user's step
        return pure_step

    def _write_back(self, session: _Session, nodes: tuple, params: dict, rest: dict) -> None:
        nnx.update(nodes, *session.layout.states(params, rest))
        _, new_params, new_rest = _split_params(nodes)
        session.written = _leaves(new_params, new_rest)


def _same_arrays(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _carries_something(state: Any) -> bool:
    extra = [getattr(state, f) for f in state._fields if f not in ("params", "opt_state")]
    return bool(jax.tree.leaves(extra))


def schedule(
    train_step: Callable | None = None,
    strategy: str | Strategy = "wfbp",
    buckets: Any = None,
    compiler_options: dict[str, Any] | None = None,
    *,
    engine: str | Engine = "auto",
    collective: Collective | None = None,
    compression: Collective | None = None,
    **options: Any,
) -> Any:
    """Schedule an NNX ``train_step(model, optimizer, batch)``; arguments as
    [`jaxsched.schedule`][jaxsched._schedule.schedule] (also usable as a decorator).

    The returned `NNXScheduled` is called like the step. With ``dear`` or ``approx``
    call ``sched.finalize(model, optimizer)`` before reading the objects (module doc).

    Args:
      train_step: ``train_step(model, optimizer, batch)``; omitted, ``schedule(...)`` is a
        decorator.
      strategy: a registered strategy's name or a [`Strategy`][jaxsched.strategies.Strategy] instance.
      buckets: the bucket plan (as [`jaxsched.schedule`][jaxsched._schedule.schedule]).
      compiler_options: XLA options for the scheduled program.
      engine: the compile backend.
      collective: how each bucket travels (compression).
      compression: the same as ``collective``.
      **options: the strategy's own options (``staleness=...``).

    Returns:
      The `NNXScheduled` step (or, without ``train_step``, a decorator that makes one).

    Example:
        >>> @schedule(strategy="wfbp")
        ... def train_step(model, optimizer, batch):
        ...     return 0.0
        >>> type(train_step).__name__
        'NNXScheduled'
    """

    def wrap(step: Callable) -> NNXScheduled:
        return NNXScheduled(
            step,
            strategy,
            buckets=buckets,
            compiler_options=compiler_options,
            engine=engine,
            collective=collective,
            compression=compression,
            **options,
        )

    return wrap if train_step is None else wrap(train_step)
