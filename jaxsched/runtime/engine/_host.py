"""The ``host`` engine: real overlap where XLA cannot give it (CPU clusters).

XLA:CPU runs collectives synchronously, one op at a time inside a program: a psum next to
an independent matmul in one jitted program takes the sum of both times. Two programs on
*different* local devices do run at once. So this engine cuts the per-device program at
its collectives and dispatches the pieces itself:

* every maximal run of compute equations becomes a **compute stage**, jitted once for
  this process's device of the user's mesh;
* every collective becomes a **communication stage**, jitted once as a ``shard_map`` over
  a second mesh made of one spare local CPU device per process (``jax_num_cpu_devices=2``);
* stages are dispatched asynchronously, in program order; values cross between the two
  local devices with ``device_put``; nothing blocks until a result is needed. Compute of
  stage ``k + 1`` then runs on one device while collective ``k`` runs on the other.

Hazards this handles:

* XLA:CPU runs a program it estimates below about 1000 flops inline, in the calling
  thread, once its inputs are ready: dispatching it would block Python until the
  collective it waits on finished. Every stage therefore also sums a small *ballast*
  input, which keeps its estimate above that limit and its dispatch asynchronous.
* Every process dispatches the same stages in the same order (they come from one
  program), and every process must run its collectives in that order: two stages run in
  another order on each process pair different collectives (gloo aborts, or reads a short
  message into a longer buffer). XLA:CPU gang-schedules collectives only where a process
  holds several devices of a program; a communication stage holds one per process, so
  XLA orders it as any other work, which it does not promise for collectives. So every
  communication stage takes, and returns, an ordering token: the next one waits for it.
  The chain is one per set of spare devices in the process (`CollectiveOrder`), so that
  the stages of successive programs on them, a new plan's or a measurement's, keep to
  dispatch order too.
* Nothing else may run an XLA collective between the processes while stages are in flight
  (their traffic would meet the stages'): what the processes must agree on travels
  through jax.distributed's key-value store (`agree_across_processes`).

The engine knows nothing of strategies: it runs any per-device program whose collectives
sit at its top level (a collective inside a loop or cond is refused, naming it).

Example (one process: the collective stages run on the spare device, trivially):
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxsched.runtime.engine import PerDeviceProgram
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> body = lambda x: (lax.psum(jnp.sin(x), "data") * 2,)
    >>> program = PerDeviceProgram(body, mesh, "data", (P("data"),), (P("data"),))
    >>> run = HostEngine().compile(program)
    >>> x = jax.device_put(jnp.ones(3), jax.NamedSharding(mesh, P("data")))
    >>> bool(jnp.allclose(run(x)[0], 2 * jnp.sin(1.0)))
    True
    >>> [stage.kind for stage in run.stages]
    ['compute', 'comm', 'compute']
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedError
from jaxsched.core import _replay as replay
from jaxsched.runtime.engine._base import (
    Engine,
    EngineCosts,
    PerDeviceProgram,
    Stage,
    StageTimer,
    StageTiming,
    register_engine,
)
from jaxsched.core._primitives import CALL_PRIMITIVES, COLLECTIVES

__all__ = [
    "BALLAST_ELEMENTS",
    "BUCKET_MIN_BYTES",
    "cut_stages",
    "describe_comm_stage",
    "describe_compute_stage",
    "HEAVY_PRIMITIVES",
    "host_engine_applies",
    "HostEngine",
    "HostEngineError",
    "LAYOUT_PRIMITIVES",
    "measure_stage_overhead",
    "spare_devices",
    "Stage",
    "StagedProgram",
    "StageTiming",
]

#: Elements of the ballast each stage sums: above XLA:CPU's inline-execution estimate.
BALLAST_ELEMENTS = 4096

#: Equations that only relabel a buffer's shape. Between a collective and values that
#: already exist they run inside the communication stage instead of as a compute stage
#: of their own (which would copy the buffer on the compute device first).
LAYOUT_PRIMITIVES = frozenset({"squeeze", "reshape"})


class HostEngineError(JaxschedError, RuntimeError):
    """The program or the devices do not fit the host engine; the message says why."""


class CollectiveOrder:
    """The order of this process's communication stages on one set of spare devices.

    XLA:CPU runs a program's collectives after the previous collective launch only where
    the process holds several devices of the program; a communication stage holds one per
    process, so its order is not XLA's promise. Every process must run its collectives in
    the same order, so each stage takes the token the previous stage on these devices
    returned (its buffer is ready only when that stage has finished) and returns the next.
    One chain per process and set of devices, kept here rather than per program: the
    stages of every staged program on those devices (each plan's, the overhead
    measurement's) share it.

    Example:
        >>> import jax
        >>> from jax.sharding import Mesh
        >>> comm_mesh = Mesh(jax.devices()[1:2], ("data",))
        >>> CollectiveOrder.on(comm_mesh) is CollectiveOrder.on(comm_mesh)
        True
    """

    _chains: "dict[tuple[int, ...], CollectiveOrder]" = {}

    def __init__(self, comm_mesh: Mesh):
        self.token = jax.make_array_from_callback((), NamedSharding(comm_mesh, P()), lambda _: np.zeros((), np.float32))

    @classmethod
    def on(cls, comm_mesh: Mesh) -> "CollectiveOrder":
        """The chain of the devices of ``comm_mesh`` (made on first use)."""
        key = tuple(d.id for d in comm_mesh.devices.flat)
        if key not in cls._chains:
            cls._chains[key] = cls(comm_mesh)
        return cls._chains[key]


def spare_devices(mesh: Mesh) -> list:
    """For each device of ``mesh`` (flat order), a CPU device of the same process that the
    mesh does not use; raises `HostEngineError` where a process has none."""
    used = set(mesh.devices.flat)
    spares = []
    for device in mesh.devices.flat:
        candidates = [
            d
            for d in jax.devices()
            if d.process_index == device.process_index and d not in used and d.platform == device.platform
        ]
        if not candidates:
            raise HostEngineError(
                f"process {device.process_index} has no local {device.platform} device outside "
                "the mesh for collectives; give every process two CPU devices "
                "(jax.config.update('jax_num_cpu_devices', 2), or jaxsched launch --cpu-devices 2) "
                "and build the mesh from one device per process"
            )
        spares.append(min(candidates, key=lambda d: d.id))
    return spares


def host_engine_applies(mesh: Mesh) -> bool:
    """Whether ``engine="auto"`` picks the host engine: a multi-process CPU mesh with one
    device per process and a spare local device in each."""
    devices = list(mesh.devices.flat)
    if jax.process_count() == 1 or devices[0].platform != "cpu" or len(mesh.shape) != 1:
        return False
    if len({d.process_index for d in devices}) != len(devices):
        return False
    try:
        spare_devices(mesh)
    except HostEngineError:
        return False
    return True


def _is_collective(eqn) -> bool:
    return eqn.primitive.name in COLLECTIVES


def _inline_calls(program: PerDeviceProgram, args: Sequence[Any]) -> tuple[Any, list]:
    """The per-device jaxpr with nested calls inlined, so collectives sit at the top level."""
    jaxpr, operands = program.jaxpr_and_operands(*args)
    if not any(e.primitive.name in CALL_PRIMITIVES for e in jaxpr.eqns):
        return jaxpr, operands
    consts = [value for kind, value in operands if kind == "const"]
    n_const = len(consts)
    if [kind for kind, _ in operands[:n_const]] != ["const"] * n_const:
        raise HostEngineError("closed-over constants must lead the program's operands")

    def inlined(*a):
        return replay.eval_inline(jaxpr, [], list(consts) + list(a))

    flat = dataclasses.replace(program, body=inlined)
    return flat.jaxpr_and_operands(*args)


def cut_stages(jaxpr) -> list[Stage]:
    """Split a per-device jaxpr into stages: before each collective, the compute it needs
    that no earlier stage ran; the collective alone; at the end, everything else. Each
    compute group is split by the last collective it waits for, so that work independent
    of a collective is dispatched (and runs) before work that needs its result."""
    for eqn in jaxpr.eqns:
        for sub in jex_core.jaxprs_in_params(eqn.params):
            inner = [e for e in replay.nested_eqns(sub) if _is_collective(e)]
            if inner:
                raise HostEngineError(
                    f"{inner[0].primitive.name} inside {eqn.primitive.name} at "
                    f"{replay.source_line(eqn)}: the host engine stages collectives at the top "
                    "level of the program only; use engine='xla' for this step"
                )
    eqns = jaxpr.eqns
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    # The last collective (in dispatch order) each equation waits for, through any chain.
    waits_for: list[int] = []
    position = 0
    for eqn in eqns:
        if _is_collective(eqn):
            waits_for.append(position)
            position += 1
        else:
            waits_for.append(
                max((waits_for[producer[v]] for v in eqn.invars if replay.is_var(v) and v in producer), default=-1)
            )
    placed: set[int] = set()
    groups: list[tuple[str, list]] = []

    def add_compute(indices: list[int]) -> None:
        # Work that waits for no collective (or for earlier ones) is dispatched, and so runs,
        # before work that waits for a later one: one stage per collective waited for.
        for wait in sorted({waits_for[i] for i in indices}):
            groups.append(("compute", [eqns[i] for i in indices if waits_for[i] == wait]))

    for c, eqn in enumerate(eqns):
        if not _is_collective(eqn):
            continue
        # Before collective c runs only what it needs (and is not placed yet): compute that
        # does not feed it waits for a later stage, so it never waits for a collective it
        # does not read, and the collective never waits for compute it does not read.
        needed, stack = set(), [producer[v] for v in eqn.invars if replay.is_var(v) and v in producer]
        while stack:
            i = stack.pop()
            if i in needed or i in placed or _is_collective(eqns[i]):
                continue
            needed.add(i)
            stack.extend(producer[v] for v in eqns[i].invars if replay.is_var(v) and v in producer)
        if needed and all(eqns[i].primitive.name in LAYOUT_PRIMITIVES for i in needed):
            # Only a squeeze or reshape stands between the collective and values that exist:
            # it runs inside the communication stage (no copy on the compute device). It stays
            # unplaced, so compute that reads its result computes it there too.
            groups.append(("comm", [eqns[i] for i in sorted(needed)] + [eqn]))
            continue
        placed |= needed
        add_compute(sorted(needed))
        groups.append(("comm", [eqn]))
    add_compute([i for i, e in enumerate(eqns) if i not in placed and not _is_collective(e)])
    needed = {v for v in jaxpr.outvars if replay.is_var(v)}
    read_later: list[set] = [set() for _ in groups]
    for k in range(len(groups) - 1, -1, -1):
        read_later[k] = set(needed)
        for eqn in groups[k][1]:
            needed.update(v for v in eqn.invars if replay.is_var(v))
    stages: list[Stage] = []
    for k, (kind, eqns) in enumerate(groups):
        defined, inputs = set(), []
        for eqn in eqns:
            for v in eqn.invars:
                if replay.is_var(v) and v not in defined and v not in inputs:
                    inputs.append(v)
            defined.update(eqn.outvars)
        exported = [e for e in eqns if _is_collective(e)] if kind == "comm" else eqns
        outputs = [v for eqn in exported for v in eqn.outvars if v in read_later[k]]
        if kind == "comm":
            prim = exported[-1].primitive.name
            ordinal = sum(
                1
                for s in stages
                if s.kind == "comm"
                and s.eqns[-1].primitive.name == prim
                and _comm_bytes(s.eqns[-1]) >= BUCKET_MIN_BYTES
            )
            name = describe_comm_stage(exported, ordinal)
        else:
            name = describe_compute_stage(eqns, k)
        stages.append(Stage(kind, name, eqns, inputs, outputs))
    return stages


_TRANSPOSED = re.compile(r"transpose\((?:jvp\()?([^()]*)\)")
_JVP = re.compile(r"jvp\(([^()]*)\)")
HEAVY_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def _scope_tail(scope: str) -> str:
    return scope.rsplit("/", 1)[-1]


def describe_compute_stage(eqns: Sequence[Any], index: int) -> str:
    """What a compute stage does, for timelines: ``"fwd layer0..layer3 + bwd layer3"``,
    ``"update"``. Read off the equations' name stacks (``jax.named_scope`` in the model:
    forward under ``jvp(scope)``, backward under ``transpose(jvp(scope))``, anything under
    a scope named ``update``). When the stage has matmuls or convolutions only those are
    read (the cheap elementwise leftovers of a layer's forward often run with the next
    backward). Falls back to ``compute k`` (its position) when nothing is named."""
    heavy = [e for e in eqns if e.primitive.name in HEAVY_PRIMITIVES]
    forward: list[str] = []
    backward: list[str] = []
    update = False
    for eqn in eqns:
        stack = str(eqn.source_info.name_stack)
        if "update" in stack.split("/") or stack.endswith("update") or "(update" in stack:
            update = True
            continue
        if heavy and eqn.primitive.name not in HEAVY_PRIMITIVES:
            continue
        for pattern, scopes in ((_TRANSPOSED, backward), (_JVP, forward)):  # backward first
            match = pattern.search(stack)
            if match and match.group(1):
                scope = _scope_tail(match.group(1))
                if scope not in scopes:
                    scopes.append(scope)
                break
    parts = []
    for label, scopes in (("fwd", forward), ("bwd", backward)):
        if scopes:
            parts.append(f"{label} {scopes[0]}" if len(scopes) == 1 else f"{label} {scopes[0]}..{scopes[-1]}")
    if update:
        parts.append("update")
    return " + ".join(parts) if parts else f"compute {index}"


#: Below this a collective is a scalar or a statistic (the loss's pmean), not a bucket.
BUCKET_MIN_BYTES = 1024


def _comm_bytes(eqn: Any) -> int:
    return sum(
        int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
        for v in eqn.invars
        if hasattr(v, "aval") and hasattr(v.aval, "shape")
    )


def describe_comm_stage(eqns: Sequence[Any], ordinal: int) -> str:
    """``"psum bucket 2 (4.2 MB)"``: the collective, which of this program's collectives
    of that kind and of at least `BUCKET_MIN_BYTES` it is (in dispatch order; for a
    bucketed strategy, the bucket), and the bytes it sends. Smaller ones are ``"psum (4 B)"``."""
    eqn = eqns[-1]
    nbytes = _comm_bytes(eqn)
    if nbytes < BUCKET_MIN_BYTES:
        return f"{eqn.primitive.name} ({nbytes} B)"
    size = f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"
    return f"{eqn.primitive.name} bucket {ordinal} ({size})"


class HostEngine(Engine):
    """Stages dispatched asynchronously over two local devices per process.

    Args:
      record_timings: keep a `StageTiming` per stage of every call in
        ``compiled.timings`` (one list per call), for timelines. A background thread waits
        on each stage's outputs, which costs a little CPU: leave it off to measure speed.
    """

    name = "host"

    def __init__(self, record_timings: bool = False):
        self.record_timings = record_timings
        self._costs: dict[Any, EngineCosts] = {}

    def compile(self, program: PerDeviceProgram) -> "StagedProgram":
        if program.manual_axes is not None:
            raise HostEngineError(
                "the host engine stages data-parallel programs whose every mesh axis is a data "
                f"axis; this one leaves the model axes of its mesh {dict(program.mesh.shape)} to XLA "
                "(tensor parallelism): use engine='xla'"
            )
        return StagedProgram(program, self.record_timings)

    def stage_timer(self, compiled: Callable[..., tuple]) -> StageTimer | None:
        """``compiled`` itself: a `StagedProgram` times its stages on request."""
        return compiled if isinstance(compiled, StagedProgram) else None

    def costs(self, mesh: Mesh) -> EngineCosts:
        """Overlapping, at a measured Python cost per collective (`measure_stage_overhead`);
        measured once per mesh, by every process at the same point, as planning is."""
        key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names)
        if key not in self._costs:
            from jaxsched.runtime._processes import agree_across_processes

            seconds = measure_stage_overhead(mesh, mesh.axis_names[0])
            self._costs[key] = EngineCosts(True, float(agree_across_processes([seconds])[0]))
        return self._costs[key]


def measure_stage_overhead(mesh: Mesh, axis: str, repeats: int = 9) -> float:
    """Seconds of Python each collective adds to a staged step on ``mesh``.

    A cut at a collective adds a communication stage, a compute stage after it and two
    device copies, all dispatched from the Python thread that also feeds compute. This is
    the median dispatch time of a staged ``compute -> psum -> compute`` program minus that
    of the same compute as one stage (both tiny, so only dispatch counts). Every process
    must call it at the same point (the psum is a real collective).
    """
    spec = (P(axis),)
    staged = StagedProgram(PerDeviceProgram(lambda x: (lax.psum(x * 2.0, axis) * 3.0,), mesh, axis, spec, spec))
    plain = StagedProgram(PerDeviceProgram(lambda x: (x * 2.0 * 3.0,), mesh, axis, spec, spec))
    host = np.ones((mesh.devices.size, 8), np.float32)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(axis)), lambda i: host[i])

    def dispatch_seconds(program: StagedProgram) -> float:
        start = time.perf_counter()
        out = program(x)
        seconds = time.perf_counter() - start
        jax.block_until_ready(out)
        return seconds

    dispatch_seconds(staged), dispatch_seconds(plain)  # the first calls trace and compile
    # interleaved pairs: a busy moment slows both programs of a pair, not one side's median
    differences = [dispatch_seconds(staged) - dispatch_seconds(plain) for _ in range(repeats)]
    return max(0.0, float(np.median(differences)))


class StagedProgram:
    """A per-device program cut into stages; callable on the program's global inputs.

    Attributes:
      stages: the stages of the last traced signature, in dispatch order.
      timings: with ``record_timings``, one list of `StageTiming` per call.
    """

    def __init__(self, program: PerDeviceProgram, record_timings: bool = False):
        self.program = program
        self.record_timings = record_timings
        self.timings: list[list[StageTiming]] = []
        mesh, axis = program.mesh, program.axis_name
        if isinstance(axis, tuple) or mesh.devices.size != mesh.shape[axis]:
            raise HostEngineError(
                f"the host engine runs meshes with one data-parallel axis and no "
                f"other; this step's data-parallel axis is {axis!r} on a mesh "
                f"with axes {dict(mesh.shape)}; run it with engine='xla'"
            )
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        if len(local) != 1:
            raise HostEngineError(
                f"the host engine needs exactly one mesh device per process; process "
                f"{jax.process_index()} has {len(local)}. On one machine, start one process per "
                "mesh device (jaxsched launch)"
            )
        self.device = local[0]
        self.rank = list(mesh.devices.flat).index(self.device)
        spares = spare_devices(mesh)
        self.comm_device = spares[self.rank]
        self.comm_mesh = Mesh(np.array(spares), (axis,))
        self.order = CollectiveOrder.on(self.comm_mesh)
        self.stages: list[Stage] = []
        self._signature: Any = None

    # -- building ---------------------------------------------------------------------------
    def _trace(self, args: Sequence[Any]) -> None:
        jaxpr, operands = _inline_calls(self.program, args)
        self.jaxpr, self.operands = jaxpr, operands
        self.stages = cut_stages(jaxpr)
        for stage in self.stages:
            stage.fn = self._comm_fn(stage) if stage.kind == "comm" else self._compute_fn(stage)
        self._ballast = jax.device_put(jnp.zeros(BALLAST_ELEMENTS, jnp.float32), self.device)
        self._comm_ballast = self._global_comm(
            jax.device_put(jnp.zeros((1, BALLAST_ELEMENTS), jnp.float32), self.comm_device)
        )

    def _compute_fn(self, stage: Stage) -> Callable:
        rank = self.rank

        def run_eqn(eqn, values):
            if eqn.primitive.name == "axis_index":  # outside shard_map: this process's position
                return [jnp.asarray(rank, eqn.outvars[0].aval.dtype)]
            return replay.bind(eqn, values)

        def fn(ballast, *inputs):
            env = dict(zip(stage.inputs, inputs, strict=True))
            replay.interpret(stage.eqns, lambda x: replay.read(env, x), env.__setitem__, run_eqn)
            return [env[v] for v in stage.outputs], jnp.sum(ballast)

        return jax.jit(fn)  # runs where its inputs live: the ballast pins it to the mesh device

    def _comm_fn(self, stage: Stage) -> Callable:
        axis = self.program.axis_name

        def per_device(ballast, token, *blocks):
            env = {v: _from_block(b, v) for v, b in zip(stage.inputs, blocks, strict=True)}
            replay.interpret(stage.eqns, lambda x: replay.read(env, x), env.__setitem__)
            return [_to_block(env[v]) for v in stage.outputs], token + jnp.sum(ballast)

        mapped = jax.shard_map(
            per_device,
            mesh=self.comm_mesh,
            in_specs=(P(axis), P()) + (P(axis),) * len(stage.inputs),
            out_specs=([P(axis)] * len(stage.outputs), P()),
            check_vma=False,
        )
        return jax.jit(mapped)  # the token is read: it is an input XLA waits for

    # -- running ----------------------------------------------------------------------------
    def time_calls(self, on: bool) -> None:
        """Keep a `StageTiming` per stage of the following calls (``on``), or stop (`StageTimer`)."""
        self.record_timings = on

    def take_timings(self) -> list[list[StageTiming]]:
        """The timings kept since the last take, one list per call, oldest first (`StageTimer`)."""
        taken = list(self.timings)
        self.timings.clear()
        return taken

    def __call__(self, *args: Any) -> tuple:
        signature = tuple((tuple(np.shape(a)), str(a.dtype)) for a in args)
        if signature != self._signature:
            self._trace(args)
            self._signature = signature
        return self._run(args)

    def _global_comm(self, local_block: jax.Array) -> jax.Array:
        """This process's block on its spare device as a global comm-mesh array (the blocks
        of every process stacked along the first axis)."""
        shape = tuple(local_block.shape)
        return jax.make_array_from_single_device_arrays(
            (self.comm_mesh.devices.size * shape[0],) + shape[1:],
            NamedSharding(self.comm_mesh, P(self.program.axis_name)),
            [local_block],
        )

    def _run(self, args: Sequence[Any]) -> tuple:
        env: dict[Any, Any] = {}
        for var, (kind, value) in zip(self.jaxpr.invars, self.operands, strict=True):
            if kind == "arg":
                arg = args[value]
                env[var] = arg.addressable_data(0) if isinstance(arg, jax.Array) else jnp.asarray(arg)
            else:
                env[var] = jax.device_put(value, self.device)
        comm_blocks: dict[Any, Any] = {}  # var -> its block (_to_block) on the spare device
        timeline = _Timeline(self.record_timings)
        for stage in self.stages:
            if stage.kind == "compute":
                values = [self._on_compute(v, env, comm_blocks) for v in stage.inputs]
                outs, _ = self._fn(stage)(self._ballast, *values)
                env.update(zip(stage.outputs, outs, strict=True))
            else:
                blocks = [self._global_comm(self._on_comm(v, env, comm_blocks)) for v in stage.inputs]
                outs, self.order.token = self._fn(stage)(self._comm_ballast, self.order.token, *blocks)
                outs = [o.addressable_data(0) for o in outs]
                comm_blocks.update(zip(stage.outputs, outs, strict=True))
            timeline.add(stage, outs)
        results = tuple(
            self._global_output(self._on_compute(var, env, comm_blocks), spec)
            for var, spec in zip(self.jaxpr.outvars, self.program.out_specs, strict=True)
        )
        if self.record_timings:
            self.timings.append(timeline.finish())
        return results

    def _on_compute(self, var, env: dict, comm_blocks: dict) -> Any:
        if not replay.is_var(var):
            return jnp.asarray(var.val)
        if var not in env:  # produced by a collective: bring it over, drop the device axis
            env[var] = _from_block(jax.device_put(comm_blocks[var], self.device), var)
        return env[var]

    def _on_comm(self, var, env: dict, comm_blocks: dict) -> jax.Array:
        if not replay.is_var(var):
            return jax.device_put(_to_block(jnp.asarray(var.val)), self.comm_device)
        if var not in comm_blocks:
            comm_blocks[var] = jax.device_put(_to_block(jnp.asarray(env[var])), self.comm_device)
        return comm_blocks[var]

    def _global_output(self, local: Any, spec: P) -> jax.Array:
        mesh, axis = self.program.mesh, self.program.axis_name
        local = jax.device_put(jnp.asarray(local), self.device)
        shape = list(local.shape)
        for dim, name in enumerate(spec):
            names = name if isinstance(name, tuple) else (name,)
            if axis in names:
                shape[dim] *= mesh.shape[axis]
        return jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, spec), [local])

    @staticmethod
    def _fn(stage: Stage) -> Callable:
        if stage.fn is None:  # set for every stage by `_trace`
            raise HostEngineError(f"stage {stage.name!r} was never compiled")
        return stage.fn

    def lower(self, *args: Any):
        raise HostEngineError(
            "the host engine runs a sequence of stage programs, not one lowered "
            "program; inspect `.stages` after a call, or lower with engine='xla'"
        )

    trace = lower


def _to_block(value: jax.Array) -> jax.Array:
    """A per-device value as this device's block of a comm-mesh array: itself, stacked with
    the other devices' along its first axis (no copy); a scalar gets an axis of one."""
    return value[None] if value.ndim == 0 else value


