"""XLA's time for one collective compiled alone (`_probe_collective`): how the estimates
price a collective that XLA did not schedule beside compute.

XLA:TPU writes a schedule only for a program with asynchronous collectives, so each probe is
one collective of the given kind, size and mesh axes compiled with the engine's TPU options;
its time is the collective's window in that schedule.

>>> import jax
>>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
>>> _probe_collective(mesh, "all-reduce", 1 << 20, ("data",))  # XLA:CPU writes no schedule
(None, None)
"""

from __future__ import annotations

import math

from jax.sharding import Mesh

from jaxsched.check._compiling import compile_with_schedule
from jaxsched.check._schedule_proto import _parse_schedule

#: Probed ``(seconds, cycles_per_us)`` by ``(mesh, kind, bytes, axes)``: one compile each per process.
_PROBES: dict[tuple[Mesh, str, int, tuple[str, ...]], tuple[float | None, float | None]] = {}
_PROBE_MIN_BYTES = 4096
#: the largest collective priced as a larger one where XLA keeps it synchronous
_PROBE_MAX_SMALL_BYTES = 1 << 20


def _probe_collective(mesh: Mesh, kind: str, nbytes: int, axes: tuple[str, ...]) -> tuple[float | None, float | None]:
    """``(seconds, cycles_per_us)``: XLA's latency-hiding scheduler's time for one ``kind``
    collective of ``nbytes`` per device (its result) over ``axes`` of ``mesh``, compiled
    alone as one flat float32 array with the engine's TPU options (XLA writes a schedule
    only for a program with asynchronous collectives), and the clock that schedule counts
    cycles in. ``(None, None)`` where it cannot be compiled or timed. Cached per mesh.

    XLA:TPU keeps an all-reduce of less than 4 KiB synchronous even with those options (no
    schedule; measured on v5p): a smaller collective is priced as one of 4 KiB, about
    0.03 us there. Other small collectives it keeps synchronous (a 10 KiB all-gather on
    v5p) are priced as the smallest larger one it makes async, up to 1 MiB."""
    key = (mesh, kind, int(nbytes), tuple(axes))
    if key in _PROBES:
        return _PROBES[key]
    result: tuple[float | None, float | None] = (None, None)
    try:
        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jaxsched.runtime.engine._xla import TPU_OPTIONS

        n = math.prod(mesh.shape[a] for a in axes)
        axis = axes[0] if len(axes) == 1 else tuple(axes)
        elems = max(_PROBE_MIN_BYTES, int(nbytes)) // 4 + (int(nbytes) % 4 > 0)
        if kind == "all-reduce":
            shape, in_spec, out_spec, body = (elems,), P(), P(), lambda x: lax.psum(x, axis)
        elif kind == "all-gather":
            shape, in_spec, out_spec = (-(-elems // n) * n,), P(axis), P()
            body = lambda x: lax.all_gather(x, axis, tiled=True)
        elif kind == "reduce-scatter":
            shape, in_spec, out_spec = (elems * n,), P(), P(axis)
            body = lambda x: lax.psum_scatter(x, axis, tiled=True)
        elif kind == "all-to-all":
            shape, in_spec, out_spec = (-(-elems // n) * n * n,), P(axis), P(axis)
            body = lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)
        elif kind == "collective-permute" and len(axes) == 1:
            shape, in_spec, out_spec = (elems,), P(), P()
            body = lambda x: lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
        else:
            _PROBES[key] = result
            return result
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec, check_vma=False))
        arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, in_spec))
        compiled, schedule = compile_with_schedule(fn.trace(arg).lower(), TPU_OPTIONS)
        sched = _parse_schedule(schedule) if schedule else None
        if sched is not None:
            spans = [end - start for k, start, end in sched.windows() if k == kind]
            if spans:
                result = (max(spans), sched.cycles_per_us)
    except Exception:  # a collective this probe cannot build or XLA cannot compile
        result = (None, None)
    if result[0] is None and kind == "reduce-scatter":
        # XLA:TPU decomposes a reduce-scatter over a 3-D block of chips into an all-reduce
        # (no reduce-scatter to read): priced as half an all-reduce of its input, the
        # traffic of a ring reduce-scatter
        n = math.prod(mesh.shape[a] for a in axes)
        whole, clock = _probe_collective(mesh, "all-reduce", int(nbytes) * n, axes)
        result = (None if whole is None else whole / 2, clock)
    if result[0] is None and kind == "all-to-all":
        # XLA:TPU runs an all-to-all synchronously (no window to read): priced as the
        # all-gather whose result is as large, which moves the same (n-1)/n of it per device
        result = _probe_collective(mesh, "all-gather", int(nbytes), axes)
    if result[0] is None and _PROBE_MIN_BYTES <= nbytes < _PROBE_MAX_SMALL_BYTES:
        # XLA:TPU keeps small collectives synchronous (no schedule to read): priced as
        # the smallest larger one it makes async, an upper bound
        result = _probe_collective(mesh, kind, max(4 * int(nbytes), 64 * 1024), axes)
    _PROBES[key] = result
    return result
