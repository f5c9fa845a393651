"""The engine seam: what an engine receives, and the registry of engines.

An engine turns a `PerDeviceProgram` into something callable on global arrays.
The program is explicit: a per-device function whose collective equations (see
`jaxsched.core._primitives.COLLECTIVES`) mark where an engine may cut it into stages,
and the shard_map specs of its inputs and outputs. Engines know nothing of strategies.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> program = PerDeviceProgram(lambda x: (lax.psum(x, "data"),), mesh, "data", (P("data"),), (P(),))
    >>> [e.primitive.name for e in program.jaxpr(jax.ShapeDtypeStruct((2,), jnp.float32)).eqns]
    ['psum']
    >>> run = make_engine("xla").compile(program)
    >>> x = jax.device_put(jnp.array([1.0, 2.0]), jax.NamedSharding(mesh, P("data")))
    >>> [float(v) for v in run(x)[0]]
    [3.0]
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

import jax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedError, JaxschedTypeError, JaxschedValueError
from jaxsched.core.partition import manual_shard_map

__all__ = [
    "Engine",
    "engine_names",
    "EngineCosts",
    "make_engine",
    "PerDeviceProgram",
    "register_engine",
    "Stage",
    "StageTimer",
    "StageTiming",
]


def platform_family(platform: str) -> str:
    """``"gpu"`` for any of JAX's GPU platform names (``gpu``, ``cuda``, ``rocm``), else
    ``platform`` itself: what XLA's options and collective shapes depend on.

    Example:
        >>> platform_family("cuda"), platform_family("tpu")
        ('gpu', 'tpu')
    """
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


@dataclasses.dataclass(frozen=True)
class PerDeviceProgram:
    """A scheduled step as one per-device function plus the specs that run it.

    Attributes:
      body: ``(*state leaves, *batch leaves, *consts) -> (*state leaves, *aux leaves)``,
        traced per device (inside ``shard_map``).
      mesh, axis_name: where it runs; ``axis_name`` is the data-parallel axis.
      in_specs, out_specs: one ``PartitionSpec`` per flat input and output.
      check_vma: the ``shard_map`` typing mode the body was written for.
      compiler_defaults: compile with XLA's default options (engines that choose options
        per target leave them out; the identity strategy asks for this).
      bucket_bytes: the plan's bucket size in bytes per device (0: unknown;
        `jaxsched.plan._planned_step.PlannedStep.bucket_bytes`).
        A compiler that combines collectives may combine up to this size and no further:
        the leaves of one bucket merge into one collective, separate buckets stay separate.
      compiler_overrides: XLA options set over whatever the engine chooses (its platform
        set or XLA's defaults); ignored when the user passed ``compiler_options``.
      global_body: the same computation on global arrays (a ``jax.jit`` step run as the
        user wrote it), for engines that compile whole programs; None otherwise.
      manual_axes: the axes the body is manual over (None: every mesh axis); the specs name
        every axis and are restricted to these for the ``shard_map``.
      gathers_parameters: the body all-gathers parameter blocks where it uses them (FSDP): a
        compiler that combines collectives may want to combine those more.
      num_aux_outputs: how many of the last outputs are the step's aux (metrics, a gradient
        returned beside the state). On the axes the body leaves to XLA they are placed
        where XLA's propagation puts them, as the plain step's are (a tensor-parallel
        gradient stays split like its parameter); the state always as its specs say.
      aux_shardings: the aux's shardings as the plain step returns them, where they were
        read (`jaxsched.pipeline._plain_layout`): the program returns them so.
      donated_inputs: how many of the first inputs (the state's leaves) an engine that
        compiles the whole program donates, so that XLA updates the state in place: the
        user's step donates its whole state (`jaxsched.core._capture.CapturedStep.donates_state`).
      batch_inputs: the ``(start, stop)`` of the batch's leaves among the inputs, whose
        weak types are part of the signature (`signature_guarded`), as they are of
        ``jax.jit``'s: a Python scalar traces otherwise than a float32 array.
    """

    body: Callable[..., Sequence[Any]]
    mesh: Mesh
    axis_name: str | tuple[str, ...]
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    check_vma: bool = False
    compiler_defaults: bool = False
    bucket_bytes: int = 0
    compiler_overrides: dict = dataclasses.field(default_factory=dict)
    global_body: Callable[..., Sequence[Any]] | None = None
    manual_axes: tuple[str, ...] | None = None
    gathers_parameters: bool = False
    num_aux_outputs: int = 0
    aux_shardings: tuple[Any, ...] | None = None
    donated_inputs: int = 0
    batch_inputs: tuple[int, int] = (0, 0)

    def mapped(self) -> Callable[..., tuple]:
        """The body as a ``shard_map`` over the mesh (not jitted), manual over ``manual_axes``."""

        def flat_body(*args):
            return tuple(self.body(*args))

        return manual_shard_map(flat_body, self.mesh, self.in_specs, self.out_specs, self.manual_axes, self.check_vma)

    def out_shardings(self) -> tuple[Any, ...] | None:
        """Where the outputs go when the body leaves some axes to XLA (model axes) or the aux
        must go where the plain step's goes (``aux_shardings``): the state as the specs
        name it on every axis, never where XLA's propagation would put it (the next step
        takes it as it left); the aux as the plain step returns it, where read, else
        (None: unspecified) where XLA's propagation puts it on the model axes."""
        if self.manual_axes is None and self.aux_shardings is None:
            return None  # the shard_map's specs place every output
        return tuple(NamedSharding(self.mesh, spec) for spec in self.state_out_specs) + self.aux_out_shardings()

    @property
    def state_out_specs(self) -> tuple[P, ...]:
        return self.out_specs[: len(self.out_specs) - self.num_aux_outputs]

    def aux_out_shardings(self) -> tuple[Any, ...]:
        """The aux's ``out_shardings``: the plain step's where read, else None (unspecified:
        XLA's propagation)."""
        return self.aux_shardings if self.aux_shardings is not None else (None,) * self.num_aux_outputs

    def jaxpr(self, *global_args: Any):
        """The per-device jaxpr for these global (abstract or concrete) inputs: its collective
        equations are where a staged engine may cut."""
        return self.jaxpr_and_operands(*global_args)[0]

    def jaxpr_and_operands(self, *global_args: Any) -> tuple[Any, list]:
        """The per-device jaxpr and, per invar, where its value comes from: ``("arg", i)``
        (the program's input ``i``) or ``("const", value)`` (an array the body closed over)."""
        avals = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, spec))
            for a, spec in zip(global_args, self.in_specs, strict=True)
        ]
        closed = jax.make_jaxpr(self.mapped())(*avals)
        outer = closed.jaxpr
        (eqn,) = [e for e in outer.eqns if e.primitive.name == "shard_map"]
        origin = {v: ("arg", i) for i, v in enumerate(outer.invars)}
        origin.update({v: ("const", c) for v, c in zip(outer.constvars, closed.consts)})
        operands = [("const", x.val) if isinstance(x, jex_core.Literal) else origin[x] for x in eqn.invars]
        inner = eqn.params["jaxpr"]
        return (inner.jaxpr if hasattr(inner, "jaxpr") else inner), operands


