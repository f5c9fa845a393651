"""Where the collectives sit in a compiled (scheduled) XLA program, by XLA's own estimate.

A strategy that reorders gradient communication only helps if the compiler keeps the order
and overlaps the communication with compute. This module reads what XLA actually produced:
the scheduled HLO of a compiled program (``compiled.as_text()``; the ENTRY computation's
instruction order is the schedule) and, when the backend writes one, the latency-hiding
scheduler's own estimate (``xla_dump_latency_hiding_schedule``: start/end cycles of every
instruction, total and "wasted" cycles). It reports each collective's kind, size, mesh axes,
whether it is asynchronous, and the compute scheduled inside its start..done window.

Nothing here runs on an accelerator: it works on programs compiled for compile-only GPU or
TPU devices, and every time it reports is XLA's estimate, not a measurement.

How asynchrony shows up in the compiled HLO:

- GPU: ``all-reduce-start``/``all-reduce-done`` (likewise all-gather, reduce-scatter,
  all-to-all, collective-permute), or ``async-start``/``async-done`` wrapping a collective.
  A pair whose backend_config says ``"is_sync":true`` runs synchronously.
- TPU: an *async collective fusion*: a ``fusion`` named ``async-collective-start*`` whose
  computation ends in ``custom-call(... custom_call_target="AsyncCollectiveStart")``, compute
  fusions calling ``async_collective_fusion.*`` (the collective's continuation fused with
  convolutions), and a ``fusion`` ending in ``AsyncCollectiveDone``. TPU schedules *before*
  it forms these fusions, so its schedule names the pairs ``all-reduce-start.N`` etc.; they
  are matched to the fused pairs by kind and order.
- A bare collective (``all-reduce(``) in ENTRY is synchronous (CPU always; TPU by default).

A hand-written program, with no schedule estimate:

>>> TEXT = '''
... HloModule m, is_scheduled=true
...
... %add (a: f32[], b: f32[]) -> f32[] {
...   %a = f32[] parameter(0)
...   %b = f32[] parameter(1)
...   ROOT %s = f32[] add(%a, %b)
... }
...
... ENTRY %main (p: f32[256,256], q: f32[256,256]) -> f32[256,256] {
...   %p = f32[256,256]{1,0} parameter(0)
...   %q = f32[256,256]{1,0} parameter(1)
...   %ars = f32[256,256]{1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
...   %d = f32[256,256]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   %ard = f32[256,256]{1,0} all-reduce-done(%ars)
...   ROOT %r = f32[256,256]{1,0} add(%ard, %d)
... }
... '''
>>> r = report(TEXT, None, None, label="x")
>>> w = r.collectives[0]
>>> (w.kind, w.bytes, w.is_async, w.compute_ops, w.compute_flops, w.start_s)
('all-reduce', 262144, True, 1, 33554432.0, None)
>>> (r.num_async, r.num_sync, r.step_s)
(1, 0, None)
"""

from __future__ import annotations
from jaxsched._errors import JaxschedValueError

import dataclasses
import glob
import math
import os
import re
import shutil
import tempfile
from typing import Any, NamedTuple, Sequence

import numpy as np
from jax.sharding import Mesh

from jaxsched.sim import intervals
from jaxsched.core.axes import num_slices

__all__ = [
    "CollectiveWindow",
    "CompiledReport",
    "ESTIMATOR",
    "Inspection",
    "LoopCost",
    "PLAIN_LABEL",
    "ESTIMATE_FROM_INSTRUCTIONS",
    "ESTIMATE_FROM_SCHEDULE",
    "compile_with_schedule",
    "describe_mesh",
    "estimate_from_instruction_costs",
    "format_options",
    "format_table",
    "inspect_lowered",
    "inspect_jitted",
    "plot",
    "ratios",
    "report",
]

ESTIMATOR = "XLA latency-hiding scheduler estimate for the compiled program (not measured on hardware)"

#: ``CompiledReport.estimate_source`` of a report timed by XLA's latency-hiding schedule.
ESTIMATE_FROM_SCHEDULE = "schedule"
#: ``CompiledReport.estimate_source`` of a report XLA wrote no schedule for, timed from
#: XLA's cost of each instruction (`estimate_from_instruction_costs`).
ESTIMATE_FROM_INSTRUCTIONS = "instruction costs"


@dataclasses.dataclass(frozen=True)
class CollectiveWindow:
    """One collective of the compiled program, and what XLA scheduled inside its window.

    ``start_s``/``end_s``/``compute_s`` come from XLA's schedule estimate (None without one).
    For a collective the final program runs synchronously, ``compute_ops``, ``compute_flops``
    and ``compute_s`` are 0; on TPU its ``start_s``..``end_s`` can still be the window the
    scheduler had planned before a later pass made it synchronous.
    """

    name: str
    kind: str
    bytes: int
    mesh_axes: tuple[str, ...]
    is_async: bool
    compute_ops: int
    compute_flops: float
    start_s: float | None
    end_s: float | None
    compute_s: float | None


