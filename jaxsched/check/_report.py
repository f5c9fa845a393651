"""A compiled program's collectives and XLA's schedule estimate for it (`report`).

The steps: parse the scheduled HLO; pair each collective's start with its done (or find
it synchronous); match each to its window in XLA's schedule; read its size, mesh axes
and the compute inside its window; add up the schedule's step and exposed communication,
while loops counted for every iteration.

>>> TEXT = '''
... ENTRY %main (p: f32[256]) -> f32[256] {
...   %p = f32[256]{0} parameter(0)
...   ROOT %ar = f32[256]{0} all-reduce(%p), replica_groups={}, to_apply=%add
... }'''
>>> r = report(TEXT, None, None, label="x")
>>> [(w.kind, w.bytes, w.is_async) for w in r.collectives], r.platform, r.step_s
([('all-reduce', 1024, False)], 'cpu', None)
"""

from __future__ import annotations

import math
import re
import statistics
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple

from jax.sharding import Mesh

from jaxsched.check._hlo_ops import _COLLECTIVES, _Analyzer, _find_start
from jaxsched.check._hlo_text import (
    _dtype_bits,
    _Instr,
    _mesh_axes,
    MeshLike,
    _Module,
    _parse_hlo,
    _replica_groups,
    _shape_bytes,
    _shape_leaves,
)
from jaxsched.check._loops import _known_trips, _live_gathered, _loop_costs, _while_body
from jaxsched.check._schedule_proto import _parse_schedule, _Schedule
from jaxsched.check._compiled_report import ESTIMATE_FROM_SCHEDULE, CollectiveWindow, CompiledReport, LoopCost
from jaxsched.check._compiling import CompilerOption
from jaxsched.check._probe import _probe_collective
from jaxsched.runtime.engine._base import platform_family
from jaxsched.sim import _intervals as intervals

if TYPE_CHECKING:
    from jax.stages import Compiled

__all__ = ["report"]


def _platform(text: str, mesh: MeshLike | None) -> str:
    if isinstance(mesh, Mesh):
        return platform_family(mesh.devices.flat[0].platform)
    if ":T(" in text or "AsyncCollective" in text or "megacore" in text:
        return "tpu"
    if "operation_queue_id" in text or "__cublas" in text or "gemm_fusion" in text:
        return "gpu"
    return "cpu"


class _Pair(NamedTuple):
    """A collective of the final program: its start (or the synchronous op) and its done."""

    start: _Instr
    done: _Instr | None
    kind: str
    is_async: bool


class _Entry(NamedTuple):
    """The ENTRY computation, read once: program order, instructions by name, each one's role."""

    mod: _Module
    an: _Analyzer
    order: list[_Instr]
    by_name: dict[str, _Instr]
    roles: dict[str, tuple[str, str]]
    pos: dict[str, int]


def _read_entry(text: str) -> _Entry:
    mod = _parse_hlo(text)
    an = _Analyzer(mod)
    order = mod.computations[mod.entry]
    return _Entry(
        mod,
        an,
        order,
        {i.name: i for i in order},
        {i.name: an.role(i) for i in order},
        {i.name: k for k, i in enumerate(order)},
    )


def _done_of(entry: _Entry) -> dict[str, _Instr]:
    """Each start's done op, by the start's name (the first done that completes it)."""
    done_of: dict[str, _Instr] = {}
    for ins in entry.order:
        if entry.roles[ins.name][0] == "done":
            st = _find_start(ins, entry.by_name, entry.an, entry.roles)
            if st is not None and st.name not in done_of:
                done_of[st.name] = ins
    return done_of


def _pairs(entry: _Entry) -> list[_Pair]:
    """Start/done pairs and synchronous collectives of the final program, in program order."""
    done_of = _done_of(entry)
    items = []
    for ins in entry.order:
        role, kind = entry.roles[ins.name]
        if role == "sync":
            items.append(_Pair(ins, None, kind, False))
        elif role == "start":
            done = done_of.get(ins.name)
            if done is None:
                continue
            cfg = ins.attrs + done.attrs
            is_async = not re.search(r'"is_sync"\s*:\s*true', cfg)
            if ins.opcode == "async-start":
                inner = entry.an.called_info(ins)[1]
                if inner is not None and re.search(r'"is_sync"\s*:\s*true', inner.attrs):
                    is_async = False
            items.append(_Pair(ins, done, kind or entry.roles[done.name][1], is_async))
    return items


