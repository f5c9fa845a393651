"""Where re-planning's measurements come from: the host engine's own collective stages
(timed through `jaxsched.runtime.engine._base.Engine.stage_timer`), or small probe
collectives on the step's mesh (any engine).

Example:
    >>> STAGE_COLLECTIVES["psum"], STAGE_MIN_BYTES
    ('all_reduce', 65536)
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxsched.runtime.engine._base import Stage, StageTiming

__all__ = [
    "probe",
    "probe_programs",
    "STAGE_COLLECTIVES",
    "STAGE_MIN_BYTES",
    "stage_bytes",
    "stage_samples",
    "stage_threshold",
]


#: collective primitives of a communication stage, as the cost model names them
STAGE_COLLECTIVES = {
    "psum": "all_reduce",
    "psum_invariant": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "psum_scatter": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
}


#: collectives smaller than this are left out of the stage monitor when larger ones exist
STAGE_MIN_BYTES = 1 << 16


def stage_bytes(stage: Stage) -> int:
    """Bytes the collective of a communication stage sends (its operands)."""
    eqn = stage.eqns[-1]
    return sum(
        int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
        for v in eqn.invars
        if hasattr(v, "aval") and hasattr(v.aval, "shape")
    )


def stage_threshold(stages: Sequence[Stage]) -> int:
    """The smallest collective the stage monitor reads: `STAGE_MIN_BYTES`, or the
    largest collective's size when none is that large (a small model)."""
    sizes = [stage_bytes(s) for s in stages if s.kind == "comm" and s.eqns[-1].primitive.name in STAGE_COLLECTIVES]
    return min(STAGE_MIN_BYTES, max(sizes, default=STAGE_MIN_BYTES))


def stage_samples(
    stages: Sequence[Stage], timings: Sequence[StageTiming], min_bytes: int = STAGE_MIN_BYTES
) -> dict[str, dict[int, list[float]]]:
    """Seconds each large collective of one staged step took (``done - started`` of its
    stage, `jaxsched.runtime.engine._host.StageTiming`), per collective and bytes. Collectives
    smaller than ``min_bytes`` are left out: their time is mostly start-up and the timing
    thread's wake-up, not the network's bandwidth (a loss's pmean, packed biases)."""
    out: dict[str, dict[int, list[float]]] = {}
    for stage, timing in zip(stages, timings, strict=True):
        if stage.kind != "comm":
            continue
        name = STAGE_COLLECTIVES.get(stage.eqns[-1].primitive.name)
        nbytes = stage_bytes(stage)
        seconds = timing.done - timing.started
        if name is None or nbytes < min_bytes or seconds <= 0:  # 0: no resolution, no sample
            continue
        out.setdefault(name, {}).setdefault(nbytes, []).append(seconds)
    return out


def probe_programs(
    mesh: Mesh, axis: str | tuple[str, ...], names: Sequence[str]
) -> dict[str, Callable[[jax.Array], jax.Array]]:
    """Jitted collectives on ``mesh`` over ``axis`` (a name or tuple of names), one per name."""
    from jax.sharding import PartitionSpec as P

    bodies = {
        "all_reduce": lambda x: jax.lax.psum(x, axis),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x[0], axis, tiled=True)[None],
        "all_gather": lambda x: jax.lax.all_gather(x[0], axis, tiled=True)[None],
    }
    return {
        n: jax.jit(jax.shard_map(bodies[n], mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))
        for n in names
        if n in bodies
    }


def probe(
    programs: Mapping[str, Callable[[jax.Array], jax.Array]],
    mesh: Mesh,
    axis: str | tuple[str, ...],
    workers: int,
    sizes: Sequence[int],
    repeats: int,
    warm: bool = True,
) -> dict[str, dict[int, list[float]]]:
    """Seconds of each probe collective at each size (full-tensor bytes), ``repeats`` each,
    after one untimed call when ``warm`` (the first time: compiles it). Every process must
    call it at the same step (they are collectives)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P(axis))
    out: dict[str, dict[int, list[float]]] = {}
    for name, program in programs.items():
        out[name] = {}
        for size in sizes:
            elements = max(workers, size // 4 // workers * workers)
            shape = (workers, elements // workers) if name == "all_gather" else (workers, elements)
            host = np.ones(shape, np.float32)
            x = jax.make_array_from_callback(shape, sharding, host.__getitem__)
            if warm:
                jax.block_until_ready(program(x))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(program(x))
                times.append(time.perf_counter() - start)
            out[name][elements * 4] = times
    return out