class LoopCost(NamedTuple):
    """A while loop of the compiled program (a ``lax.scan`` over layers), all iterations.

    Attributes:
      name: the loop's HLO instruction.
      trips: its trip count (iterations XLA peeled or unrolled are not among them).
      seconds: XLA's estimate of all its iterations.
      exposed_s: communication in them that no compute hides.
      peak_gathered_bytes: the most all-gathered bytes alive at once within one iteration
        (a double-buffered layer stack: the next layer's weights, while the current layer's
        arrive through the loop's carry).
    """

    name: str
    trips: int
    seconds: float
    exposed_s: float
    peak_gathered_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    """A compiled program's collectives and XLA's estimate of its step and exposed comm.

    Both headline figures come from the start and end times the latency-hiding scheduler
    gave every instruction (its own cost model): ``step_s`` is the schedule's length (the
    last instruction's end), ``exposed_comm_s`` the time in it during which a collective
    is in flight and no compute runs, counting the whole window of a collective that the
    final program runs synchronously.

    A while loop (a ``lax.scan`` over layers) is one instruction in the entry's schedule;
    XLA schedules its body on its own, and the body runs its trip count times: ``step_s`` and
    ``exposed_comm_s`` count every iteration, and ``loops`` lists each loop
    (`LoopCost`). ``peak_gathered_bytes`` is the
    most all-gathered data alive at once in the schedule (each gather from its start to its
    last reader): FSDP's gathered parameters, what a bound on prefetching keeps small.
    ``peak_memory_bytes`` is XLA's memory analysis per device (arguments + outputs +
    temporaries - aliased), None where the backend has none.

    XLA also writes summary statistics, kept as ``xla_total_s`` (``total_cycles``) and
    ``xla_wasted_s`` (``total_wasted_cycles``). They come from a separate pass and disagree
    with the schedule's own times, in both directions (a 126M-parameter MLP on H100:
    total 3061 us for a schedule 4164 us long, and 5572 us for one 4032 us long; on TPU
    the wasted cycles barely move between programs), so they are reported, not used.

    ``estimate_source`` says where ``step_s`` and ``exposed_comm_s`` come from:
    ``"schedule"`` (`ESTIMATE_FROM_SCHEDULE`, the above), ``"instruction costs"``
    (`ESTIMATE_FROM_INSTRUCTIONS`: XLA wrote no schedule, as XLA:TPU does not for a
    single slice with its default options, and the step is XLA's cost of each instruction
    added up; see `estimate_from_instruction_costs`), or None (no estimate:
    `no_estimate_reason` says why). ``compiler_options`` are the XLA options the
    program was compiled with (``{}``: XLA's defaults), as passed to the compiler.
    """

    label: str
    target: str
    platform: str
    step_s: float | None
    exposed_comm_s: float | None
    collectives: tuple[CollectiveWindow, ...]
    compute: tuple[tuple[str, float, float], ...]
    estimator: str = ESTIMATOR
    xla_total_s: float | None = None
    xla_wasted_s: float | None = None
    loops: tuple[LoopCost, ...] = ()
    peak_gathered_bytes: int | None = None
    peak_memory_bytes: int | None = None
    estimate_source: str | None = None
    compiler_options: dict = dataclasses.field(default_factory=dict)

    @property
    def num_async(self) -> int:
        return sum(1 for c in self.collectives if c.is_async)

    @property
    def no_estimate_reason(self) -> str | None:
        """Why the report has no estimated step (None when it has one)."""
        if self.step_s is not None:
            return None
        read = "the collectives listed are read from the compiled HLO"
        if self.platform == "cpu":
            return "XLA:CPU runs collectives inline and writes no schedule estimate"
        if self.num_async == 0:
            return (
                "XLA compiled every collective of this program synchronously and wrote no "
                "schedule estimate for it (XLA:TPU writes one only for a program with "
                "asynchronous collectives; on GPU its latency-hiding scheduler did not run "
                f"for this target); {read}"
            )
        return f"XLA wrote no schedule estimate for this program on this target; {read}"

    @property
    def num_sync(self) -> int:
        return sum(1 for c in self.collectives if not c.is_async)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["collectives"] = [dict(dataclasses.asdict(c), mesh_axes=list(c.mesh_axes)) for c in self.collectives]
        d["compute"] = [list(c) for c in self.compute]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CompiledReport":
        d = dict(d)
        d["collectives"] = tuple(CollectiveWindow(**dict(c, mesh_axes=tuple(c["mesh_axes"]))) for c in d["collectives"])
        d["compute"] = tuple((str(n), float(s), float(e)) for n, s, e in d["compute"])
        d["loops"] = tuple(LoopCost(*loop) for loop in d.get("loops", ()))
        return cls(**d)


# ---------------------------------------------------------------------------------------
# Compiling with the schedule dump


def compile_with_schedule(lowered, compiler_options: dict | None = None) -> tuple[Any, str | None]:
    """Compile ``lowered`` and return ``(compiled, schedule_text)``.

    Adds ``xla_dump_to`` (a temporary directory, removed afterwards) and
    ``xla_dump_latency_hiding_schedule`` to ``compiler_options``. ``schedule_text`` is the
    ``*.schedule.txt`` XLA wrote (GPU, and TPU with async collectives enabled), or None
    (CPU; TPU with default options). If several are written, the largest is returned.
    """
    tmp = tempfile.mkdtemp(prefix="jaxsched_schedule_")
    try:
        options = dict(compiler_options or {})
        options.update({"xla_dump_to": tmp, "xla_dump_latency_hiding_schedule": True})
        compiled = lowered.compile(compiler_options=options)
        paths = glob.glob(os.path.join(tmp, "**", "*schedule.txt"), recursive=True)
        text = None
        if paths:
            with open(max(paths, key=os.path.getsize)) as f:
                text = f.read()
        return compiled, text
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# HLO text

_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "tf32": 32,
}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,\s]*)\]")


