"""One process of ``jaxsched bench`` (`worker`), stage by stage.

`jaxsched.tools.bench.run` starts one per emulated host through the launcher. Each one:
pins itself to a core and joins the cluster (`_start_process`); builds the plain step, the
compute-only step (`_build_steps`) and the comm-only programs (`_comm_programs`);
measures the host engine's own costs (`_measure_host_costs`); chooses the batch
(`_choose_batch`); schedules every strategy (`_schedule_strategies`); warms every
variant up and times them interleaved step by step (`_Runner`, `_warm_up`,
`_timed_loop`); traces one step per strategy for the Gantt chart (`_trace_timelines`);
and, on process 0, writes the raw result (`_write_result`).

JAX is imported only after `_start_process`: the core pin and the device count must be
set before JAX starts.

Example (the variants timed, in the order they are interleaved):
    >>> _variants(["wfbp", "dear"])
    ['plain', 'compute', 'comm', 'comm_tree', 'ceiling', 'wfbp', 'dear']
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

from jaxsched._errors import JaxschedValueError
from jaxsched.tools._calibration import calibrate_batch

if TYPE_CHECKING:
    import jax
    import optax

    from jaxsched._schedule import Scheduled
    from jaxsched.runtime.compress import Compressor

__all__ = ["COMPRESSORS", "WorkerOptions", "parse_compression", "worker"]

COMPRESSORS = ("topk", "gtopk", "powersgd", "bf16")


class WorkerOptions(Protocol):
    """The ``jaxsched bench --worker`` options a worker reads (`jaxsched.tools.cli._cluster`)."""

    pin: bool  # pin this process to one core
    width: int  # of every layer of the tanh MLP
    depth: int  # layers
    batch: int | None  # rows per process; None: calibrated
    calibration_start: int
    calibration_tolerance: float
    calibration_probes: int
    strategies: Sequence[str]  # names, or ``name+compressor``
    buckets: int | list[list[str]] | None  # `jaxsched.schedule`'s ``buckets``
    steps: int  # timed steps per variant
    raw_out: str  # where process 0 writes the raw result


#: A jitted program of the benchmark: arrays (or trees of them) in, the same out.
Program = Callable[..., Any]
#: A batch of the benchmark: inputs and targets, sharded over the processes.
Batch = tuple["jax.Array", "jax.Array"]
#: A step's state: parameters and optimizer state.
State = tuple[Any, ...]


def parse_compression(text: str | None) -> Compressor | None:
    """``"topk:0.01"``, ``"gtopk:0.01"``, ``"powersgd:4"`` or ``"bf16"`` -> a compressor.

    Example:
        >>> type(parse_compression("topk:0.01")).__name__, parse_compression(None)
        ('TopK', None)
    """
    if not text:
        return None
    from jaxsched.runtime import compress

    kind, _, arg = text.partition(":")
    try:
        if kind == "topk":
            return compress.TopK(density=float(arg or 0.01))
        if kind == "gtopk":
            return compress.GlobalTopK(density=float(arg or 0.01))
        if kind == "powersgd":
            return compress.PowerSGD(rank=int(arg or 4))
        if kind == "bf16":
            import jax.numpy as jnp

            return compress.Cast(jnp.bfloat16)
    except ValueError as err:
        raise JaxschedValueError(f"--compression {text!r}: {err}") from None
    raise JaxschedValueError(f"--compression {text!r}: use one of {', '.join(COMPRESSORS)}, e.g. topk:0.01")


def _variants(strategies: Sequence[str]) -> list[str]:
    """Every variant timed: the references, then the scheduled strategies."""
    return ["plain", "compute", "comm", "comm_tree", "ceiling", *strategies]


class _Steps(NamedTuple):
    """The user's step and its compute-only twin, over one device per process.

    Attributes:
      mesh: one device per process, axis ``"data"``.
      params: the tanh MLP's parameters, ``layer{i}: {kernel, bias}``.
      tx: the optimizer (SGD with momentum).
      plain: the user's step (pmean after backward), ``(params, opt_state, batch)``.
      compute_only: the same step without the gradient reduction.
    """

    mesh: jax.sharding.Mesh
    params: dict[str, dict[str, jax.Array]]
    tx: optax.GradientTransformation
    plain: Program
    compute_only: Program


class _Comm(NamedTuple):
    """The comm-only programs and their gradient-sized inputs.

    Attributes:
      comm_only: one psum over the step's mesh.
      grads_like: one flat gradient-sized buffer.
      grads_tree: a gradient-shaped tree (the plain step's pmean reduces it leaf by leaf).
      spare_mesh: the spare device of every process.
      spare_comm: the psum on the spare devices (the ceiling's comm).
      spare_grads: its gradient-sized input.
      n_grads: number of gradient elements.
    """

    comm_only: Program
    grads_like: jax.Array
    grads_tree: Any
    spare_mesh: jax.sharding.Mesh
    spare_comm: Program
    spare_grads: jax.Array
    n_grads: int


def _start_process(args: WorkerOptions) -> None:
    """Pin this process to one core and join the cluster with two CPU devices."""
    import jaxsched.tools.launch

    if args.pin:  # before JAX starts its thread pools, so that every thread inherits the core
        rank = int(os.environ.get(jaxsched.tools.launch.ENV_PROCESS_ID, "0"))
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    jaxsched.tools.launch.initialize(cpu_devices=2)


def _build_steps(width: int, depth: int) -> _Steps:
    """The ``depth`` x ``width`` tanh MLP's plain and compute-only steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    nproc = jax.process_count()
    mesh_devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]
    mesh = jax.sharding.Mesh(np.array(mesh_devices), ("data",))
    keys = jax.random.split(jax.random.PRNGKey(0), depth)
    params = {
        f"layer{i}": {"kernel": jax.random.normal(keys[i], (width, width)) / width**0.5, "bias": jnp.zeros(width)}
        for i in range(depth)
    }
    tx = optax.sgd(1e-3, momentum=0.9)

    def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        for i in range(depth):  # named scopes: the host engine's stage names in the chart
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
        return jnp.mean((x - y) ** 2)

    def make(reduce: bool) -> Program:
        def body(p: Any, s: Any, batch: Batch) -> tuple[Any, Any, dict[str, jax.Array]]:
            loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
            if reduce:
                grads = lax.pmean(grads, "data")
            with jax.named_scope("update"):
                updates, s = tx.update(grads, s, p)
                p = optax.apply_updates(p, updates)
            return p, s, {"loss": lax.pmean(loss, "data")}

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        )

    return _Steps(mesh, params, tx, make(True), make(False))