def _schedule_pairs(sched: _Schedule) -> list[tuple[int, int, str]]:
    """``(start index, done index, kind)`` of the schedule's collectives, in schedule order."""
    starts = {
        o.name: k
        for k, o in enumerate(sched.ops)
        if o.kind and (o.opcode.endswith("-start") or o.opcode in ("send", "recv"))
    }
    pairs = [
        (starts[o.operand0], k, sched.ops[starts[o.operand0]].kind)
        for k, o in enumerate(sched.ops)
        if o.kind and o.opcode.endswith("-done") and o.operand0 in starts
    ]
    return sorted(pairs)


def _match_windows(items: list[_Pair], sched: _Schedule) -> list[tuple[int, int] | None]:
    """Each collective's ``(start, done)`` indices in the schedule (None where not found).

    By name first; then (TPU, whose schedule predates its async collective fusions) by
    kind and first operand; then by kind in program order."""
    s_index = {o.name: k for k, o in enumerate(sched.ops)}
    s_pairs = _schedule_pairs(sched)
    s_done_of = {a: b for a, b, _ in s_pairs}
    claimed: set[int] = set()

    def by_name(ins: _Instr, done: _Instr | None) -> tuple[int, int] | None:
        if ins.name in s_index:
            a = s_index[ins.name]
            b = s_index.get(done.name, s_done_of.get(a, a)) if done is not None else s_done_of.get(a, a)
            claimed.add(a)
            return a, b
        m = re.search(r'async_collective_name="([^"]*)"', ins.attrs)
        if m and m.group(1) in s_index:
            a = s_index[m.group(1)]
            claimed.add(a)
            return a, s_done_of.get(a, a)
        return None

    windows = [by_name(item.start, item.done) for item in items]
    for same_operand in (True, False):
        for n, item in enumerate(items):
            if windows[n] is not None:
                continue
            for a, b, k in s_pairs:
                if a in claimed or k != item.kind:
                    continue
                if same_operand and (not item.start.operands or sched.ops[a].operand0 != item.start.operands[0]):
                    continue
                claimed.add(a)
                windows[n] = (a, b)
                break
    return windows


def _payload_bytes(item: _Pair) -> int:
    """Bytes per device a collective moves (its result)."""
    if item.kind == "send":  # send-done is a token: the payload is the send's first element
        leaves = _shape_leaves(item.start.shape)
        return math.prod(leaves[0][1]) * _dtype_bits(leaves[0][0]) // 8 if leaves else 0
    return _shape_bytes(item.done.shape if item.done is not None else item.start.shape)


def _groups_source(ins: _Instr, entry: _Entry) -> _Instr:
    """The instruction whose attributes hold a collective's replica groups (the collective
    inside an async wrapper or a collective fusion)."""
    if ins.opcode in ("fusion", "custom-call", "async-start"):
        return entry.an.called_info(ins)[1] or ins
    return ins


def _window(
    item: _Pair, win: tuple[int, int] | None, entry: _Entry, sched: _Schedule | None, mesh: MeshLike | None
) -> CollectiveWindow:
    """One collective's report: size, mesh axes, compute in its window (program and schedule)."""
    ins, done = item.start, item.done
    axes = _mesh_axes(_replica_groups(_groups_source(ins, entry).attrs), mesh)
    ops, flops = 0, 0.0
    if item.is_async and done is not None:
        for mid in entry.order[entry.pos[ins.name] + 1 : entry.pos[done.name]]:
            if entry.roles[mid.name][0] == "compute":
                ops += 1
                flops += entry.an.flops(mid, entry.mod.entry)
    start_s = end_s = compute_s = None
    if win is not None and sched is not None:
        a, b = win
        start_s = sched.seconds(sched.ops[a].start)
        end_s = sched.seconds(sched.ops[b].end)
        compute_s = 0.0
        if item.is_async:
            compute_s = sched.seconds(sum(o.end - o.start for o in sched.ops[a + 1 : b] if o.compute))
    return CollectiveWindow(
        ins.name,
        item.kind,
        int(_payload_bytes(item)),
        axes,
        bool(item.is_async),
        ops,
        float(flops),
        start_s,
        end_s,
        compute_s,
    )


class _Totals(NamedTuple):
    """What the schedule says of the whole program (all None/empty without a schedule)."""

    step_s: float | None = None
    exposed_s: float | None = None
    xla_total_s: float | None = None
    xla_wasted_s: float | None = None
    compute: tuple[tuple[str, float, float], ...] = ()
    loops: tuple[LoopCost, ...] = ()
    peak_gathered_bytes: int | None = None
    made_sync_s: float = 0.0