def _shape_leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Array leaves of an HLO shape string (tuple shapes flattened; layouts ignored)."""
    no_layout = re.sub(r"\{[^{}]*\}", "", re.sub(r"\{[^{}]*\{[^{}]*\}[^{}]*\}", "", shape))
    leaves = []
    for dtype, dims in _ARRAY_RE.findall(no_layout):
        dims = tuple(int(x) for x in dims.replace(" ", "").split(",") if x)
        leaves.append((dtype, dims))
    return leaves


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    m = re.match(r"[a-z]+([0-9]+)", dtype)
    return int(m.group(1)) if m else 0


def _shape_bytes(shape: str) -> int:
    return sum(math.prod(dims) * _dtype_bits(dt) // 8 for dt, dims in _shape_leaves(shape))


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False

    def calls(self) -> list[str]:
        """Computations this instruction runs as part of itself (fusions, calls, async
        wrappers); reducers (to_apply) and loop bodies are not followed."""
        out = []
        for key in ("calls", "called_computations"):
            m = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", self.attrs)
            if m:
                out += re.findall(r"%?([\w.\-]+)", m.group(1).strip("{}"))
        return out


_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")


def _match_paren(s: str, i: int) -> int:
    """Index just past the bracket group that starts at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _match_paren(line, i)
    else:
        j = i
        while j < len(line) and not line[j].isspace():
            if line[j] in "[{(":
                j = _match_paren(line, j)
            else:
                j += 1
    shape = line[i:j]
    m2 = re.match(r"\s*([\w\-]+)\(", line[j:])
    if not m2:
        return None
    opcode = m2.group(1)
    k = j + m2.end() - 1
    end = _match_paren(line, k)
    operands = re.findall(r"%([\w.\-]+)", line[k + 1 : end - 1])
    return _Instr(m.group(2), shape, opcode, operands, line[end:], bool(m.group(1)))


@dataclasses.dataclass
class _Module:
    computations: dict[str, list[_Instr]]
    entry: str

    def by_name(self, comp: str) -> dict[str, _Instr]:
        cache = self.__dict__.setdefault("_by_name", {})
        if comp not in cache:
            cache[comp] = {i.name: i for i in self.computations.get(comp, [])}
        return cache[comp]


def _parse_hlo(text: str) -> _Module:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s.startswith("HloModule"):
            continue
        if current is None:
            m = _COMP_RE.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if s == "}":
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[current].append(ins)
    if entry is None:
        if not comps:
            raise JaxschedValueError("no HLO computation found in the text")
        entry = list(comps)[-1]
    return _Module(comps, entry)


# ---------------------------------------------------------------------------------------
# Classifying instructions

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

    def __init__(self, mod: _Module):
        self.mod = mod
        self._flops: dict[str, float] = {}
        self._info: dict[str, tuple[set, _Instr | None, bool]] = {}

    def comp_info(self, comp: str) -> tuple[set, _Instr | None, bool]:
        """(custom-call targets, first collective, has-compute) of a computation, recursively."""
        if comp in self._info:
            return self._info[comp]
        self._info[comp] = (set(), None, False)
        targets: set = set()
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

    def called_info(self, ins: _Instr) -> tuple[set, _Instr | None, bool]:
        targets, coll, compute = set(), None, False
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


# ---------------------------------------------------------------------------------------
# Replica groups -> mesh axes


def _replica_groups(attrs: str) -> list[list[int]] | None:
    """Groups of logical device ids from ``replica_groups=`` (explicit, iota or mesh-axes
    form) or ``source_target_pairs=``; [] for ``{}`` (all devices); None when absent.

    The mesh-axes form (XLA:TPU, a ``jax.jit`` step): ``mesh['axis_0'=8,'axis_1'=1]
    {'axis_0'}`` groups the devices of a row-major mesh that differ along the named axes.

    >>> _replica_groups("replica_groups=mesh['a'=2,'b'=2] {'b'}, to_apply=%add")
    [[0, 1], [2, 3]]
    """
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^{}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        reduced = re.findall(r"'([^']+)'", m.group(4))
        names = [n for n, _ in axes]
        if not axes or any(r not in names for r in reduced):
            return None  # sub-axes or a form not known here
        sizes = [int(x) for _, x in axes]
        if m.group(2):
            ids = np.arange(math.prod(int(x) for x in m.group(2).split(",")))
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
            ids = ids.reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        kept = [k for k, n in enumerate(names) if n not in reduced]
        moved = [k for k, n in enumerate(names) if n in reduced]
        width = math.prod(sizes[k] for k in moved)
        return ids.transpose(kept + moved).reshape(-1, width).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    for key in ("replica_groups", "source_target_pairs"):
        i = attrs.find(key + "={")
        if i >= 0:
            j = _match_paren(attrs, i + len(key) + 1)
            body = attrs[i + len(key) + 2 : j - 1]
            return [[int(x) for x in re.findall(r"\d+", g)] for g in re.findall(r"\{([^{}]*)\}", body)]
    return None


def _mesh_axes(groups: list[list[int]] | None, mesh) -> tuple[str, ...]:
    """Mesh axes along which the ids of a group differ. Ids are logical device ids, i.e.
    positions in ``mesh.devices.flat`` order."""
    if mesh is None or groups is None:
        return ()
    shape = tuple(mesh.axis_sizes)  # jax.sharding.Mesh or AbstractMesh
    names = tuple(mesh.axis_names)
    if not groups:
        return tuple(n for n, s in zip(names, shape) if s > 1)
    size = math.prod(shape)
    spans = [False] * len(shape)
    for g in groups:
        if any(i >= size for i in g):
            return ()
        coords = np.array(np.unravel_index(np.asarray(g, dtype=np.int64), shape))
        for a in range(len(shape)):
            if len(set(coords[a].tolist())) > 1:
                spans[a] = True
    return tuple(n for n, s in zip(names, spans) if s)


# ---------------------------------------------------------------------------------------
# The schedule text proto

_TOK = re.compile(r'#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}\[\]:,;<>]|[^\s{}\[\]:,;<>"\']+')


def _parse_textproto(text: str) -> dict:
    """A minimal protobuf text-format reader: {field: [values]} with nested dicts."""
    toks = [t for t in _TOK.findall(text) if not t.startswith("#")]
    pos = 0
    n = len(toks)

    def block(close: str | None) -> dict:
        nonlocal pos
        d: dict = {}
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


