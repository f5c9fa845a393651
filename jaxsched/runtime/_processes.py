"""Agreement across processes: every process must build the same program.

The values travel through jax.distributed's key-value store, not through an XLA
collective. A collective program of its own, run on the devices of the step while a step's
collectives may still be in flight on other local devices (the host engine's), would share
the processes' connections with them; processes that reach it at different moments would
then pair it with another collective.

Example:
    >>> agree_across_processes([1.5, 2.0])  # one process: unchanged
    array([1.5, 2. ])
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import numpy as np

from jaxsched._errors import JaxschedRuntimeError

__all__ = ["agree_across_processes", "AGREEMENT_TIMEOUT_S"]

#: How long a process waits for process 0's values (process 0 may still be compiling).
AGREEMENT_TIMEOUT_S = 600.0


def _store_client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def agree_across_processes(values: Sequence[float]) -> np.ndarray:
    """Process 0's ``values`` on every process (unchanged with one process).

    Measurements differ a little between processes; whatever a plan is computed from must
    be identical everywhere, or processes would build different programs and their
    collectives would never match. Every process must call it the same number of times,
    in the same order (the n-th call of each reads process 0's n-th values).
    """
    mine = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return mine
    client = _store_client()
    if client is None:  # processes set up without jax.distributed: only a collective can agree
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(mine), np.float64)
    process = jax.process_index()
    call = int(client.key_value_increment(f"jaxsched/agree/calls/{process}", 1))
    key = f"jaxsched/agree/{call}"
    if process == 0:
        client.key_value_set(key, json.dumps([float(v) for v in mine.ravel()]))
    try:
        raw = client.blocking_key_value_get(key, int(AGREEMENT_TIMEOUT_S * 1000))
    except Exception as err:  # the store's timeout, or a coordinator that went away
        raise JaxschedRuntimeError(
            f"process {process}: process 0's measurement number {call} did not arrive within "
            f"{AGREEMENT_TIMEOUT_S:g} s ({type(err).__name__}); process 0 stopped, or the "
            "processes plan different steps (every process must schedule the same steps in "
            "the same order)"
        ) from None
    agreed = np.asarray(json.loads(raw), np.float64)
    if agreed.size != mine.size:
        raise JaxschedRuntimeError(
            f"process {process}: process 0's measurement number {call} has {agreed.size} "
            f"values, this process's {mine.size}: the processes plan different steps (every "
            "process must schedule the same steps in the same order)"
        )
    return agreed.reshape(mine.shape)
