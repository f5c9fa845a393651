"""What each HLO instruction is: a collective's start, done or synchronous op, compute, or plumbing.

Also the flops of compute (dots, convolutions, cuBLAS calls, fusions of them) and, for a
done op, the start it completes.

>>> from jaxsched.check._hlo_text import _parse_hlo
>>> mod = _parse_hlo('''
... ENTRY %main (p: f32[4,4]) -> f32[4,4] {
...   %p = f32[4,4]{1,0} parameter(0)
...   %s = f32[4,4]{1,0} all-reduce-start(%p), to_apply=%add
...   %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   ROOT %e = f32[4,4]{1,0} all-reduce-done(%s)
... }''')
>>> an = _Analyzer(mod)
>>> [an.role(i) for i in mod.computations[mod.entry]]
[('other', ''), ('start', 'all-reduce'), ('compute', ''), ('done', 'all-reduce')]
>>> an.flops(mod.computations[mod.entry][2], mod.entry)
128.0
"""

from __future__ import annotations

import math
import re

from jaxsched.check._hlo_text import _Instr, _Module, _shape_leaves


_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_PLUMBING = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "copy",
    "copy-start",
    "copy-done",
    "partition-id",
    "replica-id",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "domain",
    "async-update",
    "iota",
}
_ASYNC_TARGETS = ("AsyncCollectiveStart", "AsyncCollectiveDone")


def _target(ins: _Instr) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