def _one(d: dict, key: str, default=None):
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

    def seconds(self, cycles: float) -> float:
        return cycles / self.cycles_per_us * 1e-6

    def totals(self) -> tuple[float, float]:
        """This computation's length and the time in it a collective is in flight while no
        compute runs (seconds), from its ops alone."""
        if not self.ops:
            return 0.0, 0.0
        step = self.seconds(max(o.end for o in self.ops) - min(o.start for o in self.ops))
        starts = {o.name: o for o in self.ops if o.kind and (o.opcode.endswith("-start") or o.opcode == "async-start")}
        windows = [
            (self.seconds(starts[o.operand0].start), self.seconds(o.end))
            for o in self.ops
            if o.kind and o.opcode.endswith("-done") and o.operand0 in starts
        ]
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
    return entry


def _live_gathered(mod: "_Module", comp: str, sched: "_Schedule") -> tuple[int, int]:
    """The most bytes of all-gathered values alive at once in computation ``comp`` (from each
    gather's start to the end of its last reader, in XLA's schedule), and how many gathered
    arrays that is: what FSDP's gathered parameters cost in memory beyond the blocks. A gather
    XLA combined from several is counted per element, each freed after its own last reader."""
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
        body = re.search(r"body=%?([\w.\-]+)", ins.attrs)
        trips = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
        if body is None or trips is None or body.group(1) not in sched.others:
            continue
        inner = sched.others[body.group(1)]
        step, exposed = inner.totals()
        gathered = _live_gathered(mod, body.group(1), inner)[0]
        for nested in _loop_costs(mod, body.group(1), sched, depth + 1):
            step, exposed = step + nested.seconds, exposed + nested.exposed_s
            gathered = max(gathered, nested.peak_gathered_bytes)
        n = int(trips.group(1))
        loops.append(LoopCost(ins.name, n, n * step, n * exposed, gathered))
    return loops


# ---------------------------------------------------------------------------------------
# The report


def _platform(text: str, mesh) -> str:
    if isinstance(mesh, Mesh):
        p = mesh.devices.flat[0].platform
        return {"cuda": "gpu", "rocm": "gpu"}.get(p, p)
    if ":T(" in text or "AsyncCollective" in text or "megacore" in text:
        return "tpu"
    if "operation_queue_id" in text or "__cublas" in text or "gemm_fusion" in text:
        return "gpu"
    return "cpu"


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