def _from_block(block: jax.Array, var: Any) -> jax.Array:
    return block[0] if replay.is_var(var) and var.aval.ndim == 0 else block


class _Timeline:
    """Per call: when each stage was dispatched and when its outputs were ready."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.entries: list[tuple[Stage, float]] = []
        self.done: list[float] = []
        self.threads: list[threading.Thread] = []

    def add(self, stage: Stage, outputs: list) -> None:
        if not self.enabled:
            return
        k = len(self.entries)
        self.entries.append((stage, time.perf_counter() - self.t0))
        self.done.append(0.0)

        def wait() -> None:
            jax.block_until_ready(outputs)
            self.done[k] = time.perf_counter() - self.t0

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self.threads.append(thread)

    def finish(self) -> list[StageTiming]:
        for thread in self.threads:
            thread.join()
        timings: list[StageTiming] = []
        stream_free = {"compute": 0.0, "comm": 0.0}
        ready: dict[Any, float] = {}  # jaxpr variable -> when its value was ready
        for (stage, dispatched), done in zip(self.entries, self.done, strict=True):
            inputs_ready = max((ready.get(v, 0.0) for v in stage.inputs), default=0.0)
            started = min(done, max(dispatched, stream_free[stage.kind], inputs_ready))
            stream_free[stage.kind] = max(stream_free[stage.kind], done)
            ready.update((v, done) for v in stage.outputs)
            timings.append(StageTiming(stage.kind, stage.name, dispatched, started, done))
        return timings


register_engine("host", HostEngine)