@dataclasses.dataclass(frozen=True)
class EngineCosts:
    """What an engine changes in the cost of a step, for planners (buckets, ``strategy="auto"``).

    Attributes:
      overlaps: whether a collective can run while compute goes on. XLA:CPU runs
        collectives inline in the program (docs/benchmarks.md), so the ``xla`` engine on CPU
        does not overlap; planners then simulate one shared stream.
      per_collective_s: fixed seconds each collective costs on top of what
        `jaxsched.profile_network` measures for it (the host engine's Python dispatch
        of a communication stage, its device copies, and the compute stage its cut adds).
    """

    overlaps: bool = True
    per_collective_s: float = 0.0


@dataclasses.dataclass
class Stage:
    """One dispatched piece of the program.

    Attributes:
      kind: ``"compute"`` (on this process's mesh device) or ``"comm"`` (on the spare one).
      name: for timelines (`describe_compute_stage`, `describe_comm_stage`).
      eqns: the per-device equations it runs (for a communication stage: its collective,
        after any squeeze or reshape that only it reads first).
      inputs, outputs: the per-device jaxpr variables it reads and defines for later.
      fn: the jitted callable.
    """

    kind: str
    name: str
    eqns: list
    inputs: list
    outputs: list
    fn: Callable | None = None


@dataclasses.dataclass(frozen=True)
class StageTiming:
    """When one stage ran in one call, in seconds since the call began: ``dispatched`` when
    Python issued it, ``done`` when its outputs were ready (seen by a waiting thread),
    ``started`` the latest of its dispatch, the end of the previous stage on its device and
    the readiness of its inputs (for a collective that includes waiting for its peers)."""

    kind: str
    name: str
    dispatched: float
    started: float
    done: float