#: ``(kind, bytes, mesh axes) -> seconds``: a collective's time alone (None: unknown).
CollectiveSeconds = Callable[[str, int, tuple[str, ...]], "float | None"]


def _overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def _made_synchronous(windows: list[CollectiveWindow], compute: list[tuple[float, float]]) -> list[bool]:
    """Which collectives the final program runs synchronously although XLA's schedule put
    compute in their window: XLA:TPU schedules before forming its async collective fusions
    and runs a collective it could not fuse synchronously, in place. Its window is the
    overlap the scheduler planned, not what the program does."""
    return [
        not w.is_async and w.start_s is not None and w.end_s is not None and _overlap(w.start_s, w.end_s, compute) > 0
        for w in windows
    ]


def _priced(price: CollectiveSeconds, kind: str, nbytes: int, attrs: str, mesh: MeshLike | None) -> float | None:
    """``price`` for a collective whose replica groups (from ``attrs``) may span only part of
    its mesh axes (XLA:TPU's two-stage reduce-scatter: a line of chips, then a plane): priced
    over the whole axes at the size that moves as many bytes per device in a ring."""
    groups = _replica_groups(attrs)
    axes = _mesh_axes(groups, mesh)
    if mesh is None or not axes or not groups:
        return price(kind, nbytes, axes)
    n = math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in axes)
    g = len(groups[0])
    if g <= 1:
        return 0.0
    if g != n:
        nbytes = int(nbytes * (g - 1) / (n - 1) if kind == "reduce-scatter" else nbytes * (g - 1) / g * n / (n - 1))
    return price(kind, max(nbytes, 1), axes)


def _own_seconds(
    windows: list[CollectiveWindow],
    made_sync: list[bool],
    group_attrs: list[str],
    mesh: MeshLike | None,
    price: CollectiveSeconds | None,
) -> list[float | None]:
    """What each collective made synchronous after scheduling costs alone: ``price``'s
    time, else the median window of the same collective (kind and bytes) the schedule
    already ran synchronously, else None (its whole window is charged)."""
    twins: dict[tuple[str, int], list[float]] = {}
    for w, made in zip(windows, made_sync):
        if not made and not w.is_async and w.start_s is not None and w.end_s is not None:
            twins.setdefault((w.kind, w.bytes), []).append(w.end_s - w.start_s)
    out: list[float | None] = []
    for w, made, attrs in zip(windows, made_sync, group_attrs):
        seconds = None
        if made:
            seconds = _priced(price, w.kind, w.bytes, attrs, mesh) if price is not None else None
            if seconds is None and (w.kind, w.bytes) in twins:
                seconds = statistics.median(twins[(w.kind, w.bytes)])
        out.append(seconds)
    return out


_MADE_SYNC_RE = re.compile(r'async_collective_name="')


def _made_sync_inside(mod: _Module, comp: str | None, depth: int = 0) -> bool:
    """Whether computation ``comp`` (a loop body), or a loop nested in it, runs a collective
    that XLA:TPU scheduled async and then ran synchronously (``async_collective_name``)."""
    for ins in mod.computations.get(comp or "", []):
        if ins.opcode in _COLLECTIVES and _MADE_SYNC_RE.search(ins.attrs):
            return True
        if ins.opcode == "while" and depth < 8 and _made_sync_inside(mod, _while_body(ins), depth + 1):
            return True
    return False


def _trips(
    ins: _Instr, body: str, sched: _Schedule | None, outer: _Schedule | None, mod: _Module, comp: str
) -> int | None:
    """A while loop's trip count: XLA's ``known_trip_count`` where the final program keeps
    it, or the scan's counter and bound (`_known_trips`), else (XLA:TPU drops both) the
    loop's time in the enclosing schedule over its body's."""
    known = _known_trips(ins, mod, comp)
    if known is not None:
        return known
    inner = sched.others.get(body) if sched is not None else None
    if inner is None or outer is None or not inner.ops:
        return None
    mine = [o for o in outer.ops if o.name == ins.name]
    per_trip = inner.totals()[0]
    if not mine or per_trip <= 0:
        return None
    ratio = outer.seconds(mine[0].end - mine[0].start) / per_trip
    return round(ratio) if ratio >= 0.5 and abs(ratio - round(ratio)) < 0.05 * ratio else None


