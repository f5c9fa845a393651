"""An estimated step where XLA wrote no schedule, from XLA's cost of each instruction.

XLA:TPU on one slice with its default options runs no latency-hiding scheduler, but it
writes its cost of every fusion into the compiled HLO; `estimate_from_instruction_costs`
adds those up and prices each collective on a program of that collective alone.

>>> from jaxsched.check._report import report
>>> TEXT = '''
... ENTRY %main (p: f32[256]) -> f32[256] {
...   %p = f32[256]{0} parameter(0)
...   %f = f32[256]{0} fusion(%p), kind=kLoop, calls=%c, backend_config={"estimated_cycles":"1000"}
...   ROOT %ar = f32[256]{0} all-reduce(%f), replica_groups={}, to_apply=%add
... }'''
>>> from jax.sharding import AbstractMesh
>>> mesh = AbstractMesh((4,), ("data",))
>>> r = estimate_from_instruction_costs(report(TEXT, None, mesh, label="x"), TEXT, mesh,
...     cycles_per_us=1000.0, collective_seconds=lambda kind, nbytes, axes: 2e-6)
>>> r.collectives[0].mesh_axes, round(r.step_s * 1e6, 3), r.estimate_source  # 1 us compute, 2 us comm
(('data',), 3.0, 'instruction costs')
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Callable

from jax.sharding import Mesh

from jaxsched.check._hlo_ops import _Analyzer
from jaxsched.check._hlo_text import MeshLike, _dtype_bits, _Module, _parse_hlo, _shape_bytes, _shape_leaves
from jaxsched.check._loops import _known_trips, _while_body
from jaxsched.check._compiled_report import ESTIMATE_FROM_INSTRUCTIONS, CompiledReport
from jaxsched.check._probe import _PROBE_MIN_BYTES, _probe_collective
from jaxsched.check._report import _done_of, _Entry, _groups_source, _priced, _read_entry, _text_of

if TYPE_CHECKING:
    from jax.stages import Compiled

__all__ = ["estimate_from_instruction_costs"]

_CYCLES_RE = re.compile(r'"estimated_cycles"\s*:\s*"?([0-9.]+)')


def _holds_collective(mod: _Module, an: _Analyzer, comp: str) -> bool:
    return any(an.role(i)[0] in ("sync", "start", "done") for i in mod.computations.get(comp, []))


def _instruction_cycles(mod: _Module, an: _Analyzer, comp: str, depth: int = 0) -> tuple[float, int, bool]:
    """XLA's estimated cycles of the instructions of ``comp`` run one after another (a while
    loop's body times its known trip count; a conditional's costliest branch, which XLA
    costs at nothing itself), how many instructions had a cost, and whether a branch, or a
    loop of unknown trips, holds a collective (which the caller cannot price; the
    collectives of loops with known trips it prices, `_collectives_in_loops`)."""
    total, costed, loop_collective = 0.0, 0, False
    for ins in mod.computations.get(comp, []):
        if ins.opcode == "conditional":
            names = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            branches = (
                [b.strip().lstrip("%") for b in names.group(1).split(",")]
                if names
                else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", ins.attrs)
            )
            if not branches or depth > 8:
                loop_collective = True
                continue
            priced = [_instruction_cycles(mod, an, branch, depth + 1) for branch in branches]
            cycles, k, _ = max(priced, key=lambda p: p[0])
            total += cycles
            costed += k
            loop_collective = loop_collective or any(
                _holds_collective(mod, an, b) or p[2] for b, p in zip(branches, priced)
            )
            continue
        if ins.opcode == "while":
            body, trips = _while_body(ins), _known_trips(ins, mod, comp)
            if body is None or trips is None or depth > 8:
                loop_collective = True  # an unknown number of iterations: no estimate
                continue
            cycles, k, nested = _instruction_cycles(mod, an, body, depth + 1)
            total += trips * cycles
            costed += k
            loop_collective = loop_collective or nested
            continue
        if an.role(ins)[0] in ("sync", "start", "done"):
            continue  # collectives are priced on their own
        m = _CYCLES_RE.search(ins.attrs)
        if m:
            total += float(m.group(1))
            costed += 1
    return total, costed, loop_collective


def _last_leaf_bytes(shape: str) -> int:
    """Bytes of the last array of a shape (an async start's result, after its operand)."""
    leaves = _shape_leaves(shape)
    return math.prod(leaves[-1][1]) * _dtype_bits(leaves[-1][0]) // 8 if leaves else 0


def _collectives_in_loops(mod: _Module, an: _Analyzer, comp: str, trips: int = 1, depth: int = 0) -> list:
    """``(times run, instruction)`` of each collective in the while loops of ``comp`` whose
    trips are known (a scanned layer stack's per-layer gathers and scatters), a pair counted
    at its start: they run synchronously (what XLA:TPU does without a schedule)."""
    found = []
    for ins in mod.computations.get(comp, []):
        body = _while_body(ins) if ins.opcode == "while" else None
        n = _known_trips(ins, mod, comp) if body is not None else None
        if body is None or n is None or depth > 8:
            continue
        for inner in mod.computations.get(body, []):
            if an.role(inner)[0] in ("sync", "start"):
                found.append((trips * n, inner))
        found += _collectives_in_loops(mod, an, body, trips * n, depth + 1)
    return found


def _exposed_after_hiding(rep: CompiledReport, comm: list[float], entry: _Entry, clock: float) -> float:
    """Every collective's time (``comm``, seconds) less, for an asynchronous one, the compute
    in its window by XLA's costs (``clock`` cycles per microsecond), added up."""
    done_of = _done_of(entry)
    exposed = 0.0
    for w, seconds in zip(rep.collectives, comm):
        done = done_of.get(w.name)
        if w.is_async and done is not None and w.name in entry.pos:
            inside = entry.order[entry.pos[w.name] + 1 : entry.pos[done.name]]
            hidden = sum(
                float(m.group(1))
                for i in inside
                if entry.roles[i.name][0] == "compute" and (m := _CYCLES_RE.search(i.attrs))
            )
            seconds = max(0.0, seconds - hidden / clock * 1e-6)
        exposed += seconds
    return exposed


def estimate_from_instruction_costs(
    rep: CompiledReport,
    compiled_or_hlo_text: Compiled | str,
    mesh: MeshLike | None = None,
    *,
    cycles_per_us: float | None = None,
    collective_seconds: Callable[[str, int, tuple[str, ...]], float | None] | None = None,
) -> CompiledReport:
    """``rep`` with an estimated step where XLA wrote no schedule, from XLA's cost of each
    instruction (``estimate_source="instruction costs"``); ``rep`` unchanged where it has a
    schedule estimate already or the costs are missing.

    XLA:TPU writes its cost of every fusion into the compiled HLO (``estimated_cycles`` in
    its ``backend_config``) even when its latency-hiding scheduler does not run (a single
    slice with the default options). The compute is those costs added up in program order
    (a while loop's body times its trip count, a conditional's costliest branch: XLA costs
    the conditional itself at nothing); each collective is priced by XLA's
    latency estimator on a program of that collective alone (the same kind, bytes and mesh
    axes, as one flat array; ``collective_seconds(kind, bytes, axes)`` replaces that
    probe). Nothing overlaps: a synchronous collective adds its whole time, an
    asynchronous one what the costed compute in its window does not cover. No estimate
    (``rep`` returned) where a collective cannot be priced, a loop or a branch holds one, or
    the program carries no instruction costs (XLA:GPU and XLA:CPU write none).

    Args:
      rep: the program's `report`.
      compiled_or_hlo_text: the compiled program, or its ``as_text()``.
      mesh: the ``Mesh`` it was compiled for: its devices compile the probes (None, or an
        ``AbstractMesh``: give ``collective_seconds``).
      cycles_per_us: the chip's clock (None: read from the probe's schedule).
      collective_seconds: ``(kind, bytes, axes) -> seconds`` for each collective, in place
        of the probes (None for a collective it cannot price). A collective whose replica
        groups span part of its axes (XLA:TPU's two-stage reduce-scatter) is asked for at
        the size that moves as many bytes per device in a ring over the whole axes.

    Returns:
      ``rep`` with ``step_s``, ``exposed_comm_s`` and ``estimate_source`` set, or ``rep``
      itself where no estimate can be made.

    Example:
      XLA:CPU costs no instruction, so a CPU program keeps its report:

      >>> import jax, jax.numpy as jnp
      >>> from jaxsched import check
      >>> compiled = jax.jit(jnp.sin).trace(jnp.ones(4)).lower().compile()
      >>> rep = check.report(compiled, None, label="sin")
      >>> check.estimate_from_instruction_costs(rep, compiled, collective_seconds=lambda *a: 1e-6) is rep
      True
    """
    if rep.step_s is not None:
        return rep
    text = _text_of(compiled_or_hlo_text)
    mod = _parse_hlo(text)
    cycles, costed, loop_collective = _instruction_cycles(mod, _Analyzer(mod), mod.entry)
    if costed == 0 or loop_collective:
        return rep
    if collective_seconds is None and not isinstance(mesh, Mesh):
        return rep
    probing = collective_seconds is None
    clock = cycles_per_us

    def price(kind: str, nbytes: int, axes: tuple[str, ...]) -> float | None:
        nonlocal clock
        if collective_seconds is not None:
            return collective_seconds(kind, nbytes, axes)
        if not isinstance(mesh, Mesh):  # checked above: probing needs real devices
            return None
        seconds, cpu = _probe_collective(mesh, kind, nbytes, axes)
        clock = clock or cpu
        return seconds

    entry = _read_entry(text)
    comm: list[float] = []
    for w in rep.collectives:
        ins = entry.by_name.get(w.name)
        if not w.mesh_axes:
            seconds = None
        elif ins is None:
            seconds = price(w.kind, w.bytes, w.mesh_axes)
        else:  # groups over part of the axes (a two-stage reduce-scatter) at their own traffic
            seconds = _priced(price, w.kind, w.bytes, _groups_source(ins, entry).attrs, mesh)
        if seconds is None:
            return rep
        comm.append(seconds)
    analyzer = _Analyzer(mod)
    in_loops = 0.0  # run synchronously, every iteration
    for times, ins in _collectives_in_loops(mod, analyzer, mod.entry):
        role, kind = analyzer.role(ins)
        nbytes = _shape_bytes(ins.shape) if role == "sync" else _last_leaf_bytes(ins.shape)
        wrapped = analyzer.called_info(ins)[1] if ins.opcode in ("fusion", "custom-call", "async-start") else None
        seconds = _priced(price, kind, int(nbytes), (wrapped or ins).attrs, mesh)
        if seconds is None:
            return rep
        in_loops += times * seconds
    if clock is None and isinstance(mesh, Mesh) and probing:  # no collective to read the clock from: a small one
        clock = _probe_collective(mesh, "all-reduce", _PROBE_MIN_BYTES, (mesh.axis_names[0],))[1]
    if not clock:
        return rep

    exposed = _exposed_after_hiding(rep, comm, entry, clock) + in_loops
    compute_s = cycles / clock * 1e-6
    return dataclasses.replace(
        rep, step_s=compute_s + exposed, exposed_comm_s=exposed, estimate_source=ESTIMATE_FROM_INSTRUCTIONS
    )