def report(
    compiled_or_hlo_text,
    schedule_text: str | None,
    mesh=None,
    *,
    label: str,
    target: str = "",
    compiler_options: dict | None = None,
) -> CompiledReport:
    """Collectives of a compiled program and XLA's schedule estimate for it.

    ``compiled_or_hlo_text``: a ``jax.stages.Compiled`` or its ``as_text()`` (scheduled HLO).
    ``schedule_text``: from `compile_with_schedule` (None: no times). ``mesh``: a
    ``Mesh`` or ``AbstractMesh`` that maps replica groups (logical ids = positions in
    ``mesh.devices.flat``) to axis names; None gives ``mesh_axes=()``. ``compiler_options``:
    what the program was compiled with, kept in the report (None: XLA's defaults).
    Without a schedule the report has no times; `estimate_from_instruction_costs`
    adds an estimate where XLA costs each instruction.
    """
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    mod = _parse_hlo(text)
    an = _Analyzer(mod)
    order = mod.computations[mod.entry]
    entry = {i.name: i for i in order}
    roles = {i.name: an.role(i) for i in order}
    pos = {i.name: k for k, i in enumerate(order)}
    sched = _parse_schedule(schedule_text) if schedule_text else None

    # start/done pairs and sync collectives of the final program, in program order
    done_of: dict[str, _Instr] = {}
    for ins in order:
        if roles[ins.name][0] == "done":
            st = _find_start(ins, entry, an, roles)
            if st is not None and st.name not in done_of:
                done_of[st.name] = ins
    items = []  # (start_instr, done_instr|None, kind, is_async)
    for ins in order:
        role, kind = roles[ins.name]
        if role == "sync":
            items.append((ins, None, kind, False))
        elif role == "start":
            done = done_of.get(ins.name)
            if done is None:
                continue
            cfg = ins.attrs + done.attrs
            is_async = not re.search(r'"is_sync"\s*:\s*true', cfg)
            if ins.opcode == "async-start":
                inner = an.called_info(ins)[1]
                if inner is not None and re.search(r'"is_sync"\s*:\s*true', inner.attrs):
                    is_async = False
            items.append((ins, done, kind or roles[done.name][1], is_async))

    # schedule lookups
    s_index: dict[str, int] = {}
    s_pairs: list[tuple[int, int, str]] = []
    if sched is not None:
        s_index = {o.name: k for k, o in enumerate(sched.ops)}
        starts = {
            o.name: k
            for k, o in enumerate(sched.ops)
            if o.kind and (o.opcode.endswith("-start") or o.opcode in ("send", "recv"))
        }
        for k, o in enumerate(sched.ops):
            if o.kind and o.opcode.endswith("-done") and o.operand0 in starts:
                s_pairs.append((starts[o.operand0], k, sched.ops[starts[o.operand0]].kind))
        s_pairs.sort()
    s_done_of = {a: b for a, b, _ in s_pairs}
    claimed: set[int] = set()

    def sched_window(ins: _Instr, done: _Instr | None, kind: str) -> tuple[int, int] | None:
        if sched is None:
            return None
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

    # By name first; then (TPU, whose schedule predates its async collective fusions) by
    # kind and first operand; then by kind in program order.
    windows: list[tuple[int, int] | None] = [sched_window(i, d, k) for i, d, k, _ in items]
    if sched is not None:
        for same_operand in (True, False):
            for n, (ins, done, kind, _) in enumerate(items):
                if windows[n] is not None:
                    continue
                for a, b, k in s_pairs:
                    if a in claimed or k != kind:
                        continue
                    if same_operand and (not ins.operands or sched.ops[a].operand0 != ins.operands[0]):
                        continue
                    claimed.add(a)
                    windows[n] = (a, b)
                    break

    out = []
    for (ins, done, kind, is_async), win in zip(items, windows):
        shape = done.shape if done is not None else ins.shape
        nbytes = _shape_bytes(shape)
        if kind == "send":  # send-done is a token: the payload is the send's first element
            leaves = _shape_leaves(ins.shape)
            nbytes = math.prod(leaves[0][1]) * _dtype_bits(leaves[0][0]) // 8 if leaves else 0
        groups_src = ins
        if ins.opcode in ("fusion", "custom-call", "async-start"):
            groups_src = an.called_info(ins)[1] or ins
        axes = _mesh_axes(_replica_groups(groups_src.attrs), mesh)
        ops, flops = 0, 0.0
        if is_async and done is not None:
            for mid in order[pos[ins.name] + 1 : pos[done.name]]:
                if roles[mid.name][0] == "compute":
                    ops += 1
                    flops += an.flops(mid, mod.entry)
        start_s = end_s = compute_s = None
        if win is not None:
            a, b = win
            start_s = sched.seconds(sched.ops[a].start)
            end_s = sched.seconds(sched.ops[b].end)
            compute_s = 0.0
            if is_async:
                compute_s = sched.seconds(sum(o.end - o.start for o in sched.ops[a + 1 : b] if o.compute))
        out.append(
            CollectiveWindow(
                ins.name, kind, int(nbytes), axes, bool(is_async), ops, float(flops), start_s, end_s, compute_s
            )
        )

    step_s = exposed = total = wasted = None
    compute: tuple = ()
    if sched is not None:
        if sched.step_cycles is not None:
            total = sched.seconds(sched.step_cycles)
        if sched.wasted_cycles is not None:
            wasted = sched.seconds(sched.wasted_cycles)
        compute = tuple((o.name, sched.seconds(o.start), sched.seconds(o.end)) for o in sched.ops if o.compute)
        if sched.ops:
            step_s = sched.seconds(max(o.end for o in sched.ops) - min(o.start for o in sched.ops))
            # a collective the final program runs synchronously hides nothing, even where the
            # schedule (on TPU made before the async fusions) had compute in its window
            timed = [w for w in out if w.start_s is not None and w.end_s is not None]
            hidden_by = [(sched.seconds(o.start), sched.seconds(o.end)) for o in sched.ops if o.compute]
            exposed_parts = intervals.subtract([(w.start_s, w.end_s) for w in timed if w.is_async], hidden_by)
            exposed_parts += [(w.start_s, w.end_s) for w in timed if not w.is_async]
            exposed = intervals.total(intervals.union(exposed_parts))
        loops = tuple(_loop_costs(mod, mod.entry, sched))
        gathered = [_live_gathered(mod, mod.entry, sched)]
        for comp, body in sched.others.items():
            gathered.append(_live_gathered(mod, comp, body))
        peak_gathered = max(g[0] for g in gathered)
        if loops and step_s is not None and exposed is not None:
            # a loop counts in the entry's schedule as one instruction; its iterations as
            # many times its body's own schedule
            own = {o.name: sched.seconds(o.end - o.start) for o in sched.ops}
            step_s += sum(loop.seconds - own.get(loop.name, 0.0) for loop in loops)
            exposed += sum(loop.exposed_s for loop in loops)
    else:
        loops, peak_gathered = (), None
    return CompiledReport(
        label,
        target,
        _platform(text, mesh),
        step_s,
        exposed,
        tuple(out),
        compute,
        xla_total_s=total,
        xla_wasted_s=wasted,
        loops=loops,
        peak_gathered_bytes=peak_gathered,
        peak_memory_bytes=None if isinstance(compiled_or_hlo_text, str) else _peak_memory(compiled_or_hlo_text),
        estimate_source=ESTIMATE_FROM_SCHEDULE if step_s is not None else None,
        compiler_options=dict(compiler_options or {}),
    )


