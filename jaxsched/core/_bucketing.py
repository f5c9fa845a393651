"""Which gradients travel together: buckets of parameter leaves for the transform.

A bucket pairs parameter leaves with their gradient reductions, in order of gradient
completion (the order backward produces them). ``buckets=None`` fills buckets up to
25 MB; an int is a byte threshold; a list of lists of parameter paths, or subtree
prefixes of them (``"hidden"`` for every ``hidden/...`` leaf), is an explicit plan.
Buckets never mix dtypes. (Cost-model planners live in `jaxsched.plan`.)

Example:
    >>> param_paths({"dense": {"kernel": 0, "bias": 0}})
    ['dense/bias', 'dense/kernel']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched._errors import JaxschedValueError
from jaxsched.core._analyze import Analysis

__all__ = [
    "Bucket",
    "bucket_nbytes",
    "DEFAULT_BUCKET_BYTES",
    "is_float",
    "match_reductions",
    "param_paths",
    "plan_buckets",
    "shape_key",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Attributes:
    params: parameter leaf indices, in gradient-completion order.
    reductions: indices into ``Analysis.reductions`` reduced together.
    """

    params: tuple[int, ...]
    reductions: tuple[int, ...]


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_paths(params: Any) -> list[str]:
    """``a/b/0/kernel``-style names of every parameter leaf, in tree order: the names
    explicit bucket plans and error messages use.

    Args:
      params: the parameter pytree.

    Returns:
      One ``/``-joined path per leaf.

    Example:
        >>> from jaxsched.plan import param_paths
        >>> param_paths({"dense": {"kernel": 1, "bias": 2}, "layers": [3]})
        ['dense/bias', 'dense/kernel', 'layers/0']
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return ["/".join(_key_name(k) for k in path) for path, _ in flat]


def match_reductions(analysis: Analysis) -> list[int | None]:
    """For each parameter leaf, the reduction of its gradient (by shape and order).

    Matching only decides grouping; results stay exact whatever it decides, because the
    update is rewritten variable by variable.
    """
    cap = analysis.captured
    shapes = []
    for i in range(cap.num_params):
        k = cap.body_input("params", i)
        aval = cap.body.invars[k].aval if k >= 0 else None
        trainable = aval is not None and is_float(aval.dtype)  # keys, counters: never matched
        shapes.append((shape_key(aval.shape), aval.dtype) if aval is not None and trainable else None)
    reds = analysis.reductions
    match: list[int | None] = [None] * cap.num_params
    # a parameter's reduced gradient has its shape (a sharded parameter's: its block's)
    if len(reds) == cap.num_params and all(
        shapes[i] == (shape_key(r.result.aval.shape), r.operand.aval.dtype) for i, r in enumerate(reds)
    ):
        return list(range(cap.num_params))
    taken = set()
    for i, shape in enumerate(shapes):
        for j, r in enumerate(reds):
            if j not in taken and shape is not None and shape_key(r.result.aval.shape) == shape[0]:
                match[i] = j
                taken.add(j)
                break
    return match


def shape_key(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape without its unit axes, what a parameter and its reduced gradient share: a
    pmap step squeezes every mapped input's leading device axis before forward, and under
    ``check_vma`` a bias gradient is reduced as the ``(1, n)`` sum of its cotangent."""
    return tuple(int(d) for d in shape if d != 1)


