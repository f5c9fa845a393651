"""While loops and all-gathered memory in XLA's schedule of a computation.

A ``lax.scan`` over layers is one instruction in the entry's schedule: `_loop_costs`
counts its body's own schedule for every iteration; `_live_gathered` is the peak of
all-gathered bytes alive at once (FSDP's gathered parameters).

>>> from jaxsched.check._hlo_text import _parse_hlo
>>> from jaxsched.check._schedule_proto import _Schedule
>>> mod = _parse_hlo('''
... ENTRY %m () -> f32[] {
...   ROOT %c = f32[] constant(0)
... }''')
>>> empty = _Schedule([], None, None, 1.0)
>>> _live_gathered(mod, mod.entry, empty), _loop_costs(mod, mod.entry, empty)
((0, 0), [])
"""

from __future__ import annotations

import math
import re

from jaxsched.check._hlo_text import _dtype_bits, _Instr, _Module, _shape_leaves
from jaxsched.check._schedule_proto import _Schedule
from jaxsched.check._compiled_report import LoopCost


def _while_body(ins: _Instr) -> str | None:
    """The body computation of a ``while`` instruction."""
    found = re.search(r"body=%?([\w.\-]+)", ins.attrs)
    return found.group(1) if found else None


def _known_trips(ins: _Instr, mod: "_Module | None" = None, comp: str | None = None) -> int | None:
    """A ``while`` instruction's trip count: where XLA recorded it (``known_trip_count``, as
    XLA:GPU does), else read from a ``lax.scan``'s loop (XLA:TPU): a condition ``i < N`` on
    a counter that the loop's initial tuple starts at a constant."""
    found = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
    if found:
        return int(found.group(1))
    if mod is None or comp is None:
        return None
    cond = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
    body = mod.by_name(cond.group(1)) if cond else {}
    root = next((i for i in body.values() if i.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter, bound = (body.get(x) for x in root.operands)
    index = re.search(r"index=(\d+)", counter.attrs) if counter is not None else None
    if counter is None or counter.opcode != "get-tuple-element" or index is None:
        return None
    end = _int_constant(bound)
    outer = mod.by_name(comp)
    init = outer.get(ins.operands[0]) if ins.operands else None
    k = int(index.group(1))
    start = (
        _int_constant(outer.get(init.operands[k]), outer)
        if init is not None and init.opcode == "tuple" and k < len(init.operands)
        else None
    )
    return end - start if end is not None and start is not None and end > start else None


def _int_constant(ins: _Instr | None, comp: dict | None = None) -> int | None:
    """The value of an integer scalar ``constant`` (through copies and bitcasts in ``comp``,
    the instructions of its computation by name), else None."""
    for _ in range(4):
        if ins is None or comp is None or ins.opcode not in ("copy", "bitcast") or not ins.operands:
            break
        ins = comp.get(ins.operands[0])
    if ins is None or ins.opcode != "constant":
        return None
    try:
        return int(ins.args.strip())
    except ValueError:
        return None


def _live_gathered(mod: "_Module", comp: str, sched: "_Schedule") -> tuple[int, int]:
    """The most bytes of all-gathered values alive at once in computation ``comp`` (from each
    gather's start to the end of its last reader, in XLA's schedule), and how many gathered
    arrays that is: what FSDP's gathered parameters cost in memory beyond the blocks. A gather
    XLA combined from several is counted per element, each freed after its own last reader.

    Read from the final program where its names are the schedule's (XLA:GPU), else from
    the module as it was scheduled (XLA:TPU, which forms its async gathers after)."""
    found = _gathered_in(mod, comp, sched)
    scheduled = getattr(sched, "module", None)
    if found == (0, 0) and scheduled is not None and comp in scheduled.computations:
        found = _gathered_in(scheduled, comp, sched)
    return found


def _gathered_in(mod: "_Module", comp: str, sched: "_Schedule") -> tuple[int, int]:
    """`_live_gathered` over the instructions of ``mod``."""
    if sched is None or not sched.ops:
        return 0, 0
    timing = {o.name: (o.start, o.end) for o in sched.ops}
    instrs = mod.computations.get(comp, [])
    by_name = {i.name: i for i in instrs}
    readers: dict[str, list[str]] = {}
    for ins in instrs:
        for x in ins.operands:
            readers.setdefault(x, []).append(ins.name)
    plumbing = {"get-tuple-element", "bitcast", "copy", "tuple"}

    def last_read(name: str, depth: int = 0) -> float:
        end = timing.get(name, (0.0, 0.0))[1]
        for r in readers.get(name, []):
            ins = by_name.get(r)
            if ins is not None and ins.opcode in plumbing and depth < 6:
                end = max(end, last_read(r, depth + 1))
            else:
                end = max(end, timing.get(r, (0.0, 0.0))[1])
        return end

    def elements(ins: _Instr) -> list[tuple[float, int]]:
        """``(last read, bytes)`` of each gathered array ``ins`` holds."""
        parts = _shape_leaves(ins.shape)
        picked: dict[int, float] = {}
        whole = timing.get(ins.name, (0.0, 0.0))[1]
        for r in readers.get(ins.name, []):
            reader = by_name.get(r)
            index = re.search(r"index=(\d+)", reader.attrs) if reader is not None else None
            if reader is not None and reader.opcode == "get-tuple-element" and index and len(parts) > 1:
                i = int(index.group(1))
                picked[i] = max(picked.get(i, 0.0), last_read(r))
            else:  # read whole: every element lives as long as that reader
                whole = max(whole, last_read(ins.name))
        return [
            (max(whole, picked.get(i, 0.0)), math.prod(dims) * _dtype_bits(dt) // 8)
            for i, (dt, dims) in enumerate(parts)
        ]

    spans = []
    for ins in instrs:
        base = ins.opcode[:-5] if ins.opcode.endswith("-done") else ins.opcode
        if base != "all-gather" or ins.opcode == "all-gather-start":
            continue
        start_name = ins.operands[0] if ins.opcode.endswith("-done") and ins.operands else ins.name
        begin = timing.get(start_name, timing.get(ins.name, (None, None)))[0]
        if begin is None:
            continue
        spans += [(begin, end, nbytes) for end, nbytes in elements(ins)]
    events = sorted([(a, b) for a, _, b in spans] + [(e, -b) for _, e, b in spans], key=lambda t: (t[0], t[1]))
    live = peak = count = peak_count = 0
    for _, delta in events:
        live += delta
        count += 1 if delta > 0 else -1
        if live > peak:
            peak, peak_count = live, count
    return peak, peak_count


def _loop_costs(mod: "_Module", comp: str, sched: "_Schedule", depth: int = 0) -> list[LoopCost]:
    """The while loops of computation ``comp`` whose bodies XLA scheduled on their own (a
    ``lax.scan`` over layers), nested loops counted in their parents. XLA's estimate for the
    computation counts a loop as one instruction; its body runs ``trips`` times."""
    loops = []
    for ins in mod.computations.get(comp, []):
        if ins.opcode != "while" or depth > 8:
            continue
        body, n = _while_body(ins), _known_trips(ins, mod, comp)
        if body is None or n is None or body not in sched.others:
            continue
        inner = sched.others[body]
        step, exposed = inner.totals()
        gathered = _live_gathered(mod, body, inner)[0]
        for nested in _loop_costs(mod, body, sched, depth + 1):
            step, exposed = step + nested.seconds, exposed + nested.exposed_s
            gathered = max(gathered, nested.peak_gathered_bytes)
        loops.append(LoopCost(ins.name, n, n * step, n * exposed, gathered))
    return loops
