"""Reading XLA's latency-hiding schedule: a protobuf text file of start/end cycles per instruction.

``xla_dump_latency_hiding_schedule`` writes the module (computations, instructions) and
each computation's schedule; a small text-format reader turns it into `_Schedule`.

>>> _parse_textproto('a: 1 b { c: "x" } b { c: "y" }')
{'a': ['1'], 'b': [{'c': ['"x"']}, {'c': ['"y"']}]}
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxsched.check._hlo_ops import _COLLECTIVES, _PLUMBING
from jaxsched.check._hlo_text import _Instr, _Module
from jaxsched.sim import _intervals as intervals

#: A text-format protobuf message: each field's values (a nested message is a `Proto`).
Proto = dict[str, list[Any]]


_TOK = re.compile(r'#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}\[\]:,;<>]|[^\s{}\[\]:,;<>"\']+')


def _parse_textproto(text: str) -> Proto:
    """A minimal protobuf text-format reader: {field: [values]} with nested dicts."""
    toks = [t for t in _TOK.findall(text) if not t.startswith("#")]
    pos = 0
    n = len(toks)

    def block(close: str | None) -> Proto:
        nonlocal pos
        d: Proto = {}
        while pos < n:
            t = toks[pos]
            if t == close:
                pos += 1
                return d
            if t in (",", ";"):
                pos += 1
                continue
            key = t
            pos += 1
            if pos < n and toks[pos] == ":":
                pos += 1
            if pos >= n:
                break
            v = toks[pos]
            if v in ("{", "<"):
                pos += 1
                vals = [block("}" if v == "{" else ">")]
            elif v == "[":
                pos += 1
                vals = []
                while pos < n and toks[pos] != "]":
                    if toks[pos] == "{":
                        pos += 1
                        vals.append(block("}"))
                    elif toks[pos] != ",":
                        vals.append(toks[pos])
                        pos += 1
                    else:
                        pos += 1
                pos += 1
            else:
                vals = [v]
                pos += 1
            d.setdefault(key, []).extend(vals)
        return d

    return block(None)


def _one(d: Proto, key: str, default: Any = None) -> Any:
    v = d.get(key)
    return v[0] if v else default


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


@dataclasses.dataclass
class _SchedOp:
    name: str
    opcode: str
    start: float
    end: float
    compute: bool
    kind: str
    operand0: str | None


@dataclasses.dataclass
class _Schedule:
    ops: list[_SchedOp]
    step_cycles: float | None
    wasted_cycles: float | None
    cycles_per_us: float
    #: the schedules of the other computations (while-loop bodies), by computation name
    others: dict = dataclasses.field(default_factory=dict)
    #: the module as it was scheduled (XLA:TPU forms its async collective fusions after, so
    #: its final program names differ from the schedule's), where the dump holds it
    module: _Module | None = None

    def seconds(self, cycles: float) -> float:
        return cycles / self.cycles_per_us * 1e-6

    def windows(self) -> list[tuple[str, float, float]]:
        """``(kind, start, end)`` of each asynchronous collective, start to done (seconds)."""
        starts = {o.name: o for o in self.ops if o.kind and (o.opcode.endswith("-start") or o.opcode == "async-start")}
        return [
            (o.kind, self.seconds(starts[o.operand0].start), self.seconds(o.end))
            for o in self.ops
            if o.kind and o.opcode.endswith("-done") and o.operand0 in starts
        ]

    def totals(self) -> tuple[float, float]:
        """This computation's length and the time in it a collective is in flight while no
        compute runs (seconds), from its ops alone."""
        if not self.ops:
            return 0.0, 0.0
        step = self.seconds(max(o.end for o in self.ops) - min(o.start for o in self.ops))
        windows = [(a, b) for _, a, b in self.windows()]
        sync = [(self.seconds(o.start), self.seconds(o.end)) for o in self.ops if o.kind and o.opcode == o.kind]
        compute = [(self.seconds(o.start), self.seconds(o.end)) for o in self.ops if o.compute]
        exposed = intervals.subtract(windows, compute) + sync
        return step, intervals.total(intervals.union(exposed))


def _parse_schedule(text: str) -> _Schedule | None:
    d = _parse_textproto(text)
    mod = _one(d, "hlo_module", {})
    comps = mod.get("computations", [])
    entry_id = _one(mod, "entry_computation_id")
    entry_name = _unquote(_one(mod, "entry_computation_name", '""'))
    by_id: dict[str, dict] = {}
    comp_by_id = {}
    entry_comp = None
    for c in comps:
        comp_by_id[_one(c, "id")] = c
        for ins in c.get("instructions", []):
            by_id[_one(ins, "id")] = ins
        if _one(c, "id") == entry_id or _unquote(_one(c, "name", '""')) == entry_name:
            entry_comp = c
    scheds = d.get("computation_schedules", [])
    if not scheds:
        return None
    entry_sched = None
    if entry_comp is not None:
        for s in scheds:
            if _one(s, "computation_id") == _one(entry_comp, "id"):
                entry_sched = s
    if entry_sched is None:
        entry_sched = max(scheds, key=lambda s: (("scheduler_statistics" in s), len(s.get("instructions", []))))

    name_of_id = {_one(c, "id"): _unquote(_one(c, "name", '""')) for c in comps}

    def coll_of(ins: dict) -> str | None:
        for cid in ins.get("called_computation_ids", []):
            for sub in comp_by_id.get(cid, {}).get("instructions", []):
                op = _unquote(_one(sub, "opcode", '""'))
                base = op[:-6] if op.endswith("-start") else op
                if base in _COLLECTIVES:
                    return base
        return None

    def op_of(si: dict) -> _SchedOp:
        ins = by_id.get(_one(si, "id"), {})
        name = _unquote(_one(ins, "name", '""'))
        opcode = _unquote(_one(ins, "opcode", '""'))
        start = float(_one(si, "start_timestamp_cycles", 0) or 0)
        end = float(_one(si, "end_timestamp_cycles", 0) or 0)
        kind = ""
        if opcode.endswith("-start") or opcode.endswith("-done"):
            base = opcode.rsplit("-", 1)[0]
            kind = base if base in _COLLECTIVES else ""
        if opcode in ("send", "recv", "send-done", "recv-done"):
            kind = opcode.split("-")[0]
        if opcode in ("async-start", "async-done"):
            kind = coll_of(ins) or ""
        if opcode in _COLLECTIVES:
            kind = opcode
        shape = _one(ins, "shape", {})
        scalar = shape and not shape.get("dimensions") and not shape.get("tuple_shapes")
        compute = (
            not kind
            and opcode not in _PLUMBING
            and not opcode.endswith("-start")
            and not opcode.endswith("-done")
            and opcode not in ("async-start", "async-done")
            and opcode != "while"
            and not (scalar and opcode not in ("fusion", "custom-call"))
        )
        operand_ids = ins.get("operand_ids", [])
        op0 = _unquote(_one(by_id.get(operand_ids[0], {}), "name", '""')) if operand_ids else None
        return _SchedOp(name, opcode, start, end, compute, kind, op0)

    def schedule_of(sched: dict) -> _Schedule:
        stats = _one(sched, "scheduler_statistics", {})
        total = _one(stats, "total_cycles")
        wasted = _one(stats, "total_wasted_cycles")
        return _Schedule(
            [op_of(si) for si in sched.get("instructions", [])],
            float(total) if total is not None else None,
            float(wasted) if wasted is not None else (0.0 if total is not None else None),
            float(_one(sched, "cycles_per_microsecond", 1) or 1),
        )

    entry = schedule_of(entry_sched)
    entry.others = {
        name_of_id.get(_one(sc, "computation_id"), ""): schedule_of(sc) for sc in scheds if sc is not entry_sched
    }
    name_of = {i: _unquote(_one(ins, "name", '""')) for i, ins in by_id.items()}
    entry.module = _Module(
        {
            _unquote(_one(c, "name", '""')): [
                _Instr(
                    _unquote(_one(ins, "name", '""')),
                    _shape_text(_one(ins, "shape", {})),
                    _unquote(_one(ins, "opcode", '""')),
                    [name_of.get(x, "") for x in ins.get("operand_ids", [])],
                    "",
                )
                for ins in c.get("instructions", [])
            ]
            for c in comps
        },
        entry_name,
    )
    for other in entry.others.values():
        other.module = entry.module
    return entry


def _shape_text(shape: Proto) -> str:
    """An HLO shape string (``f32[4,8]``, tuples in parentheses) from a shape proto.

    Example:
        >>> _shape_text({"element_type": ["BF16"], "dimensions": ["4", "8"]})
        'bf16[4,8]'
    """
    parts = shape.get("tuple_shapes")
    if parts:
        return "(" + ", ".join(_shape_text(p) for p in parts) + ")"
    element = str(_one(shape, "element_type", "")).lower()
    return f"{element}[{','.join(shape.get('dimensions', []))}]"
