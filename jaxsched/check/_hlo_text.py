"""Reading XLA's HLO text: computations, instructions, shapes, replica groups.

A regular-expression reader for what ``compiled.as_text()`` prints, enough for the
inspection (`jaxsched.check._inspection`): each instruction's name, shape, opcode,
operands and attributes, by computation, in program order.

>>> mod = _parse_hlo('''
... ENTRY %main (p: f32[8]) -> f32[8] {
...   %p = f32[8]{0} parameter(0)
...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
... }''')
>>> ins = mod.computations[mod.entry][-1]
>>> (ins.opcode, ins.operands, _shape_bytes(ins.shape), _replica_groups(ins.attrs))
('all-reduce', ['p'], 32, [[0, 1], [2, 3]])
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from jaxsched._errors import JaxschedValueError

#: A mesh whose axes name the collectives' replica groups: real devices or abstract ones.
MeshLike = Mesh | AbstractMesh


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
    #: the text between the opcode's parentheses (a constant's literal)
    args: str = ""

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
    return _Instr(m.group(2), shape, opcode, operands, line[end:], bool(m.group(1)), line[k + 1 : end - 1])


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


def _mesh_axes(groups: list[list[int]] | None, mesh: MeshLike | None) -> tuple[str, ...]:
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