def _psum_over(mesh: jax.sharding.Mesh) -> Program:
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    return jax.jit(
        jax.shard_map(
            lambda g: lax.psum(g, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False
        )
    )


def _comm_programs(steps: _Steps) -> _Comm:
    """The comm-only psum (flat and leaf by leaf) and the ceiling's psum on the spare devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsched.runtime.engine._host import spare_devices

    batch_sharding = NamedSharding(steps.mesh, P("data"))
    comm_only = _psum_over(steps.mesh)  # also takes the gradient-shaped tree (comm_tree below)
    n_grads = int(sum(np.size(leaf) for leaf in jax.tree.leaves(steps.params)))
    grads_like = jax.make_array_from_process_local_data(batch_sharding, np.ones((1, n_grads), np.float32))
    # The user's pmean reduces the gradient tree leaf by leaf (16 psums, half of them tiny):
    # on gloo that costs more than one psum of the same bytes, so it is measured too.
    grads_tree = jax.tree.map(
        lambda leaf: jax.make_array_from_process_local_data(batch_sharding, np.ones((1,) + leaf.shape, np.float32)),
        steps.params,
    )
    # The ceiling: compute-only and the psum on the spare devices, as raw programs dispatched
    # together. No schedule can beat it here: it is what the machine gives when both run at
    # once (gloo and the kernel's network work share each host's core with compute).
    spare_mesh = jax.sharding.Mesh(np.array(spare_devices(steps.mesh)), ("data",))
    spare_grads = jax.make_array_from_process_local_data(
        NamedSharding(spare_mesh, P("data")), np.ones((1, n_grads), np.float32)
    )
    return _Comm(comm_only, grads_like, grads_tree, spare_mesh, _psum_over(spare_mesh), spare_grads, n_grads)


def _batch_maker(steps: _Steps, width: int) -> Callable[[int, int], Batch]:
    """``batch_of(rows, seed)``: this process's random rows of a global batch."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    batch_sharding = NamedSharding(steps.mesh, P("data"))
    rank, nproc = jax.process_index(), jax.process_count()

    def batch_of(rows: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed * nproc + rank)
        x = rng.standard_normal((rows, width)).astype(np.float32)
        y = rng.standard_normal((rows, width)).astype(np.float32)
        return (
            jax.make_array_from_process_local_data(batch_sharding, x),
            jax.make_array_from_process_local_data(batch_sharding, y),
        )

    return batch_of


def _timed(fn: Program, *a: Any) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*a))
    return time.perf_counter() - start