class StageTimer(Protocol):
    """A compiled program that runs in stages and times them on request
    (`Engine.stage_timer`; the host engine's `jaxsched.runtime.engine._host.StagedProgram`).

    Attributes:
      stages: the stages of the last traced signature, in dispatch order.
    """

    stages: list[Stage]

    def time_calls(self, on: bool) -> None:
        """Keep a `StageTiming` per stage of the following calls (``on``), or stop."""
        ...

    def take_timings(self) -> list[list[StageTiming]]:
        """The timings kept since the last take, one list per call, oldest first."""
        ...


class SignatureChanged(JaxschedError):
    """A core made by `signature_guarded` was called with inputs of another shape, dtype or
    batch weak type than it was traced for, or with one that is not an array: the caller
    checks them and picks the program that fits."""


def signature_guarded(fn: Callable[..., Any], weak_typed: tuple[int, int] = (0, 0)) -> Callable[..., Any]:
    """``fn`` refusing, when traced again, inputs of other shapes or dtypes than at its
    first trace (`SignatureChanged`), or of another weak type among the inputs from
    ``weak_typed[0]`` to ``weak_typed[1]`` (the batch's: a weakly typed scalar traces to
    other dtypes than a strong one; the state's weak types may change once, as the
    program's outputs replace the user's arrays).

    A ``jax.jit`` of it then checks a call's inputs in C++ as it dispatches, and a call whose
    signature changed reaches the guard (a trace) instead of running a program built for
    another one: the training loop's call need not check them in Python first. A retrace
    with the same signature (a state leaf's weak type, a cleared cache) runs ``fn``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> double = jax.jit(signature_guarded(lambda x: (x * 2,)))
        >>> double(jnp.ones(2))[0].tolist()
        [2.0, 2.0]
        >>> try:
        ...     double(jnp.ones(3))
        ... except SignatureChanged as err:
        ...     print(err)
        traced for float32[2], called with float32[3]
    """
    first: list[list[tuple[tuple[int, ...], Any, bool]]] = []
    start, stop = weak_typed

    @functools.wraps(fn)  # the compiled module keeps its name (profiles, HLO dumps)
    def guarded(*args: Any) -> Any:
        if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in args):
            raise SignatureChanged("called with an input that is not an array (a tree set in place of a leaf?)")
        signature = [
            (tuple(a.shape), a.dtype, start <= i < stop and bool(getattr(a, "weak_type", False)))
            for i, a in enumerate(args)
        ]
        if not first:
            first.append(signature)
        elif signature != first[0]:
            name = lambda sig: ", ".join(f"{'weak ' * weak}{dtype}{list(shape)}" for shape, dtype, weak in sig)
            raise SignatureChanged(f"traced for {name(first[0])}, called with {name(signature)}")
        return fn(*args)

    return guarded