def is_float(dtype) -> bool:
    """Whether leaves of ``dtype`` can be bucketed (typed PRNG keys, integers and booleans
    pass through unbucketed and unsharded)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def plan_buckets(analysis: Analysis, paths: Sequence[str], buckets: Any = None) -> list[Bucket]:
    """Group parameters (and their reductions) into buckets.

    Only parameters whose gradient is reduced are bucketed; every other leaf (a typed key,
    a step counter, a frozen or per-device tensor) passes through as it is.
    """
    cap = analysis.captured
    match = match_reductions(analysis)
    reds = analysis.reductions
    ready = [reds[m].ready_at if m is not None else 10**9 for m in match]
    order = sorted((i for i in range(cap.num_params) if match[i] is not None), key=lambda i: (ready[i], -i))
    dtype_of = lambda i: cap.body.invars[cap.body_input("params", i)].aval.dtype
    nbytes = (
        lambda i: int(np.prod(cap.body.invars[cap.body_input("params", i)].aval.shape)) * np.dtype(dtype_of(i)).itemsize
    )

    if isinstance(buckets, (list, tuple)):
        groups = [[i for i in group if match[i] is not None] for group in _explicit_groups(buckets, paths)]
        groups = [g for g in groups if g]
    else:
        if buckets is None:
            threshold = DEFAULT_BUCKET_BYTES
        elif isinstance(buckets, int) and not isinstance(buckets, bool) and buckets > 0:
            threshold = buckets
        else:
            raise JaxschedValueError(
                f"buckets={buckets!r} is not understood; pass None (25 MB), a positive "
                "byte threshold, or a list of lists of parameter paths"
            )
        groups, size = [], 0
        current: list[int] = []
        for i in order:
            if current and (size + nbytes(i) > threshold or dtype_of(i) != dtype_of(current[-1])):
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes(i)
        if current:
            groups.append(current)

    result = []

    def grad_dtype(i: int) -> np.dtype | None:
        m = match[i]
        return None if m is None else np.dtype(reds[m].operand.aval.dtype)

    def form(i: int) -> tuple | None:
        m = match[i]
        return None if m is None else reds[m].form

    for group in groups:
        # Split by dtype (of the parameter and of its gradient): one collective moves one
        # dtype; and by form: gradients scattered into parameter blocks travel apart.
        by_dtype: dict = {}
        for i in group:
            by_dtype.setdefault((np.dtype(dtype_of(i)), grad_dtype(i), form(i)), []).append(i)
        for members in by_dtype.values():
            result.append(Bucket(tuple(members), tuple(match[i] for i in members if match[i] is not None)))
    matched = {m for m in match if m is not None}
    for j in range(len(reds)):
        if j not in matched:
            result.append(Bucket((), (j,)))
    # Gradient-completion order: a bucket is complete when its last gradient is.
    complete = lambda b: max((reds[j].ready_at for j in b.reductions), default=10**9)
    return sorted(result, key=complete)


def bucket_nbytes(analysis: Analysis, bucket: Bucket) -> int:
    """Bytes per device that ``bucket``'s collective moves: its reductions' operands."""
    return sum(
        int(np.prod(analysis.reductions[j].operand.aval.shape))
        * np.dtype(analysis.reductions[j].operand.aval.dtype).itemsize
        for j in bucket.reductions
    )


def _explicit_groups(plan: Sequence[Sequence[Any]], paths: Sequence[str]) -> list[list[int]]:
    index = {p: i for i, p in enumerate(paths)}
    seen: dict[int, int] = {}
    groups = []
    for b, group in enumerate(plan):
        if isinstance(group, str):
            raise JaxschedValueError(f"buckets[{b}] is the string {group!r}; each bucket is a list of paths")
        members = []
        for name in group:
            key = (name if isinstance(name, str) else "/".join(map(str, name))).rstrip("/")
            matched = [index[key]] if key in index else [i for i, p in enumerate(paths) if p.startswith(key + "/")]
            if not matched:
                raise JaxschedValueError(
                    f"buckets[{b}] names unknown parameter {key!r}; give a path or a "
                    f"subtree prefix of one (known paths: {', '.join(paths)})"
                )
            for i in matched:
                if i in seen:
                    raise JaxschedValueError(f"parameter {paths[i]!r} is in buckets[{seen[i]}] and buckets[{b}]")
                seen[i] = b
                members.append(i)
        if members:
            groups.append(members)
    missing = [paths[i] for i in range(len(paths)) if i not in seen]
    if missing:
        raise JaxschedValueError(
            f"the bucket plan leaves out parameters {', '.join(missing)}; every parameter must be in exactly one bucket"
        )
    return groups