def _peak_memory(compiled: Any) -> int | None:
    """Per-device peak from XLA's memory analysis: arguments, outputs and temporaries, less
    what outputs alias (donated arguments)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # backends without the analysis
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


# ---------------------------------------------------------------------------------------
# Without a schedule: XLA's cost of each instruction

_CYCLES_RE = re.compile(r'"estimated_cycles"\s*:\s*"?([0-9.]+)')


def _instruction_cycles(mod: _Module, an: _Analyzer, comp: str, depth: int = 0) -> tuple[float, int, bool]:
    """XLA's estimated cycles of the instructions of ``comp`` run one after another (a while
    loop's body times its known trip count), how many instructions had a cost, and whether
    a loop body holds a collective (which the caller cannot price)."""
    total, costed, loop_collective = 0.0, 0, False
    for ins in mod.computations.get(comp, []):
        if ins.opcode == "while":
            body = re.search(r"body=%?([\w.\-]+)", ins.attrs)
            trips = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
            if body is None or trips is None or depth > 8:
                loop_collective = True  # an unknown number of iterations: no estimate
                continue
            inner = mod.computations.get(body.group(1), [])
            if any(an.role(i)[0] in ("sync", "start", "done") for i in inner):
                loop_collective = True
            cycles, k, nested = _instruction_cycles(mod, an, body.group(1), depth + 1)
            total += int(trips.group(1)) * cycles
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


_PROBES: dict = {}
_PROBE_MIN_BYTES = 4096
#: the largest collective priced as a larger one where XLA keeps it synchronous
_PROBE_MAX_SMALL_BYTES = 1 << 20


def _probe_collective(mesh, kind: str, nbytes: int, axes: tuple[str, ...]) -> tuple[float | None, float | None]:
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

        from jaxsched.runtime.engine.xla import TPU_OPTIONS

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
            probe = report(compiled, schedule, mesh, label="probe")
            windows = [w for w in probe.collectives if w.kind == kind and w.start_s is not None]
            if windows:
                result = (max(w.end_s - w.start_s for w in windows), sched.cycles_per_us)
    except Exception:  # a collective this probe cannot build or XLA cannot compile
        result = (None, None)
    if result[0] is None and kind == "reduce-scatter":
        # XLA:TPU decomposes a reduce-scatter over a 3-D block of chips into an all-reduce
        # (no reduce-scatter to read): priced as half an all-reduce of its input, the
        # traffic of a ring reduce-scatter
        n = math.prod(mesh.shape[a] for a in axes)
        whole, clock = _probe_collective(mesh, "all-reduce", int(nbytes) * n, axes)
        result = (None if whole is None else whole / 2, clock)
    if result[0] is None and _PROBE_MIN_BYTES <= nbytes < _PROBE_MAX_SMALL_BYTES:
        # XLA:TPU keeps small collectives synchronous (no schedule to read): priced as
        # the smallest larger one it makes async, an upper bound
        result = _probe_collective(mesh, kind, max(4 * int(nbytes), 64 * 1024), axes)
    _PROBES[key] = result
    return result


def estimate_from_instruction_costs(
    rep: CompiledReport,
    compiled_or_hlo_text,
    mesh=None,
    *,
    cycles_per_us: float | None = None,
    collective_seconds=None,
) -> CompiledReport:
    """``rep`` with an estimated step where XLA wrote no schedule, from XLA's cost of each
    instruction (``estimate_source="instruction costs"``); ``rep`` unchanged where it has a
    schedule estimate already or the costs are missing.

    XLA:TPU writes its cost of every fusion into the compiled HLO (``estimated_cycles`` in
    its ``backend_config``) even when its latency-hiding scheduler does not run (a single
    slice with the default options). The compute is those costs added up in program order
    (a while loop's body times its trip count); each collective is priced by XLA's
    latency estimator on a program of that collective alone (the same kind, bytes and mesh
    axes, as one flat array; ``collective_seconds(kind, bytes, axes)`` replaces that
    probe). Nothing overlaps: a synchronous collective adds its whole time, an
    asynchronous one what the costed compute in its window does not cover. No estimate
    (``rep`` returned) where a collective cannot be priced, a loop holds a collective, or
    the program carries no instruction costs (XLA:GPU and XLA:CPU write none).

    ``cycles_per_us`` is the chip's clock (None: read from the probe's schedule)."""
    if rep.step_s is not None:
        return rep
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    mod = _parse_hlo(text)
    an = _Analyzer(mod)
    cycles, costed, loop_collective = _instruction_cycles(mod, an, mod.entry)
    if costed == 0 or loop_collective:
        return rep
    probing = collective_seconds is None
    if probing and not isinstance(mesh, Mesh):
        return rep
    clock = cycles_per_us

    def price(kind: str, nbytes: int, axes: tuple[str, ...]) -> float | None:
        nonlocal clock
        if not probing:
            return collective_seconds(kind, nbytes, axes)
        seconds, cpu = _probe_collective(mesh, kind, nbytes, axes)
        clock = clock or cpu
        return seconds

    comm: list[float] = []
    for w in rep.collectives:
        seconds = price(w.kind, w.bytes, w.mesh_axes) if w.mesh_axes else None
        if seconds is None:
            return rep
        comm.append(seconds)
    if clock is None and probing:  # no collective to read the clock from: a small one
        clock = _probe_collective(mesh, "all-reduce", _PROBE_MIN_BYTES, (mesh.axis_names[0],))[1]
    if not clock:
        return rep

    # compute in each async window (by XLA's costs) hides that much of its collective
    order = mod.computations[mod.entry]
    pos = {i.name: k for k, i in enumerate(order)}
    entry = {i.name: i for i in order}
    roles = {i.name: an.role(i) for i in order}
    done_of = {}
    for ins in order:
        if roles[ins.name][0] == "done":
            st = _find_start(ins, entry, an, roles)
            if st is not None:
                done_of.setdefault(st.name, ins)
    exposed = 0.0
    for w, seconds in zip(rep.collectives, comm):
        done = done_of.get(w.name)
        if w.is_async and done is not None and w.name in pos:
            inside = order[pos[w.name] + 1 : pos[done.name]]
            hidden = sum(
                float(m.group(1)) for i in inside if roles[i.name][0] == "compute" and (m := _CYCLES_RE.search(i.attrs))
            )
            seconds = max(0.0, seconds - hidden / clock * 1e-6)
        exposed += seconds
    compute_s = cycles / clock * 1e-6
    return dataclasses.replace(
        rep, step_s=compute_s + exposed, exposed_comm_s=exposed, estimate_source=ESTIMATE_FROM_INSTRUCTIONS
    )


def inspect_lowered(
    lowered, mesh, *, label: str, target: str = "", compiler_options: dict | None = None, estimate: bool = True
) -> CompiledReport:
    """Compile ``lowered`` with ``compiler_options`` (None: XLA's defaults; options that
    ``jax.jit(..., compiler_options=...)`` put in ``lowered`` apply too, so passing the same
    again changes nothing) and report it, the options recorded in the report; with
    ``estimate``, where XLA writes no schedule, estimate its step from XLA's instruction
    costs (`estimate_from_instruction_costs`)."""
    compiled, schedule = compile_with_schedule(lowered, compiler_options)
    rep = report(compiled, schedule, mesh, label=label, target=target, compiler_options=compiler_options)
    if estimate and rep.step_s is None and rep.platform != "cpu":
        rep = estimate_from_instruction_costs(rep, compiled, mesh)
    return rep


# ---------------------------------------------------------------------------------------
# Presenting


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def _ratio(x: float | None, base: float | None, mixed: bool = False) -> str:
    if x is None or base is None or base == 0:
        return ""
    return f" ({x / base:.2f}x{' against an estimate from instruction costs' if mixed else ''})"


#: How each ``estimate_source`` is named in a report's summary.
_SOURCE_TEXT = {
    ESTIMATE_FROM_SCHEDULE: "XLA estimate",
    ESTIMATE_FROM_INSTRUCTIONS: "estimated from XLA's instruction costs: no schedule, nothing overlapped",
    None: "no estimate",
}


def format_options(options: dict) -> str:
    """``"XLA defaults"``, or ``"name=value, ..."`` in name order."""
    if not options:
        return "XLA defaults"
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items()))


def format_table(reports: Sequence[CompiledReport], baseline: CompiledReport | None = None) -> str:
    """A text table of the reports; times are XLA's estimate, ratios are to ``baseline``."""
    lines = [
        f"Times: {ESTIMATOR}. step = the length of XLA's estimated schedule; exposed comm = "
        "the time in it with a collective in flight and no compute running; XLA's own "
        "summary statistics (total / wasted cycles) in brackets."
    ]
    if any(r.estimate_source == ESTIMATE_FROM_INSTRUCTIONS for r in reports):
        lines.append(
            "Where XLA wrote no schedule, step = XLA's cost of each instruction added up, and every "
            "collective's cost (XLA's latency estimate for it alone) counted as exposed, less "
            "the compute in the window of an asynchronous one."
        )
    for r in reports:
        b_step = baseline.step_s if baseline is not None else None
        b_exp = baseline.exposed_comm_s if baseline is not None else None
        mixed = (
            baseline is not None
            and baseline is not r
            and ESTIMATE_FROM_INSTRUCTIONS in (r.estimate_source, baseline.estimate_source)
            and r.estimate_source != baseline.estimate_source
        )
        lines.append("")
        lines.append(
            f"{r.label} [{r.target or '?'}, {r.platform}]: step {_us(r.step_s)} us"
            f"{_ratio(r.step_s, b_step, mixed)}, exposed comm {_us(r.exposed_comm_s)} us"
            f"{_ratio(r.exposed_comm_s, b_exp, mixed)} ({_SOURCE_TEXT.get(r.estimate_source, r.estimate_source)}); "
            f"async {r.num_async}/{len(r.collectives)} collectives"
            + (
                f" [XLA statistics: total {_us(r.xla_total_s)} us, wasted {_us(r.xla_wasted_s)} us]"
                if r.xla_total_s is not None
                else ""
            )
        )
        if r.no_estimate_reason:
            lines.append(f"  no estimate: {r.no_estimate_reason}")
        lines.append(f"  compiler options: {format_options(r.compiler_options)}")
        memory = [
            f"{what} {value / 1e6:.1f} MB"
            for what, value in (("peak memory", r.peak_memory_bytes), ("peak gathered", r.peak_gathered_bytes))
            if value
        ]
        if memory:
            lines.append("  per device: " + ", ".join(memory))
        for loop in r.loops:
            lines.append(
                f"  loop {loop.name}: {loop.trips} iterations, {_us(loop.seconds)} us, exposed comm "
                f"{_us(loop.exposed_s)} us, gathered per iteration {loop.peak_gathered_bytes / 1e6:.1f} MB"
            )
        if not r.collectives:
            lines.append("  (no collectives)")
            continue
        lines.append(
            f"  {'kind':<20}{'MB':>9}  {'axes':<12}{'async':<6}{'ops':>5}{'GFLOP':>9}"
            f"{'compute us':>12}{'window us':>11}  name"
        )
        for c in r.collectives:
            window = None if c.start_s is None or c.end_s is None else c.end_s - c.start_s
            lines.append(
                f"  {c.kind:<20}{c.bytes / 1e6:>9.3f}  {','.join(c.mesh_axes) or '-':<12}"
                f"{'yes' if c.is_async else 'no':<6}{c.compute_ops:>5}"
                f"{c.compute_flops / 1e9:>9.3f}{_us(c.compute_s):>12}{_us(window):>11}  {c.name}"
            )
    return "\n".join(lines)