class Engine(abc.ABC):
    """Runs per-device programs. Subclasses take their own options at construction.

    ``jaxsched.schedule(step, engine=...)`` takes an instance or a name registered with
    [`register_engine`][jaxsched.runtime.engine.register_engine]; subclasses implement
    `compile` and may override `costs`, `collective_form` and `resolve`.

    Example:
        >>> import jax
        >>> from jaxsched.runtime.engine import XlaEngine
        >>> class Quiet(XlaEngine):
        ...     name = "quiet"
        >>> engine = Quiet(compiler_options={})
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> engine.costs(mesh).overlaps, engine.collective_form(mesh, "all_reduce")
        (False, 'mixed')
    """

    name: str = ""
    #: Whether `compile`'s callable checks its inputs' signature as ``jax.jit`` does, and
    #: raises `SignatureChanged` rather than run a program of another signature: a
    #: training loop's call then hands it the batch unchecked.
    checks_signatures: bool = False

    def costs(self, mesh: Mesh) -> EngineCosts:
        """How this engine runs collectives on ``mesh``, for the planners.

        Args:
          mesh: the step's mesh.

        Returns:
          An `EngineCosts` (by default: collectives overlap compute except on CPU).

        Example:
          >>> import jax
          >>> from jaxsched.runtime import engine
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> engine.make_engine("xla").costs(mesh)  # XLA:CPU runs collectives inline
          EngineCosts(overlaps=False, per_collective_s=0.0)
        """
        return EngineCosts(overlaps=mesh.devices.flat[0].platform != "cpu")

    def collective_form(self, mesh: Mesh, op: str) -> str:
        """How a bucket's ``op`` (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``)
        should travel: one of `jaxsched.runtime.collectives.FORMS`.

        The compilers differ (docs/accelerators.md): XLA:TPU overlaps only collectives of
        single tensors in their own shapes, XLA:GPU's scheduler prefers fewer, larger
        all-reduces, and an engine that pays per collective (the host engine on gloo) wants
        few collectives without packing copies of large tensors (``"mixed"``).

        Args:
          mesh: the step's mesh.
          op: the bucket operation.

        Returns:
          One of `jaxsched.runtime.collectives.FORMS` (by default ``"mixed"``).

        Example:
          >>> import jax
          >>> from jaxsched.runtime import engine
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> engine.make_engine("xla").collective_form(mesh, "all_reduce")
          'mixed'
        """
        return "mixed"

    def resolve(self, program: PerDeviceProgram) -> "Engine":
        """The engine that will run ``program`` (an engine that chooses per mesh says which).

        Args:
          program: the per-device program to run.

        Returns:
          An engine (by default this one).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime import engine
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> psum = lambda x: (jax.lax.psum(x, "data"),)
          >>> program = engine.PerDeviceProgram(psum, mesh, "data", (P("data"),), (P(),))
          >>> xla = engine.make_engine("xla")
          >>> xla.resolve(program) is xla
          True
          >>> type(engine.make_engine("auto").resolve(program)).__name__  # "auto" picks per mesh
          'XlaEngine'
        """
        return self

    def stage_timer(self, compiled: Callable[..., tuple]) -> StageTimer | None:
        """How to time the stages of ``compiled`` (a callable this engine's `compile` made),
        or None: the engine runs a program whole (`jaxsched.pipeline.replan` then probes the
        network instead of timing the step's own collectives).

        Args:
          compiled: what `compile` returned.

        Returns:
          A `StageTimer`, or None (by default).

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime import engine
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> psum = lambda x: (jax.lax.psum(x, "data"),)
          >>> program = engine.PerDeviceProgram(psum, mesh, "data", (P("data"),), (P(),))
          >>> xla = engine.make_engine("xla")
          >>> xla.stage_timer(xla.compile(program)) is None  # one XLA program, no stages
          True
        """
        return None

    @abc.abstractmethod
    def compile(self, program: PerDeviceProgram) -> Callable[..., tuple]:
        """A callable on the program's global inputs returning its flat global outputs.

        ``callable.trace(*args)`` (as ``jax.jit`` has) lets callers lower the program.

        Args:
          program: the per-device program.

        Returns:
          The compiled callable.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime import engine
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> psum = lambda x: (jax.lax.psum(x, "data"),)
          >>> program = engine.PerDeviceProgram(psum, mesh, "data", (P("data"),), (P(),))
          >>> run = engine.make_engine("xla").compile(program)
          >>> run(jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P("data"))))[0].tolist()
          [2.0, 4.0]
        """


_ENGINES: dict[str, Callable[..., Engine]] = {}


def register_engine(name: str, factory: Callable[..., Engine]) -> None:
    """Make ``engine=name`` available; a taken name is refused.

    Args:
      name: the name ``jaxsched.schedule(..., engine=name)`` will take.
      factory: called with the engine options given to ``jaxsched.schedule`` (usually the
        `Engine` subclass itself).

    Raises:
      JaxschedValueError: ``name`` is already registered.

    Example:
        >>> from jaxsched.runtime.engine import XlaEngine, engine_names
        >>> "xla" in engine_names()
        True
        >>> register_engine("xla", XlaEngine)
        Traceback (most recent call last):
        ...
        jaxsched.JaxschedValueError: an engine named 'xla' is already registered
    """
    if name in _ENGINES:
        raise JaxschedValueError(f"an engine named {name!r} is already registered")
    _ENGINES[name] = factory


def engine_names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def make_engine(engine: str | Engine, **options: Any) -> Engine:
    """An engine from its registered name and options, or an instance as given."""
    if isinstance(engine, Engine):
        if options:
            raise JaxschedTypeError(
                f"engine options {sorted(options)} go to the engine's constructor "
                f"when an Engine instance ({type(engine).__name__}) is passed"
            )
        return engine
    if engine not in _ENGINES:
        raise JaxschedValueError(f"engine={engine!r} is unknown; choose one of {', '.join(_ENGINES)}")
    try:
        return _ENGINES[engine](**options)
    except TypeError as err:
        raise JaxschedTypeError(f"engine {engine!r} does not take options {sorted(options)}: {err}") from None
