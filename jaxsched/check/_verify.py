"""``Scheduled.verify``: the plain and the scheduled step side by side, on the user's data.

The first thing to reach for when you suspect the transform. For ``steps`` batches it runs

* the user's own step (the reference),
* the scheduled step,
* and a **rounding baseline**: the user's step again, from parameters nudged by ``P``
  float roundings (relative ``P * eps``, ``P`` the number of devices): what reordering a
  sum of ``P`` per-device terms can change, which is all a synchronous strategy does.

Training amplifies rounding: in float32 a one-ulp nudge of a small CNN's parameters grew
to a 665% difference in some leaves after 300 steps, so a tolerance scaled by a float32
baseline would pass anything. By default all three runs are therefore made in **float64**
(``jax.enable_x64``, the user's float32 leaves widened; the step is traced again): there a
reordered sum differs by about 1e-16 and chaos needs far more steps to bring that to 1e-5,
while a real defect (gradients sent in bfloat16, a learning rate off by 1e-4 relative)
shows at once. A step that cannot run in float64 is compared in float32, with a warning
that says why.

Some training is chaotic even in float64 (the digits CNN at learning rate 0.05: a nudge of
8 float64 roundings grows to O(1) within 300 steps), and chaos may reach one leaf long
before the others (an attention bias whose gradient is zero, so that Adam normalises
noise). So **each leaf is judged on its own**: its gap against ``max(rtol,
baseline_factor * its baseline)`` at every step while its own baseline is within
``rtol``; once that baseline has left ``rtol`` the leaf is *chaotic*, and fails only if its
scheduled gap left ``rtol`` clearly before its baseline did (before half that step): a
defect leaves early, a reordered sum leaves with the baseline. The other leaves are still
compared. The report gives, per leaf, the largest relative difference between the
scheduled and the plain run, the same for the baseline, and its status (ok, chaotic from
step t, or differs at step t).

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    >>> rng = jax.random.PRNGKey(0)
    >>> batches = [steps.shard_batch((jax.random.normal(rng, (4, 4)), jax.numpy.zeros(4, "int32")), mesh)] * 3
    >>> report = sched.verify(sched.init(params, tx.init(params)), batches, steps=3)
    >>> report.ok, report.first_divergent_step
    (True, None)
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched._errors import JaxschedValueError
from jaxsched.core import _static_leaves as static_leaves

__all__ = ["PRECISIONS", "relative_gap", "verify", "VerifyReport"]


@dataclasses.dataclass
class VerifyReport:
    """What [`verify`][jaxsched.check._verify.verify] found.

    Attributes:
      strategy: the scheduled strategy's name.
      steps: steps compared.
      rtol, baseline_factor: the tolerance is ``max(rtol, baseline_factor * baseline)``.
      leaf_gap: per leaf (``params/...``, ``opt_state/...``, ``aux/...``), the largest
        relative difference between scheduled and plain over all steps.
      baseline_gap: the same between the nudged plain run and the plain run.
      step_gap, step_baseline: per step, the largest gap over all leaves.
      first_divergent_step: the step (1-based) the verdict fails at, or None: the earliest
        step at which a leaf left its tolerance while its baseline was within ``rtol``, or
        at which a chaotic leaf's scheduled run left ``rtol`` clearly before its baseline
        (before half the baseline's step).
      worst_leaf: the leaf with the largest gap.
      precision: what every run was computed in (``float64`` unless the step cannot).
      scheduled_left_rtol, baseline_left_rtol: the first step at which a leaf's gap of the
        scheduled run (a leaf's baseline, of the leaves not found divergent) exceeded
        ``rtol``, or None.
      leaf_chaotic_from: per chaotic leaf, the step its baseline left ``rtol``.
      leaf_divergent_at: per divergent leaf, the step it left its tolerance.
      leaf_misplaced: per leaf the scheduled step returned with another sharding than the
        plain step's (or off the mesh), the two shardings: a wrong layout fails the verdict
        as a wrong value does.
      replicated_gap: where the verdict fails, a third opinion at the first divergent step:
        the plain step run again from replicated copies of the same parameters and optimizer
        state (a program XLA partitions otherwise), per divergent leaf its relative difference
        ``(from the scheduled run, from the plain run)``. XLA's partitioning of the plain
        step can itself be wrong; when this run sides with the scheduled one, suspect it.
      replicated_error: why that third run could not be made (a step that takes its state
        sharded only, as pmap does), else None.

    Example:
        >>> report = VerifyReport(
        ...     strategy="wfbp", steps=2, rtol=1e-5, baseline_factor=100.0,
        ...     leaf_gap={"params/w": 3e-9}, baseline_gap={"params/w": 1e-9},
        ...     step_gap=[3e-9, 2e-9], step_baseline=[1e-9, 1e-9],
        ...     first_divergent_step=None, worst_leaf="params/w")
        >>> report.ok, report.status("params/w")
        (True, 'ok')
    """

    strategy: str
    steps: int
    rtol: float
    baseline_factor: float
    leaf_gap: dict[str, float]
    baseline_gap: dict[str, float]
    step_gap: list[float]
    step_baseline: list[float]
    first_divergent_step: int | None
    worst_leaf: str
    precision: str = "float32"
    scheduled_left_rtol: int | None = None
    baseline_left_rtol: int | None = None
    leaf_chaotic_from: dict[str, int] = dataclasses.field(default_factory=dict)
    leaf_divergent_at: dict[str, int] = dataclasses.field(default_factory=dict)
    leaf_misplaced: dict[str, str] = dataclasses.field(default_factory=dict)
    replicated_gap: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    replicated_error: str | None = None

    def tolerance(self, leaf: str) -> float:
        """The gap ``leaf`` is held to while its baseline is within ``rtol``.

        Example:
            >>> report = VerifyReport("wfbp", 1, 1e-5, 100.0, {"params/w": 0.0}, {"params/w": 1e-6},
            ...                       [0.0], [1e-6], None, "params/w")
            >>> f"{report.tolerance('params/w'):.0e}"  # 100 x its baseline, above rtol
            '1e-04'
        """
        return max(self.rtol, self.baseline_factor * self.baseline_gap.get(leaf, 0.0))

    def _third_opinion(self) -> list[str]:
        """The report's lines on the replicated run (none where the verdict holds)."""
        if self.first_divergent_step is None:
            return []
        if self.replicated_error is not None:
            return [f"  (no third opinion: the plain step from a replicated state raised {self.replicated_error})"]
        if not self.replicated_gap:
            return []
        t = self.first_divergent_step
        lines = [f"  A third run, the plain step from replicated copies of the same state, at step {t}:"]
        for name, (from_scheduled, from_plain) in self.replicated_gap.items():
            lines.append(
                f"    {name}: {from_scheduled:.2e} from the scheduled run, {from_plain:.2e} from the plain run"
            )
        agrees = [
            from_scheduled <= self.tolerance(name) < from_plain
            for name, (from_scheduled, from_plain) in self.replicated_gap.items()
        ]
        if all(agrees):
            lines.append(
                "  It sides with the scheduled run: the plain step computes otherwise when XLA "
                "partitions it over the sharded state. Suspect XLA's partitioning of the plain step "
                "(compare it with a run on one device) before the schedule."
            )
        elif not any(agrees):
            lines.append("  It does not side with the scheduled run.")
        return lines

    @property
    def ok(self) -> bool:
        return self.first_divergent_step is None and not self.leaf_misplaced

    @property
    def divergent_leaves(self) -> list[str]:
        """The leaves that left their tolerance, earliest first."""
        return sorted(self.leaf_divergent_at, key=lambda k: (self.leaf_divergent_at[k], k))

    @property
    def chaotic_leaves(self) -> list[str]:
        """The leaves whose rounding baseline left ``rtol`` (training's chaos reached them):
        judged up to that step, and after it only by whether the scheduled run left ``rtol``
        clearly earlier."""
        return sorted(self.leaf_chaotic_from, key=lambda k: (self.leaf_chaotic_from[k], k))

    def status(self, leaf: str) -> str:
        """One leaf's verdict, as the report's table shows it.

        Args:
          leaf: a leaf's name as in `leaf_gap` (``params/...``, ``opt_state/...``, ``aux/...``).

        Returns:
          ``"ok"``, ``"chaotic from step t"`` or ``"differs at step t"``.

        Example:
            >>> report = VerifyReport("wfbp", 3, 1e-5, 100.0, {"params/w": 0.5}, {"params/w": 0.0},
            ...                       [0.5] * 3, [0.0] * 3, 2, "params/w", leaf_divergent_at={"params/w": 2})
            >>> report.status("params/w")
            'differs at step 2'
        """
        if leaf in self.leaf_divergent_at:
            return f"differs at step {self.leaf_divergent_at[leaf]}"
        if leaf in self.leaf_chaotic_from:
            return f"chaotic from step {self.leaf_chaotic_from[leaf]}"
        return "ok"

    def __str__(self) -> str:
        if self.first_divergent_step is not None:
            leaves = self.divergent_leaves
            verdict = (
                f"differ: {leaves[0]} left its tolerance at step {self.first_divergent_step}"
                + (f" ({len(leaves) - 1} more leaves later)" if len(leaves) > 1 else "")
                + ", while its rounding baseline stayed within rtol (rounding cannot explain it)"
            )
        elif not self.leaf_chaotic_from:
            verdict = f"agree for all {self.steps} steps"
        else:
            chaotic = self.chaotic_leaves
            verdict = (
                f"agree for all {self.steps} steps; {len(chaotic)} of {len(self.leaf_gap)} leaves are "
                f"chaotic (their rounding baseline left rtol, the first at step "
                f"{self.leaf_chaotic_from[chaotic[0]]}), and those did not leave rtol clearly before "
                "their baseline did"
            )
        if self.leaf_misplaced:
            name = sorted(self.leaf_misplaced)[0]
            verdict += (
                f"; but {len(self.leaf_misplaced)} leaves come back placed unlike the plain step's "
                f"({name}: {self.leaf_misplaced[name]})"
            )
        lines = [
            f"jaxsched verify ({self.strategy}, {self.steps} steps, all runs in {self.precision}): "
            f"scheduled and plain {verdict}. Each leaf is judged on its own: its largest relative "
            f"difference against max(rtol {self.rtol:g}, {self.baseline_factor:g} x the same for the "
            "plain step from parameters nudged by P roundings), while that baseline is within rtol.",
            f"  {'leaf':<40} {'max rel diff':>13} {'baseline':>10}  status",
        ]
        flagged = [k for k in self.leaf_gap if k in self.leaf_divergent_at or k in self.leaf_chaotic_from]
        order = flagged + sorted((k for k in self.leaf_gap if k not in flagged), key=lambda k: -self.leaf_gap[k])
        shown = max(12, len(flagged[:40]))
        for name in order[:shown]:
            lines.append(
                f"  {name:<40} {self.leaf_gap[name]:13.2e} {self.baseline_gap.get(name, 0):10.2e}  {self.status(name)}"
            )
        rest = order[shown:]
        if rest:
            largest = max(self.leaf_gap[k] for k in rest)
            tail = "all equal" if largest == 0 else f"each at most {largest:.2e}"
            lines.append(f"  ... {len(rest)} more leaves, {tail}")
        return "\n".join(lines + self._third_opinion())


def _placed_unlike(value: Any, reference: Any) -> str | None:
    """How ``value`` is placed unlike the plain step's ``reference`` (None: alike), for a
    reference on several devices."""
    if not isinstance(reference, jax.Array) or len(reference.sharding.device_set) < 2:
        return None
    if not isinstance(value, jax.Array):
        return f"a host {type(value).__name__}, not a jax.Array as {reference.sharding}"
    if value.sharding.is_equivalent_to(reference.sharding, reference.ndim):
        return None
    return f"{value.sharding}, where the plain step's is {reference.sharding}"


def _named_leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(prefix + jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def relative_gap(a: Any, b: Any) -> float:
    """The largest difference between two arrays, relative to the second's largest magnitude.

    Args:
      a: an array (or anything ``numpy.asarray`` takes).
      b: the reference, of ``a``'s shape.

    Returns:
      ``max|a - b| / max|b|``: 0 for equal values; for non-float values, 0 if equal, else inf.

    Example:
        >>> import numpy as np
        >>> relative_gap(np.array([1.0, 2.1]), np.array([1.0, 2.0]))
        0.05...
        >>> relative_gap(np.zeros(3), np.zeros(3))
        0.0
    """
    a, b = _host(a), _host(b)
    if a.shape != b.shape:
        return float("inf")
    if not np.issubdtype(b.dtype, np.floating) and b.dtype.name != "bfloat16":
        return 0.0 if np.array_equal(a, b) else float("inf")
    a, b = a.astype(np.float64), b.astype(np.float64)
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)
    return float(np.max(np.abs(a - b))) / scale if b.size else 0.0


def _nudged(tree: Any, roundings: int) -> Any:
    def nudge(x):
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        x = jnp.nextafter(x, jnp.asarray(jnp.inf, x.dtype))  # at least one rounding, zeros too
        return (x * (1 + roundings * jnp.finfo(x.dtype).eps)).astype(x.dtype)

    return jax.tree.map(nudge, tree)


PRECISIONS = ("float64", "float32")


def _widened(tree: Any, placed: bool = False) -> Any:
    """float32 leaves as float64: host arrays (the step places them), or with ``placed``
    on the sharding they had (a batch the user placed, a parameter block sharded over a
    model axis). 16-bit leaves (bfloat16 Adam moments) are a precision the step chose and
    may return them in: they stay as they are."""

    def widen(x):
        if not (hasattr(x, "dtype") and x.dtype == np.float32):
            return x
        wide = np.asarray(_host(x), np.float64)
        on_mesh = isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding)
        return jax.device_put(wide, x.sharding) if placed and on_mesh else wide

    return jax.tree.map(widen, tree)


def _copies(tree: Any) -> Any:
    """``tree`` with a fresh copy of every array (what a donating call may free)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def _without_donation(step: Any) -> Any:
    """``step`` called on copies of its inputs: a step jitted with ``donate_argnums`` deletes
    the buffers it is given, and verify hands the same parameters, optimizer state and
    batches to the plain run, the rounding baseline and the scheduled run."""

    def call(*args: Any) -> Any:
        return step(*_copies(args))

    return call


def _summary(err: BaseException, limit: int = 400) -> str:
    """An error's message on one line, cut at a sentence's end where it is long."""
    text = " ".join(str(err).split())
    if len(text) <= limit:
        return text if text.endswith((".", "!", "?")) else text + "."
    cut = text.rfind(". ", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit].rsplit(" ", 1)[0] + " (...)."


def _finalized(scheduled: Any, state: Any) -> Any:
    """``finalize``'s trees with their non-array leaves as static structure, as the traced
    step takes and returns them (`jaxsched.core._static_leaves`)."""
    return static_leaves.mark(scheduled.finalize(state), scalars_static=scheduled.step.scalars_static)


def verify(
    scheduled: Any,
    state: Any,
    batches: Iterable[Any],
    steps: int = 10,
    rtol: float = 1e-5,
    baseline_factor: float = 100.0,
    precision: str = "float64",
    *,
    progress: bool = False,
) -> VerifyReport:
    """Run the plain step, the scheduled step and the rounding baseline side by side.

    What [`Scheduled.verify`][jaxsched._schedule.Scheduled.verify] calls; the module docstring says how each
    leaf is judged.

    Args:
      scheduled: the [`Scheduled`][jaxsched.Scheduled] step to check (its own step is the reference).
      state: a state from ``scheduled.init``; every run starts from its finalized trees.
      batches: at least ``steps`` batches, placed as the scheduled step takes them.
      steps: how many steps to compare.
      rtol: the relative tolerance a leaf's gap is held to while its baseline is within it.
      baseline_factor: a leaf's tolerance is ``max(rtol, baseline_factor * its baseline)``.
      precision: ``"float64"`` (the default: float32 leaves widened, the step traced again)
        or ``"float32"`` (the step as it is).
      progress: show a bar (lines in a log) over the compared steps.

    Returns:
      A [`VerifyReport`][jaxsched.check._verify.VerifyReport]: ``report.ok`` is the verdict,
      ``str(report)`` the per-leaf table.

    Example:
        >>> import jax, optax
        >>> import jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="allreduce")
        >>> batch = steps.shard_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), mesh)
        >>> report = verify(sched, sched.init(params, tx.init(params)), [batch] * 2, steps=2, precision="float32")
        >>> report.ok, report.steps
        (True, 2)
    """
    if steps < 1:
        raise JaxschedValueError(f"steps={steps} must be >= 1")
    if precision not in PRECISIONS:
        raise JaxschedValueError(f"precision={precision!r}; choose from {', '.join(PRECISIONS)}")
    batches = list(itertools.islice(iter(batches), steps))
    if len(batches) < steps:
        raise JaxschedValueError(f"verify needs {steps} batches, got {len(batches)}")
    params, opt_state = _finalized(scheduled, state)
    if precision == "float64":
        try:
            with jax.enable_x64(True):
                # placed leaves keep their sharding: a tensor-parallel block stays sharded
                return _compare(
                    scheduled.fresh(),
                    _widened(params, placed=True),
                    _widened(opt_state, placed=True),
                    [_widened(b, placed=True) for b in batches],
                    rtol,
                    baseline_factor,
                    "float64",
                    progress,
                )
        except Exception as err:  # the step pins float32 somewhere, a kernel has no float64...
            float64_error = err
        # the step's own error (a batch without the step's extra input) fails in float32 too:
        # it is raised as it is, not after a warning about float64
        report = _compare(scheduled, params, opt_state, batches, rtol, baseline_factor, "float32", progress)
        warnings.warn(
            f"verify could not run the step in float64, so it compared in float32, where "
            f"chaotic training amplifies rounding and the baseline is looser. The float64 run "
            f"raised {type(float64_error).__name__}: {_summary(float64_error)}",
            stacklevel=2,
        )
        return report
    return _compare(scheduled, params, opt_state, batches, rtol, baseline_factor, "float32", progress)


def _compare(
    scheduled: Any,
    params: Any,
    opt_state: Any,
    batches: list,
    rtol: float,
    baseline_factor: float,
    precision: str,
    progress: bool = False,
) -> VerifyReport:
    from jaxsched.core._progress import progress as progress_bar

    steps = len(batches)
    # from copies: a step that donates its state has the scheduled program donate it too
    sched_state = scheduled.init(*_copies((params, opt_state)))
    step = _without_donation(scheduled.traced_step)
    devices = scheduled._program_for(sched_state, batches[0]).planned.axis_size
    plain, nudged = (params, opt_state), (_nudged(params, devices), opt_state)
    leaf_gap: dict[str, float] = {}
    baseline_gap: dict[str, float] = {}
    chaotic_from: dict[str, int] = {}  # leaf -> first step its baseline left rtol
    left_rtol: dict[str, int] = {}  # leaf -> first step its scheduled gap left rtol
    divergent_at: dict[str, int] = {}
    misplaced: dict[str, str] = {}
    step_gap, step_baseline = [], []
    third: tuple[dict[str, tuple[float, float]], str | None] | None = None  # run once, at the first divergence
    shown = progress_bar(
        batches, f"verify {getattr(scheduled.strategy, 'name', '')} ({precision})", enabled=progress, unit="step"
    )
    for t, batch in enumerate(shown, start=1):
        *plain, plain_aux = step(*plain, batch)
        *nudged, nudged_aux = step(*nudged, batch)
        sched_state, sched_aux = scheduled.step_batch(sched_state, batch)
        jax.block_until_ready((plain, nudged, sched_state, sched_aux))
        user_sched = _finalized(scheduled, sched_state)
        reference = (
            _named_leaves("params", plain[0]) + _named_leaves("opt_state", plain[1]) + _named_leaves("aux", plain_aux)
        )
        got = (
            _named_leaves("params", user_sched[0])
            + _named_leaves("opt_state", user_sched[1])
            + _named_leaves("aux", sched_aux)
        )
        base = (
            _named_leaves("params", nudged[0])
            + _named_leaves("opt_state", nudged[1])
            + _named_leaves("aux", nudged_aux)
        )
        worst = worst_base = 0.0
        for (name, ref), (_, value) in zip(reference, got, strict=True):
            if name not in misplaced and (where := _placed_unlike(value, ref)) is not None:
                misplaced[name] = where
        for (name, ref), (_, value), (_, b) in zip(reference, got, base, strict=True):
            gap, bgap = relative_gap(value, ref), relative_gap(b, ref)
            leaf_gap[name] = max(leaf_gap.get(name, 0.0), gap)
            baseline_gap[name] = max(baseline_gap.get(name, 0.0), bgap)
            worst, worst_base = max(worst, gap), max(worst_base, bgap)
            # Each leaf judged on its own, while its own baseline is within rtol: past it,
            # chaos says nothing about the transform for that leaf (an attention bias with a
            # zero gradient, noise under Adam), and the others are still compared.
            if gap > rtol:
                left_rtol.setdefault(name, t)
            if name not in chaotic_from and name not in divergent_at and gap > max(rtol, baseline_factor * bgap):
                divergent_at[name] = t
            if bgap > rtol:
                chaotic_from.setdefault(name, t)
        step_gap.append(worst)
        step_baseline.append(worst_base)
        if divergent_at and third is None:
            now = sorted(name for name, at in divergent_at.items() if at == t)
            third = _replicated_opinion(step, (params, opt_state), batches[:t], dict(reference), dict(got), now)
    for name, chaos in chaotic_from.items():
        # a chaotic leaf fails only when the scheduled run left rtol clearly before its baseline
        if name not in divergent_at and name in left_rtol and left_rtol[name] < chaos / 2:
            divergent_at[name] = left_rtol[name]
    chaotic_from = {k: v for k, v in chaotic_from.items() if k not in divergent_at}
    first = min(divergent_at.values()) if divergent_at else None
    sched_left = min(left_rtol.values()) if left_rtol else None
    base_left = min(chaotic_from.values()) if chaotic_from else None
    worst_leaf = max(leaf_gap, key=lambda name: leaf_gap[name]) if leaf_gap else ""
    return VerifyReport(
        scheduled.strategy.name,
        steps,
        rtol,
        baseline_factor,
        leaf_gap,
        baseline_gap,
        step_gap,
        step_baseline,
        first,
        worst_leaf,
        precision,
        sched_left,
        base_left,
        chaotic_from,
        divergent_at,
        misplaced,
        *(third or ({}, None)),
    )


def _replicated(tree: Any) -> Any:
    """``tree`` with every array on a mesh replicated over that mesh."""

    def replicate(x):
        if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding):
            return jax.device_put(x, jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec()))
        return x

    return jax.tree.map(replicate, tree)


def _replicated_opinion(
    step: Any, start: tuple[Any, Any], batches: list, reference: dict, got: dict, leaves: list[str]
) -> tuple[dict[str, tuple[float, float]], str | None]:
    """The plain step from a replicated ``start`` over ``batches`` (placed as given: a
    ``shard_map`` step takes its batch split only): for each of ``leaves`` its gap from the
    scheduled run's value (``got``) and from the plain run's (``reference``) after the last
    batch; or why it could not run."""
    try:
        state = _replicated(start)
        for batch in batches:
            *state, aux = step(*state, batch)
    except Exception as err:  # a step that only takes its state sharded (pmap), a state off the mesh
        return {}, f"{type(err).__name__}: {_summary(err, 200)}"
    values = dict(_named_leaves("params", state[0]) + _named_leaves("opt_state", state[1]) + _named_leaves("aux", aux))
    return {
        name: (relative_gap(values[name], got[name]), relative_gap(values[name], reference[name])) for name in leaves
    }, None