def _median_time(fn: Program, *a: Any, repeats: int = 5) -> float:
    """Median of ``repeats`` runs, after one that compiles and warms up."""
    _timed(fn, *a)
    return statistics.median(_timed(fn, *a) for _ in range(repeats))


def _measure_host_costs(steps: _Steps, comm: _Comm) -> dict[str, Any]:
    """The host engine's own costs, for the simulator (`jaxsched.sim.HostCosts`): Python per
    collective stage, the copy of a gradient-sized buffer to this process's spare device,
    and a reduce-scatter then an all-gather of the gradient bytes (dear's pair)."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsched.runtime.engine._host import measure_stage_overhead

    rank, nproc = jax.process_index(), jax.process_count()
    _median_time(comm.comm_only, comm.grads_like)  # compile and warm the comm-only program
    stage_s = measure_stage_overhead(steps.mesh, "data")
    spare_device = next(d for d in comm.spare_mesh.devices.flat if d.process_index == rank)
    local_grads = comm.grads_like.addressable_data(0)
    copy_s = _median_time(lambda a: jax.device_put(a, spare_device), local_grads)
    # dear's pair: a reduce-scatter and an all-gather of the same bytes. On gloo they cost
    # more than one all-reduce, not the half each a ring model gives them.
    n_grads = comm.n_grads
    padded = -(-n_grads // nproc) * nproc
    rs_ag = jax.jit(
        jax.shard_map(
            lambda g: lax.all_gather(lax.psum_scatter(g[0], "data", tiled=True), "data", tiled=True)[None],
            mesh=steps.mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    padded_grads = jax.make_array_from_process_local_data(
        NamedSharding(steps.mesh, P("data")), np.ones((1, padded), np.float32)
    )
    rs_ag_s = _median_time(rs_ag, padded_grads)
    return {
        "stage_s": float(stage_s),
        "copy_s_per_byte": copy_s / (4 * n_grads),
        "reduce_scatter_all_gather_s": float(rs_ag_s),
        "source": "measured: jaxsched.runtime.engine._host.measure_stage_overhead; device_put of "
        f"{4 * n_grads} bytes to the spare device; a reduce-scatter then an "
        "all-gather of the gradient bytes",
    }


def _choose_batch(
    args: WorkerOptions, steps: _Steps, comm: _Comm, state0: State, batch_of: Callable[[int, int], Batch], lead: bool
) -> tuple[int, dict[str, Any]]:
    """``(rows per process, calibration record)``: ``args.batch``, or calibrated so that the
    compute-only step takes about as long as the comm-only psum (`calibrate_batch`)."""
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxsched.core._progress import note

    note(
        f"bench: calibrating the batch (compute-only close to comm-only, at most {args.calibration_probes} probes)"
        if args.batch is None
        else f"bench: batch {args.batch} per process",
        enabled=lead,
    )
    if args.batch is not None:
        return args.batch, {"explicit_batch": True, "batch": args.batch}

    def measure(probe: int) -> tuple[float, float]:
        # Every process must probe the same batches (the step's loss pmean is a collective):
        # all of them take rank 0's times, so they all choose the same next batch.
        compute_probe = _median_time(steps.compute_only, *state0, batch_of(probe, 0), repeats=3)
        comm_probe = _median_time(comm.comm_only, comm.grads_like, repeats=3)
        both = multihost_utils.broadcast_one_to_all(np.array([compute_probe, comm_probe]))
        return float(both[0]), float(both[1])

    cal = calibrate_batch(
        measure,
        args.calibration_start,
        tolerance=args.calibration_tolerance,
        max_probes=args.calibration_probes,
        multiple=8,
        max_batch=16384,
    )
    return cal.batch, cal.to_dict()


def _schedule_strategies(
    args: WorkerOptions, plain: Program, state0: State
) -> tuple[dict[str, Scheduled], dict[str, Any], list[str]]:
    """Every strategy of ``args.strategies`` (``name`` or ``name+compressor``) on the host
    engine: ``(scheduled steps, their initial states, names jaxsched does not know)``."""
    from jaxsched import _schedule

    scheds: dict[str, Scheduled] = {}
    states: dict[str, Any] = {}
    missing = []
    for name in args.strategies:
        base, _, compression = name.partition("+")
        if base not in _schedule.STRATEGIES:
            missing.append(name)
            continue
        sched = _schedule.schedule(
            plain, strategy=base, engine="host", buckets=args.buckets, compression=parse_compression(compression)
        )
        scheds[name] = sched
        states[name] = sched.init(*state0)
    return scheds, states, missing


class _Runner:
    """Runs one step of any variant, keeping each variant's state and the losses it reports."""

    def __init__(self, steps: _Steps, comm: _Comm, scheds: dict[str, Scheduled], states: dict[str, Any]) -> None:
        self.steps, self.comm, self.scheds = steps, comm, scheds
        self.states = dict(states)
        self.losses: dict[str, list[float]] = {name: [] for name in ["plain", *scheds]}

    def __call__(self, name: str, b: Batch) -> float:
        """Seconds one step of variant ``name`` took on batch ``b``."""
        import jax
        import numpy as np

        comm = self.comm
        start = time.perf_counter()
        if name == "comm":
            jax.block_until_ready(comm.comm_only(comm.grads_like))
            return time.perf_counter() - start
        if name == "comm_tree":
            jax.block_until_ready(comm.comm_only(comm.grads_tree))
            return time.perf_counter() - start
        if name == "ceiling":
            jax.block_until_ready(
                (comm.spare_comm(comm.spare_grads), self.steps.compute_only(*self.states["compute"], b))
            )
            return time.perf_counter() - start
        if name in self.scheds:
            new_state, aux = self.scheds[name](self.states[name], b)
        else:
            step = self.steps.plain if name == "plain" else self.steps.compute_only
            *outputs, aux = step(*self.states[name], b)
            new_state = tuple(outputs)
        jax.block_until_ready((new_state, aux))
        elapsed = time.perf_counter() - start
        self.states[name] = new_state
        if name in self.losses:
            self.losses[name].append(float(np.asarray(aux["loss"].addressable_data(0))))
        return elapsed