class _Analyzer:
    """Classification and flop counts over one parsed module (memoised per computation)."""

    def __init__(self, mod: _Module) -> None:
        self.mod = mod
        self._flops: dict[str, float] = {}
        self._info: dict[str, tuple[set[str], _Instr | None, bool]] = {}

    def comp_info(self, comp: str) -> tuple[set[str], _Instr | None, bool]:
        """(custom-call targets, first collective, has-compute) of a computation, recursively."""
        if comp in self._info:
            return self._info[comp]
        self._info[comp] = (set(), None, False)
        targets: set[str] = set()
        coll = None
        compute = False
        for ins in self.mod.computations.get(comp, []):
            if ins.opcode == "custom-call":
                t = _target(ins)
                targets.add(t)
                if t not in _ASYNC_TARGETS:
                    compute = True
            elif ins.opcode in _COLLECTIVES or ins.opcode.endswith("-start") and ins.opcode[:-6] in _COLLECTIVES:
                coll = coll or ins
            elif (
                ins.opcode not in _PLUMBING
                and not ins.opcode.endswith("-done")
                and ins.opcode not in ("fusion", "call", "async-start", "async-done")
            ):
                compute = True
            for c in ins.calls():
                t2, c2, comp2 = self.comp_info(c)
                targets |= t2
                coll = coll or c2
                compute = compute or comp2
        self._info[comp] = (targets, coll, compute)
        return self._info[comp]

    def called_info(self, ins: _Instr) -> tuple[set[str], _Instr | None, bool]:
        targets: set[str] = set()
        coll: _Instr | None = None
        compute = False
        for c in ins.calls():
            t2, c2, comp2 = self.comp_info(c)
            targets |= t2
            coll = coll or c2
            compute = compute or comp2
        return targets, coll, compute

    def role(self, ins: _Instr) -> tuple[str, str]:
        """('start'|'done'|'sync'|'compute'|'other', kind) of an ENTRY instruction."""
        op = ins.opcode
        if op in _COLLECTIVES:
            return "sync", op
        if op.endswith("-start") and op[:-6] in _COLLECTIVES:
            return "start", op[:-6]
        if op.endswith("-done") and op[:-5] in _COLLECTIVES:
            return "done", op[:-5]
        if op in ("send", "recv"):
            return "start", op
        if op in ("send-done", "recv-done"):
            return "done", op[:-5]
        if op in ("async-start", "async-done"):
            _, coll, _ = self.called_info(ins)
            kind = coll.opcode.replace("-start", "") if coll is not None else "async"
            if coll is None and op == "async-done":
                kind = ""  # resolved from its start
            return ("start" if op == "async-start" else "done"), kind
        if op in ("custom-call", "fusion"):
            targets, coll, compute = self.called_info(ins)
            if op == "custom-call":
                targets = targets | {_target(ins)}
            kind = coll.opcode if coll is not None else "async-collective"
            if kind.endswith("-start"):
                kind = kind[:-6]
            if "AsyncCollectiveStart" in targets:
                return "start", kind
            if "AsyncCollectiveDone" in targets:
                return "done", kind
            if op == "fusion" and not compute:
                return "other", ""
            return "compute", ""
        if op in _PLUMBING or op.endswith("-done") or op.endswith("-start") or op == "async-update":
            return "other", ""
        if not any(dims for _, dims in _shape_leaves(ins.shape)):
            return "other", ""  # scalar bookkeeping
        return "compute", ""

    def flops(self, ins: _Instr, comp: str) -> float:
        op = ins.opcode
        if op == "dot":
            return self._dot_flops(ins, comp, _list_attr(ins.attrs, "lhs_contracting_dims"))
        if op == "convolution":
            return self._conv_flops(ins, comp)
        if op == "custom-call" and _target(ins).startswith("__cublas"):
            m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
            if m:
                dims = [int(x) for x in re.findall(r"\d+", m.group(1))]
                return self._dot_flops(ins, comp, dims)
            return 0.0
        total = 0.0
        for c in ins.calls():
            total += self.comp_flops(c)
        return total

    def comp_flops(self, comp: str) -> float:
        if comp not in self._flops:
            self._flops[comp] = 0.0
            self._flops[comp] = sum(self.flops(i, comp) for i in self.mod.computations.get(comp, []))
        return self._flops[comp]

    def _operand_dims(self, ins: _Instr, comp: str, k: int) -> tuple[int, ...] | None:
        if len(ins.operands) <= k:
            return None
        src = self.mod.by_name(comp).get(ins.operands[k])
        if src is None:
            return None
        leaves = _shape_leaves(src.shape)
        return leaves[0][1] if leaves else None

    def _dot_flops(self, ins: _Instr, comp: str, contracting: list[int]) -> float:
        out = _shape_leaves(ins.shape)
        lhs = self._operand_dims(ins, comp, 0)
        if not out or lhs is None:
            return 0.0
        try:
            k = math.prod(lhs[d] for d in contracting)
        except IndexError:
            return 0.0
        return 2.0 * math.prod(out[0][1]) * k

    def _conv_flops(self, ins: _Instr, comp: str) -> float:
        out = _shape_leaves(ins.shape)
        rhs = self._operand_dims(ins, comp, 1)
        m = re.search(r"dim_labels=\w*_(\w+)->", ins.attrs)
        if not out or rhs is None or not m or "o" not in m.group(1) or len(m.group(1)) != len(rhs):
            return 0.0
        o = rhs[m.group(1).index("o")]
        return 2.0 * math.prod(out[0][1]) * math.prod(rhs) / max(o, 1)


def _list_attr(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []


def _find_start(done: _Instr, entry: dict[str, _Instr], an: _Analyzer, roles: dict) -> _Instr | None:
    """The start op a done op completes: follow operand 0 back through tuple plumbing and
    continuation fusions; fall back to any reachable start."""
    passthrough = {"get-tuple-element", "tuple", "bitcast", "async-update", "copy"}

    def is_chain(i: _Instr) -> bool:
        if i.opcode in passthrough:
            return True
        if i.opcode == "fusion":
            return an.called_info(i)[1] is not None
        return False

    cur = done
    for _ in range(10000):
        if not cur.operands:
            break
        nxt = entry.get(cur.operands[0])
        if nxt is None:
            break
        if roles.get(nxt.name, ("",))[0] == "start":
            return nxt
        if not is_chain(nxt):
            break
        cur = nxt
    seen, todo = set(), list(done.operands)
    while todo:
        n = todo.pop(0)
        if n in seen or n not in entry:
            continue
        seen.add(n)
        i = entry[n]
        if roles.get(n, ("",))[0] == "start":
            return i
        if is_chain(i):
            todo += i.operands
    return None
