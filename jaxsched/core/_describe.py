"""Short descriptions of a step's pytrees for error messages: never a tree dump.

A refusal that prints a ``PyTreeDef`` of a Flax ``TrainState`` runs to kilobytes; what a user
needs is how many outputs came back and what each one is.

Example:
    >>> import numpy as np
    >>> describe({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    'dict of 2 leaves'
    >>> describe(np.zeros((2, 3), np.float32)), describe(None)
    ('float32[2,3]', 'None')
    >>> describe_outputs((np.zeros(2, np.float32), {"loss": np.float32(0)}))
    '2 outputs (float32[2], dict of 1 leaf)'
    >>> difference({"w": 0, "b": 0}, {"w": 0, "extra": 0})
    'extra leaves extra and no leaves b'
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["describe", "describe_outputs", "difference"]


def describe(tree: Any) -> str:
    """One pytree in a few words: an array's dtype and shape, a container's type and leaf count."""
    if tree is None:
        return "None"
    if hasattr(tree, "shape") and hasattr(tree, "dtype") and not isinstance(tree, (tuple, list, dict)):
        dtype = tree.dtype
        name = "key<fry>" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else str(dtype)
        return f"{name}[{','.join(str(d) for d in tree.shape)}]"
    if isinstance(tree, (int, float, bool, complex)):
        return type(tree).__name__
    n = len(jax.tree.leaves(tree))
    return f"{type(tree).__name__} of {n} lea{'f' if n == 1 else 'ves'}"


def describe_outputs(out: Any) -> str:
    """What a step returned: ``3 outputs (TrainState of 8 leaves, key<fry>[], dict of 2 leaves)``."""
    if isinstance(out, (tuple, list)):
        return f"{len(out)} output{'s' if len(out) != 1 else ''} ({', '.join(describe(x) for x in out)})"
    return f"1 output ({describe(out)})"


def _path_name(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path) or "(root)"


def difference(expected: Any, got: Any, shown: int = 3) -> str:
    """Where two trees differ, by leaf path: the paths only ``got`` has and those only
    ``expected`` has (a few of each), or their container types when the paths agree."""
    paths = lambda t: [_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
    want, have = paths(expected), paths(got)
    extra = [p for p in have if p not in want]
    missing = [p for p in want if p not in have]
    if not extra and not missing:
        return f"a {type(got).__name__} where a {type(expected).__name__} was expected"
    cut = lambda xs: ", ".join(xs[:shown]) + (f", ... {len(xs) - shown} more" if len(xs) > shown else "")
    parts = ([f"extra leaves {cut(extra)}"] if extra else []) + ([f"no leaves {cut(missing)}"] if missing else [])
    return " and ".join(parts)