def _warm_up(run_one: _Runner, names: Sequence[str], batches: Sequence[Batch]) -> None:
    """Two untimed steps of every variant: compiled, caches and buffers warm."""
    for warm in range(2):
        for name in names:
            run_one(name, batches[warm % len(batches)])


def _timed_loop(
    run_one: _Runner, names: Sequence[str], batches: Sequence[Batch], steps: int, lead: bool
) -> dict[str, list[float]]:
    """``steps`` timed steps of every variant, interleaved step by step (machine drift hits
    every variant alike)."""
    from jaxsched.core._progress import progress

    times: dict[str, list[float]] = {name: [] for name in names}
    for step in progress(range(steps), "bench steps", enabled=lead, unit="step"):
        for name in names:
            times[name].append(run_one(name, batches[step % len(batches)]))
    return times


def _trace_timelines(
    args: WorkerOptions, plain: Program, names: Sequence[str], state0: State, batches: Sequence[Batch]
) -> dict[str, list[dict[str, Any]]]:
    """One traced step per strategy: its stage timestamps, for the Gantt chart."""
    import jax

    from jaxsched import _schedule
    from jaxsched.runtime.engine import HostEngine

    timelines = {}
    for name in names:
        base, _, compression = name.partition("+")
        traced = _schedule.schedule(
            plain,
            strategy=base,
            engine=HostEngine(record_timings=True),
            buckets=args.buckets,
            compression=parse_compression(compression),
        )
        st = traced.init(*state0)
        for b in batches[:3]:
            st, aux = traced(st, b)
            jax.block_until_ready(aux)
        timelines[name] = [
            dict(kind=t.kind, name=t.name, dispatched=t.dispatched, started=t.started, done=t.done)
            for t in traced.program.core.timings[-1]  # type: ignore[attr-defined]  # the host engine's staged program
        ]
    return timelines


