"""A captured step together with what every strategy asks of it: analysis, buckets,
parameter paths, and where each input and output of the user's body lives.

The analysis and the bucket plan are computed on first use, so a strategy that never
asks for them (the identity, ``allreduce``) schedules any step that captures.

Example:
    >>> import jax, optax
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> from jaxsched.core._capture import capture
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    >>> planned = PlannedStep(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
    >>> planned.paths, len(planned.buckets)
    (['head/bias', 'head/kernel', 'hidden/0/bias', 'hidden/0/kernel'], 1)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.core._axes import as_axes, spec_axes
from jaxsched.core._analyze import Analysis, analyze
from jaxsched.core._bucketing import DEFAULT_BUCKET_BYTES, Bucket, bucket_nbytes, param_paths, plan_buckets
from jaxsched.core._capture import CapturedStep, UnsupportedStepError
from jaxsched.runtime.engine._base import Engine, make_engine
from jaxsched.sim._costmodel import CommPattern, LayerProfile, NetworkProfile, WFBP_PATTERN

__all__ = ["is_abstract", "PlannedStep", "REPLICATED", "takes_as_is", "zero_count"]

REPLICATED = P()


def is_abstract(tree: Any) -> bool:
    """Whether ``tree`` holds abstract leaves (``jax.ShapeDtypeStruct``): a state or batch
    described for ahead-of-time compilation, not data.

    Args:
      tree: any pytree (a state, a batch).

    Returns:
      True if any leaf is a ``jax.ShapeDtypeStruct``.

    Example:
        >>> import jax, numpy as np
        >>> from jaxsched.plan import is_abstract
        >>> is_abstract({"w": np.ones(2)}), is_abstract({"w": jax.ShapeDtypeStruct((2,), np.float32)})
        (False, True)
    """
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))


def takes_as_is(current: jax.sharding.Sharding, sharding: NamedSharding, ndim: int) -> bool:
    """Whether an array on ``current`` goes into a program that wants ``sharding`` without
    being placed: the same layout on the same devices (a one-device mesh's batch on its
    device), and no other mesh for the program to trace it with; on a mesh with an Explicit
    axis, the same spec too. ``jax.device_put`` would copy it on every call for nothing.

    Args:
      current: the array's sharding now.
      sharding: the sharding the program wants.
      ndim: the array's rank (equivalence of shardings depends on it).

    Returns:
      True if the array can be passed without ``jax.device_put``.

    Example:
        >>> import jax
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from jaxsched.plan import takes_as_is
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> x = jax.device_put(jax.numpy.ones(4), NamedSharding(mesh, P("data")))
        >>> takes_as_is(x.sharding, NamedSharding(mesh, P("data")), 1)
        True
        >>> takes_as_is(x.sharding, NamedSharding(mesh, P()), 1)
        False
    """
    if current == sharding:
        return True
    if isinstance(current, NamedSharding) and current.mesh != sharding.mesh:
        return False
    if not current.is_equivalent_to(sharding, ndim):
        return False
    if all(t != jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return True
    # an Explicit mesh axis is part of the array's type: jax.jit types an argument by its own
    # spec and shard_map refuses one that is not its in_specs, even where the layout is the
    # same (P() or a single device's array for P("data") on a one-device mesh)
    padded = lambda spec: tuple(spec) + (None,) * (ndim - len(spec))
    return isinstance(current, NamedSharding) and padded(current.spec) == padded(sharding.spec)


def zero_count(*trees: Any) -> Any:
    """A step counter at zero for a state of ``trees``: abstract if they are, so an
    ahead-of-time compile never allocates it.

    Args:
      *trees: the pytrees of the state the counter goes with.

    Returns:
      ``np.int32(0)``, or a scalar int32 ``jax.ShapeDtypeStruct`` for abstract trees.

    Example:
        >>> import jax, numpy as np
        >>> from jaxsched.plan import zero_count
        >>> zero_count({"w": np.ones(2)})
        np.int32(0)
        >>> zero_count({"w": jax.ShapeDtypeStruct((2,), np.float32)})
        ShapeDtypeStruct(shape=(), dtype=int32)
    """
    return jax.ShapeDtypeStruct((), np.int32) if is_abstract(trees) else np.int32(0)


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedStep:
    """A captured step with its buckets chosen: a value, built once by
    `jaxsched.pipeline._selection.select` before the program is.

    Attributes:
      captured: what capture found.
      buckets_option: the bucket plan: None (the 25 MB threshold), a byte threshold, or
        explicit lists of parameter paths (``buckets="auto"`` is planned before this exists).
      plan_options: the user's planning options (layer_profile, network_profile, planner).
      pattern: the strategy's communication pattern.
      compression: how the simulator models the strategy's compressor (a
        `jaxsched.sim.Compression`); None for dense collectives.
      engine: the engine that will run the step.
      layer_profile, network_profile: what ``buckets="auto"`` planned with (None otherwise).
      derived: memo of what the strategy derives from the plan (see `memo`): a cache
        of values computed from the fields above, never read back as input.

    Example:
        >>> import jax, optax
        >>> from jaxsched.core._capture import capture
        >>> from jaxsched.demo import steps
        >>> from jaxsched.plan import PlannedStep
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> step = steps.make_step(apply_fn, tx, mesh)
        >>> planned = PlannedStep(capture(step, params, tx.init(params), batch), buckets_option=1)
        >>> planned.axis_size, planned.bucket_bytes, len(planned.buckets)
        (2, 1, 4)
    """

    captured: CapturedStep
    buckets_option: Any = None
    plan_options: dict = dataclasses.field(default_factory=dict)
    pattern: CommPattern = WFBP_PATTERN
    compression: Any = None
    engine: Engine | None = None
    layer_profile: LayerProfile | None = None
    network_profile: NetworkProfile | None = None
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.buckets_option, str):
            raise JaxschedValueError(
                f"buckets={self.buckets_option!r} is not understood; the only named "
                "plan is 'auto' (cost-model planning), which "
                "jaxsched.pipeline._selection.select resolves before planning"
            )

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """What a strategy derives from this plan (layouts, templates), computed once: the
        plan is built once per schedule, so its derivations are too.

        Args:
          key: names the derived value (any hashable).
          build: computes it on the first call for ``key``.

        Returns:
          The value ``build`` returned for ``key``.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.memo("layout", lambda: [1, 2]) is planned.memo("layout", lambda: None)
            True
        """
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    # -- what planning knows ------------------------------------------------------------
    @functools.cached_property
    def analysis(self) -> Analysis:
        return analyze(self.captured)

    @functools.cached_property
    def paths(self) -> list[str]:
        dummy = jax.tree.unflatten(self.captured.params_tree, [0] * self.captured.num_params)
        return param_paths(dummy)

    @functools.cached_property
    def buckets(self) -> list[Bucket]:
        return plan_buckets(self.analysis, self.paths, self.buckets_option)

    @property
    def bucket_bytes(self) -> int:
        """The plan's bucket size in bytes per device: the threshold of a threshold plan
        (``None``: 25 MiB), else the largest bucket (0 without buckets). An engine whose
        compiler combines collectives combines up to this size, so buckets stay separate."""
        option = self.buckets_option
        if option is None:
            return DEFAULT_BUCKET_BYTES
        if isinstance(option, int) and not isinstance(option, bool):
            return option
        return max((bucket_nbytes(self.analysis, b) for b in self.buckets), default=0)

    # -- where things live --------------------------------------------------------------
    @property
    def mesh(self):
        return self.captured.mesh

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        return self.captured.axis_name

    @property
    def axis_size(self) -> int:
        return self.captured.axis_size

    @property
    def data_mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of every data-parallel mesh axis, in the data axis's order."""
        return tuple((a, self.mesh.shape[a]) for a in as_axes(self.axis_name))

    def model_axes(self, role: str, index: int) -> tuple[str, ...]:
        """Mesh axes other than the data-parallel ones that leaf ``index`` of ``role`` is
        sharded over (a tensor- or expert-parallel block; each device schedules its own).

        Args:
          role: ``"params"``, ``"opt_state"``, ``"batch"`` or ``"const"``.
          index: the leaf's index among that role's flat leaves.

        Returns:
          The mesh axis names, in the spec's order; empty for a data-parallel leaf.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.model_axes("params", 0)
            ()
        """
        data = set(as_axes(self.axis_name))
        return tuple(a for a in spec_axes(self.input_spec(role, index)) if a not in data)

    @property
    def compiling_engine(self) -> Engine:
        """The engine that compiles this step's side programs (a strategy's ``finalize``):
        the step's own, or ``xla`` for a plan made without one (a test's or a planner's)."""
        return self.engine if self.engine is not None else make_engine("xla")

    def collective_form(self, op: str) -> str:
        """How buckets travel for ``op`` on this step's engine (`Engine.collective_form`).

        Args:
          op: the collective (``"psum"``, ``"psum_scatter"``, ...).

        Returns:
          The engine's form for ``op``; ``"mixed"`` for a plan made without an engine.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.collective_form("psum")
            'mixed'
        """
        return "mixed" if self.engine is None else self.engine.collective_form(self.mesh, op)

    def body_invar(self, role: str, index: int):
        """The body variable fed by leaf ``index`` of ``role``; refuses leaves that never reach it.

        Args:
          role: ``"params"``, ``"opt_state"``, ``"batch"`` or ``"const"``.
          index: the leaf's index among that role's flat leaves.

        Returns:
          The jaxpr variable of the ``shard_map`` body.

        Raises:
          UnsupportedStepError: the leaf is not read by the per-device step.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.body_invar("params", 0).aval
            ShapedArray(float32[2])
        """
        k = self.captured.body_input(role, index)
        if k < 0:
            name = f"params/{self.paths[index]}" if role == "params" else f"{role}[{index}]"
            raise UnsupportedStepError(
                f"{name} never reaches the shard_map body; pass only what the per-device step reads"
            )
        return self.captured.body.invars[k]

    def device_stacked(self, role: str, index: int) -> bool:
        """Whether the user holds leaf ``index`` of ``role`` with a leading device axis: a
        mapped input of a ``jax.pmap`` step (``jax_utils.replicate``'s layout), not an
        unmapped one (``in_axes=None``).

        Args:
          role: ``"params"``, ``"opt_state"``, ``"batch"`` or ``"const"``.
          index: the leaf's index among that role's flat leaves.

        Returns:
          False for every leaf of a ``shard_map`` or ``jax.jit`` step.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.device_stacked("params", 0)
            False
        """
        spec = self.input_spec(role, index)
        return self.captured.kind == "pmap" and len(spec) >= 1 and spec[0] is not None

    def input_spec(self, role: str, index: int) -> P:
        k = self.captured.body_input(role, index)
        return self.captured.in_specs[k] if k >= 0 else REPLICATED

    def output_spec(self, position: int) -> P:
        """Spec of the step's flat output ``position`` (params, opt_state, then aux leaves).

        Args:
          position: the index among the step's flat outputs.

        Returns:
          The output's ``PartitionSpec`` on the step's mesh.

        Example:
            >>> from jaxsched.demo import steps
            >>> planned = steps.planned_step_example()
            >>> planned.output_spec(0)
            P()
        """
        return self.captured.out_specs[self.captured.outputs[position]]

    @property
    def batch_specs(self) -> tuple[P, ...]:
        return tuple(self.input_spec("batch", b) for b in range(self.captured.num_batch))

    @property
    def const_specs(self) -> tuple[P, ...]:
        return tuple(self.input_spec("const", c) for c in range(len(self.captured.consts)))

    @property
    def aux_specs(self) -> tuple[P, ...]:
        n_state = self.captured.num_params + self.captured.num_opt
        return tuple(self.output_spec(k) for k in range(n_state, len(self.captured.outputs)))

    def body_arguments(
        self, params: Sequence[Any], opts: Sequence[Any], batch: Sequence[Any], consts: Sequence[Any]
    ) -> list:
        """Values for the user's body invars, in order, from leaves of each role: leaves the
        body never reads are dropped, so the rewritten program takes exactly what it uses.

        Args:
          params: the flat parameter leaves.
          opts: the flat optimizer-state leaves.
          batch: the flat batch leaves.
          consts: the captured constants.

        Returns:
          One value per body invar.

        Example:
            >>> import jax, optax
            >>> from jaxsched.core._capture import capture
            >>> from jaxsched.demo import steps
            >>> from jaxsched.plan import PlannedStep
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> planned = PlannedStep(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
            >>> len(planned.body_arguments(jax.tree.leaves(params), [], list(batch), []))
            6
        """
        by_role = {"params": params, "opt_state": opts, "batch": batch, "const": consts}
        return [by_role[src.role][src.index] for src in self.captured.sources]

    @functools.cached_property
    def _mesh_devices(self) -> frozenset:
        return frozenset(self.mesh.devices.flat)

    def _sharding(self, spec: P) -> NamedSharding:
        return self.memo(("sharding", spec), lambda: NamedSharding(self.mesh, spec))

    def zeros(self, shape: tuple, dtype: Any, spec: P, abstract: bool = False) -> Any:
        """Fresh zeros on the mesh with ``spec``, or their ``jax.ShapeDtypeStruct`` when the
        state is abstract (ahead-of-time compilation for devices that cannot hold data).

        Args:
          shape: the global shape.
          dtype: the element type.
          spec: how the zeros are sharded over the step's mesh.
          abstract: describe the zeros instead of allocating them.

        Returns:
          A ``jax.Array``, or a ``jax.ShapeDtypeStruct`` with its sharding.

        Example:
            >>> import jax, optax
            >>> from jaxsched.core._capture import capture
            >>> from jaxsched.demo import steps
            >>> from jaxsched.plan import PlannedStep
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> planned = PlannedStep(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
            >>> from jax.sharding import PartitionSpec as P
            >>> planned.zeros((2,), "float32", P("data")).sharding.spec
            P('data',)
            >>> planned.zeros((2,), "float32", P(), abstract=True).shape
            (2,)
        """
        if abstract:
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self._sharding(spec))
        return jax.device_put(np.zeros(tuple(shape), dtype), self._sharding(spec))

    def placed(self, value: Any, spec: P) -> Any:
        """``value`` on the mesh with ``spec``; replicated values already there are left alone.
        Runs for every leaf of every call, so it does no work a placed leaf does not need.
        An abstract leaf (``jax.ShapeDtypeStruct``, ahead-of-time compilation) stays abstract,
        with the sharding it would have.

        Args:
          value: a leaf of the user's state or batch.
          spec: the sharding the program wants for it.

        Returns:
          ``value`` itself where it can go in as is, else a copy placed with ``spec``.

        Example:
            >>> import jax, optax
            >>> from jaxsched.core._capture import capture
            >>> from jaxsched.demo import steps
            >>> from jaxsched.plan import PlannedStep
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> planned = PlannedStep(capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch))
            >>> import numpy as np
            >>> from jax.sharding import PartitionSpec as P
            >>> host = np.ones(2)
            >>> planned.placed(host, P()) is host
            True
            >>> planned.placed(host, P("data")).sharding.spec
            P('data',)
        """
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=self._sharding(spec))
        if not isinstance(value, jax.Array):
            if all(dim is None for dim in spec):
                return value  # on the host and replicated: jit places it
            return jax.device_put(value, self._sharding(spec))
        current = value.sharding
        if all(dim is None for dim in spec) and current.device_set == self._mesh_devices:
            return value  # replicated and on the mesh
        sharding = self._sharding(spec)
        if takes_as_is(current, sharding, value.ndim):
            return value
        return jax.device_put(value, sharding)