def _made_sync_in_loops(
    mod: _Module,
    comp: str,
    sched: _Schedule,
    outer: _Schedule | None,
    mesh: MeshLike | None,
    price: CollectiveSeconds | None,
    depth: int = 0,
) -> float:
    """The own time, every iteration counted, of the collectives that the while-loop bodies
    of ``comp`` (scheduled as ``outer``) run synchronously although XLA scheduled them
    async: XLA:TPU marks each with the async collective it was (``async_collective_name``),
    and its schedule of the body, which prices the loop, hides it beside compute."""
    if price is None or depth > 8:
        return 0.0
    total = 0.0
    for ins in mod.computations.get(comp, []):
        if ins.opcode != "while":
            continue
        body = _while_body(ins)
        if body is None:
            continue
        trips = _trips(ins, body, sched, outer, mod, comp)
        if trips is None:
            continue
        per_trip = _made_sync_in_loops(mod, body, sched, sched.others.get(body), mesh, price, depth + 1)
        for b in mod.computations.get(body, []):
            if b.opcode in _COLLECTIVES and _MADE_SYNC_RE.search(b.attrs):
                per_trip += _priced(price, b.opcode, int(_shape_bytes(b.shape)), b.attrs, mesh) or 0.0
        total += trips * per_trip
    return total


def _exposed(windows: list[CollectiveWindow], sched: _Schedule, own: list[float | None]) -> float:
    """Time with a collective in flight and no compute running. A collective the final
    program runs synchronously hides nothing: where the schedule ran it so, its window;
    where the schedule (on TPU made before the async fusions) had planned compute in its
    window, its own time (``own``) added on top, or without one its whole window."""
    hidden_by = [(sched.seconds(o.start), sched.seconds(o.end)) for o in sched.ops if o.compute]
    parts: list[tuple[float, float]] = []
    serial = 0.0
    for w, seconds in zip(windows, own):
        if w.start_s is None or w.end_s is None:
            continue
        if w.is_async:
            parts += intervals.subtract([(w.start_s, w.end_s)], hidden_by)
        elif seconds is not None:
            serial += seconds
        else:
            parts.append((w.start_s, w.end_s))
    return intervals.total(intervals.union(parts)) + serial


def _totals(
    mod: _Module,
    sched: _Schedule,
    windows: list[CollectiveWindow],
    group_attrs: list[str],
    mesh: MeshLike | None,
    price: CollectiveSeconds | None,
) -> _Totals:
    """The schedule's step and exposed communication, while loops counted per iteration, and
    the collectives made synchronous after scheduling added to both."""
    step_s = exposed = None
    made_sync_s = 0.0
    total = sched.seconds(sched.step_cycles) if sched.step_cycles is not None else None
    wasted = sched.seconds(sched.wasted_cycles) if sched.wasted_cycles is not None else None
    compute = tuple((o.name, sched.seconds(o.start), sched.seconds(o.end)) for o in sched.ops if o.compute)
    if sched.ops:
        step_s = sched.seconds(max(o.end for o in sched.ops) - min(o.start for o in sched.ops))
        spans = [(sched.seconds(o.start), sched.seconds(o.end)) for o in sched.ops if o.compute]
        made_sync = _own_seconds(windows, _made_synchronous(windows, spans), group_attrs, mesh, price)
        in_loops = _made_sync_in_loops(mod, mod.entry, sched, sched, mesh, price)
        made_sync_s = sum(seconds for seconds in made_sync if seconds is not None) + in_loops
        exposed = _exposed(windows, sched, made_sync) + in_loops
        step_s += made_sync_s
    loops = tuple(_loop_costs(mod, mod.entry, sched))
    gathered = [_live_gathered(mod, mod.entry, sched)]
    gathered += [_live_gathered(mod, comp, body) for comp, body in sched.others.items()]
    if loops and step_s is not None and exposed is not None:
        # a loop counts in the entry's schedule as one instruction; its iterations as
        # many times its body's own schedule
        own = {o.name: sched.seconds(o.end - o.start) for o in sched.ops}
        step_s += sum(loop.seconds - own.get(loop.name, 0.0) for loop in loops)
        # a loop whose collectives XLA:TPU ran synchronously counts them whole, above
        # (`_made_sync_in_loops`), not also as the exposure its body's schedule planned
        bodies = {i.name: _while_body(i) for i in mod.computations.get(mod.entry, []) if i.opcode == "while"}
        exposed += sum(loop.exposed_s for loop in loops if not _made_sync_inside(mod, bodies.get(loop.name)))
    return _Totals(step_s, exposed, total, wasted, compute, loops, max(g[0] for g in gathered), made_sync_s)