def _write_result(path: str, result: dict[str, Any]) -> None:
    """The raw result as JSON (process 0 only), read back by `jaxsched.tools.bench.run`."""
    Path(path).write_text(json.dumps(result))


def worker(args: WorkerOptions) -> int:
    """One process of the benchmark (started by `jaxsched.tools.bench.run` through the launcher).

    Args:
      args: the ``jaxsched bench --worker`` options (`jaxsched.tools.cli._cluster`).

    Returns:
      The exit status, 0; process 0 writes the raw result to ``args.raw_out``.
    """
    _start_process(args)
    import jax
    import numpy as np

    rank = jax.process_index()
    lead = rank == 0 and not getattr(args, "no_progress", False)
    steps = _build_steps(args.width, args.depth)
    comm = _comm_programs(steps)
    batch_of = _batch_maker(steps, args.width)
    state0 = (steps.params, steps.tx.init(steps.params))
    host_costs = _measure_host_costs(steps, comm)
    rows, calibration = _choose_batch(args, steps, comm, state0, batch_of, lead)
    batches = [batch_of(rows, s) for s in range(4)]

    scheds, states, missing = _schedule_strategies(args, steps.plain, state0)
    run_one = _Runner(steps, comm, scheds, {"plain": state0, "compute": state0, **states})
    names = _variants(list(scheds))
    _warm_up(run_one, names, batches)
    from jaxsched.core._progress import note

    note(f"bench: batch {rows}; {args.steps} measured steps of {len(names)} variants, interleaved", enabled=lead)
    times = _timed_loop(run_one, names, batches, args.steps, lead)
    timelines = _trace_timelines(args, steps.plain, list(scheds), state0, batches)
    if rank == 0:
        _write_result(
            args.raw_out,
            {
                "processes": jax.process_count(),
                "batch_per_process": rows,
                "steps": args.steps,
                "calibration": calibration,
                "host_costs": host_costs,
                "step_s_all": times,
                "median_s": {k: statistics.median(v) for k, v in times.items()},
                "losses": run_one.losses,
                "timelines": timelines,
                "missing": missing,
                "layers": {
                    "width": args.width,
                    "depth": args.depth,
                    "params": int(sum(np.size(leaf) for leaf in jax.tree.leaves(steps.params))),
                },
            },
        )
    return 0