_KIND_COLORS = {
    "all-reduce": "tab:blue",
    "reduce-scatter": "tab:orange",
    "all-gather": "tab:green",
    "all-to-all": "tab:purple",
    "collective-permute": "tab:brown",
    "send": "tab:pink",
    "recv": "tab:olive",
    "ragged-all-to-all": "tab:cyan",
}


def _streams(windows: list[CollectiveWindow]) -> list[int]:
    """Greedy row assignment so that overlapping windows go to separate rows."""
    ends: list[float] = []
    rows = [0] * len(windows)
    for k in sorted(range(len(windows)), key=lambda k: windows[k].start_s):
        w = windows[k]
        for r, e in enumerate(ends):
            if e <= w.start_s:
                rows[k], ends[r] = r, w.end_s
                break
        else:
            rows[k] = len(ends)
            ends.append(w.end_s)
    return rows


def plot(reports: Sequence[CompiledReport], path: str) -> str:
    """A PNG timeline per report (XLA's estimate): compute row, one row per collective
    stream (async windows start..done as bars colored by kind), sync collectives hatched."""
    from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    from matplotlib.patches import Patch

    reports = list(reports)
    heights = []
    for r in reports:
        timed = [c for c in r.collectives if c.start_s is not None and c.end_s is not None]
        heights.append(2 + len(set(_streams([c for c in timed if c.is_async]))) if timed else 2)
    fig = Figure(figsize=(12, sum(0.5 * h + 1.2 for h in heights) or 2))
    axes = fig.subplots(max(len(reports), 1), 1, squeeze=False)
    kinds = set()
    for ax, r in zip(axes[:, 0], reports):
        timed = [c for c in r.collectives if c.start_s is not None and c.end_s is not None]
        ax.set_title(
            f"{r.label} [{r.target or r.platform}]  step {_us(r.step_s)} us, exposed comm {_us(r.exposed_comm_s)} us",
            fontsize=9,
        )
        if not r.compute and not timed:
            ax.text(
                0.5,
                0.5,
                f"no schedule estimate ({len(r.collectives)} collectives, {r.num_async} async)"
                + ("; step from XLA's instruction costs" if r.estimate_source == ESTIMATE_FROM_INSTRUCTIONS else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        ax.broken_barh([(s * 1e6, max((e - s) * 1e6, 1e-3)) for _, s, e in r.compute], (0, 0.8), color="0.55")
        labels = ["compute"]
        async_w = [c for c in timed if c.is_async]
        rows = _streams(async_w)
        for c, row in zip(async_w, rows):
            kinds.add(c.kind)
            ax.broken_barh(
                [(c.start_s * 1e6, max((c.end_s - c.start_s) * 1e6, 1e-3))],
                (row + 1, 0.8),
                facecolor=_KIND_COLORS.get(c.kind, "tab:gray"),
                alpha=0.8,
                edgecolor="white",
                linewidth=0.8,
            )
        n_rows = (max(rows) + 1) if rows else 0
        labels += [f"comm {k}" for k in range(n_rows)]
        sync_w = [c for c in timed if not c.is_async]
        if sync_w:
            y = n_rows + 1
            for c in sync_w:
                kinds.add(c.kind)
                ax.broken_barh(
                    [(c.start_s * 1e6, max((c.end_s - c.start_s) * 1e6, 1e-3))],
                    (y, 0.8),
                    facecolor="white",
                    edgecolor=_KIND_COLORS.get(c.kind, "tab:gray"),
                    hatch="xx",
                )
            labels.append("sync")
        ax.set_yticks([k + 0.4 for k in range(len(labels))], labels, fontsize=8)
        ax.set_xlabel("time (us, XLA estimate)")
    handles = [Patch(color=_KIND_COLORS.get(k, "tab:gray"), label=k) for k in sorted(kinds)]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="xx", label="synchronous"))
    fig.legend(handles=handles, loc="lower right", fontsize=8, ncol=len(handles))
    fig.suptitle(ESTIMATOR, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    return path


# -- steps, not programs ---------------------------------------------------------------------
PLAIN_LABEL = "plain (XLA defaults)"


def describe_mesh(mesh) -> str:
    """``"gpu: 8 x NVIDIA H100 80GB HBM3 over 2 hosts"``: what a program was compiled for."""
    devices = list(mesh.devices.flat)
    first = devices[0]
    hosts = len({d.process_index for d in devices})
    slices = num_slices(devices)
    where = f" over {hosts} hosts" if hosts > 1 else ""
    where += f", {slices} slices" if slices > 1 else ""
    return f"{first.platform}: {len(devices)} x {getattr(first, 'device_kind', first.platform)}{where}"


def inspect_jitted(
    fn,
    args: Sequence[Any],
    mesh,
    *,
    label: str = PLAIN_LABEL,
    compiler_options: dict | None = None,
    estimate: bool = True,
) -> CompiledReport:
    """Compile ``fn`` (jitted or not) on ``args`` (arrays or ``jax.ShapeDtypeStruct`` with
    shardings) with only ``compiler_options`` (default: XLA's own defaults) and report it.
    This is how a user's step is judged as XLA compiles it alone. Where XLA writes no
    schedule (XLA:TPU on one slice with its defaults), ``estimate`` adds an estimate from
    XLA's instruction costs (`estimate_from_instruction_costs`)."""
    import jax

    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    return inspect_lowered(
        jitted.trace(*args).lower(),
        mesh,
        label=label,
        target=describe_mesh(mesh),
        compiler_options=compiler_options,
        estimate=estimate,
    )


def ratios(report: CompiledReport, base: CompiledReport | None) -> dict[str, float | None]:
    """``report``'s estimated step and exposed communication over ``base``'s (None where
    either has no estimate)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {
        "step": ratio(report.step_s, base and base.step_s),
        "exposed_comm": ratio(report.exposed_comm_s, base and base.exposed_comm_s),
    }


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What ``Scheduled.inspect`` returns.

    Attributes:
      report: the scheduled step as compiled (the engine's per-target options, in
        ``report.compiler_options``).
      baseline: the user's step unchanged, compiled with XLA's default options (None when
        not asked for). Where XLA writes no schedule for it (XLA:TPU on one slice), its
        estimate comes from XLA's instruction costs (``baseline.estimate_source``), and
        `ratios` compare the two kinds of estimate.
    """

    report: CompiledReport
    baseline: CompiledReport | None = None

    def ratios(self) -> dict[str, float | None]:
        """Estimated step and exposed communication as ratios to the baseline's."""
        return ratios(self.report, self.baseline)

    def table(self) -> str:
        """The baseline (when there is one) and the scheduled step, ratios to the baseline."""
        shown = [self.report] if self.baseline is None else [self.baseline, self.report]
        return format_table(shown, baseline=self.baseline)

    def plot(self, path: str) -> str:
        return plot([r for r in (self.baseline, self.report) if r is not None], path)

    def to_json(self) -> dict:
        return {
            "report": self.report.to_json(),
            "baseline": None if self.baseline is None else self.baseline.to_json(),
            "ratio_to_baseline": self.ratios(),
        }

    def __str__(self) -> str:
        return self.table()
