"""Agreement across processes: every process must build the same program.

Example:
    >>> agree_across_processes([1.5, 2.0])  # one process: unchanged
    array([1.5, 2. ])
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

__all__ = ["agree_across_processes"]


def agree_across_processes(values: Sequence[float]) -> np.ndarray:
    """Process 0's ``values`` on every process (unchanged with one process).

    Measurements differ a little between processes; whatever a plan is computed from must
    be identical everywhere, or processes would build different programs and their
    collectives would never match.
    """
    mine = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(mine), np.float64)