def _text_of(compiled_or_hlo_text: Compiled | str) -> str:
    """The scheduled HLO text of a compiled program ("" where the backend prints none)."""
    if isinstance(compiled_or_hlo_text, str):
        return compiled_or_hlo_text
    return compiled_or_hlo_text.as_text() or ""


def report(
    compiled_or_hlo_text: Compiled | str,
    schedule_text: str | None,
    mesh: MeshLike | None = None,
    *,
    label: str,
    target: str = "",
    compiler_options: Mapping[str, CompilerOption] | None = None,
    collective_seconds: CollectiveSeconds | None = None,
) -> CompiledReport:
    """Collectives of a compiled program and XLA's schedule estimate for it.

    XLA:TPU schedules before it forms its async collective fusions, and runs a collective
    it could not fuse synchronously where the schedule had planned compute beside it. Such
    a collective is charged its own time, to the step and to the exposed communication:
    ``collective_seconds``'s, by default (on TPU) XLA's time for that collective compiled
    alone on ``mesh``'s devices (one compile per kind, size and axes), else the window of a
    twin the schedule ran synchronously, else its whole planned window.

    Args:
      compiled_or_hlo_text: a ``jax.stages.Compiled`` or its ``as_text()`` (scheduled HLO).
      schedule_text: from `compile_with_schedule` (None: no times).
      mesh: a ``Mesh`` or ``AbstractMesh`` that maps replica groups (logical ids =
        positions in ``mesh.devices.flat``) to axis names; None gives ``mesh_axes=()``.
      label: the report's name.
      target: what the program was compiled for (`describe_mesh`).
      compiler_options: what the program was compiled with, kept in the report (None:
        XLA's defaults).
      collective_seconds: ``(kind, bytes, axes) -> seconds or None``, a collective's time
        alone (None: XLA's, compiled on ``mesh`` where it is a ``Mesh`` of TPUs); one over
        part of its axes is asked for at the size that moves as many bytes per device in a
        ring over the whole axes.

    Returns:
      The `CompiledReport`. Without a schedule it has no times;
      `estimate_from_instruction_costs` adds an estimate where XLA costs each instruction.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jaxsched import check
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P("data")))
      >>> compiled = jax.jit(lambda x: x.sum(0)).trace(x).lower().compile()
      >>> r = check.report(compiled, None, mesh, label="sum")
      >>> [(w.kind, w.mesh_axes, w.is_async) for w in r.collectives], r.step_s
      ([('all-reduce', ('data',), False)], None)
    """
    text = _text_of(compiled_or_hlo_text)
    entry = _read_entry(text)
    sched = _parse_schedule(schedule_text) if schedule_text else None
    items = _pairs(entry)
    matched = _match_windows(items, sched) if sched is not None else [None] * len(items)
    windows = [_window(item, win, entry, sched, mesh) for item, win in zip(items, matched)]
    price = collective_seconds
    if price is None and isinstance(mesh, Mesh) and _platform(text, mesh) == "tpu":
        price = _alone(mesh)
    group_attrs = [_groups_source(item.start, entry).attrs for item in items]
    totals = _totals(entry.mod, sched, windows, group_attrs, mesh, price) if sched is not None else _Totals()
    return CompiledReport(
        label,
        target,
        _platform(text, mesh),
        totals.step_s,
        totals.exposed_s,
        tuple(windows),
        totals.compute,
        xla_total_s=totals.xla_total_s,
        xla_wasted_s=totals.xla_wasted_s,
        loops=totals.loops,
        peak_gathered_bytes=totals.peak_gathered_bytes,
        peak_memory_bytes=None if isinstance(compiled_or_hlo_text, str) else _peak_memory(compiled_or_hlo_text),
        estimate_source=ESTIMATE_FROM_SCHEDULE if totals.step_s is not None else None,
        compiler_options=dict(compiler_options or {}),
        made_sync_s=totals.made_sync_s,
    )


def _alone(mesh: Mesh) -> CollectiveSeconds:
    """XLA's time for a collective compiled alone on ``mesh`` (`_estimate`'s probe)."""

    def seconds(kind: str, nbytes: int, axes: tuple[str, ...]) -> float | None:
        return _probe_collective(mesh, kind, nbytes, axes)[0] if axes else None

    return seconds


def _peak_memory(compiled: Compiled) -> int | None:
    """Per-device peak from XLA's memory analysis: arguments, outputs and temporaries, less
    what outputs alias (donated arguments)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # backends without the analysis
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
