"""How the processes agree on one re-planning decision: each publishes its estimate in
jax.distributed's key-value store and all take the slowest, so every process decides the
same from the same numbers. A lost, unreadable or out-of-step message raises
`ReplanAgreementError`, never a hang.

Example:
    >>> slowest([{"all_reduce": (1e-4, 1e-9)}, {"all_reduce": (2e-4, 5e-10)}])
    {'all_reduce': CollectiveCost(alpha_s=0.0002, beta_s_per_byte=1e-09)}
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Protocol, Sequence

from jaxsched._errors import JaxschedValueError
from jaxsched.pipeline.replan._options import ReplanAgreementError
from jaxsched.sim._costmodel import CollectiveCost

__all__ = ["agree", "KeyValueStore", "slowest", "Store"]


class Store(Protocol):
    """What `agree` needs of a key-value store (`KeyValueStore`, or a fake in tests)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout_s: float) -> str: ...


class KeyValueStore:
    """jax.distributed's key-value store: what the processes exchange their estimates
    through, with a timeout (a collective would hang on a lost message)."""

    def __init__(self, client: Any = None):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        if client is None:
            raise ReplanAgreementError(
                "re-planning across processes needs jax.distributed."
                "initialize() (its key-value store carries the agreement)"
            )
        self.client = client

    def set(self, key: str, value: str) -> None:
        self.client.key_value_set(key, value)

    def get(self, key: str, timeout_s: float) -> str:
        return self.client.blocking_key_value_get(key, int(timeout_s * 1000))

    def count(self, key: str) -> int:
        """1, 2, ... on successive calls with ``key`` (this process's own counter in the
        store): schedules made in the same order on every process get the same number."""
        return int(self.client.key_value_increment(key, 1))


def agree(
    store: Store, prefix: str, round_: int, message: Mapping[str, Any], processes: int, process: int, timeout_s: float
) -> list[dict]:
    """Publish this process's ``message`` for ``round_`` and read every process's (its own
    included, so a message lost on the way fails here too); each must name the same round
    and step. Raises `ReplanAgreementError` naming the process and why."""
    body = dict(message, round=round_, process=process)
    store.set(f"{prefix}/{round_}/{process}", json.dumps(body, sort_keys=True))
    received = []
    for p in range(processes):
        key = f"{prefix}/{round_}/{p}"
        try:
            raw = store.get(key, timeout_s)
        except Exception as err:  # the store's timeout or a dead coordinator
            raise ReplanAgreementError(
                f"process {process}: no re-planning message from process {p} for round {round_} "
                f"(step {message['step']}) within {timeout_s:g} s ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); a process stopped, lost its "
                "message, or is at another step, so no process switches plans"
            ) from None
        try:
            got = json.loads(raw)
            if not isinstance(got, dict) or got.get("process") != p or got.get("round") != round_:
                raise JaxschedValueError("wrong round or process")
        except ValueError:
            raise ReplanAgreementError(
                f"process {process}: the re-planning message of process {p} for round {round_} "
                f"(step {message['step']}) is unreadable: {raw[:80]!r}"
            ) from None
        if got.get("step") != message["step"] or got.get("plan") != message.get("plan"):
            raise ReplanAgreementError(
                f"process {process}: processes disagree on the re-planning point: process {p} "
                f"is at step {got.get('step')} with plan {got.get('plan')}, process {process} at "
                f"step {message['step']} with plan {message.get('plan')}; no process switches"
            )
        received.append(got)
    return received


def slowest(estimates: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, CollectiveCost]:
    """Per collective, the largest α and β any process measured: a collective runs at the
    pace of its slowest member, and every process computes the same result."""
    names = sorted({n for e in estimates for n in e})
    return {
        n: CollectiveCost(max(e[n][0] for e in estimates if n in e), max(e[n][1] for e in estimates if n in e))
        for n in names
    }
