"""What `TopK` and `GlobalTopK` share:
the density, error feedback, and Deep Gradient Compression's additions (Lin et al., "Deep
Gradient Compression", ICLR 2018) that keep accuracy from the first steps.

**Warm-up** (``warmup_steps``, ``warmup_density``). Sparse training lags dense training
most at the start, when gradients change fastest. During the first ``warmup_steps`` steps
the density decays exponentially from ``warmup_density`` (default 25 %) to ``density``.
Shapes are static in JAX, so the decay is a staircase of a few *tiers* (DGC itself steps
once per epoch, by a factor of 4): ``warmup_tiers`` levels, by default
``ceil(log4(warmup_density / density))``, tier ``j`` of ``T`` holding for ``warmup_steps / T``
steps at ``warmup_density * (density / warmup_density) ** (j / T)``. The step picks its
tier with ``lax.switch`` on the step count carried in the state; every tier is its own
branch with its own static selection size and exchange buffers, so once warm-up is over
the step moves exactly the bytes of ``density``: warm-up costs nothing afterwards.
The schedule is public: `Sparsifier.density_at`, `Sparsifier.mean_density`,
`Sparsifier.density_levels`; ``bytes_sent`` counts what each step really sent.

**Momentum correction and factor masking** (``momentum``). With momentum SGD on top of a
sparsified gradient, the residual accumulates raw gradients and the optimizer's velocity
sees only the sparse sum: the two disagree (DGC, section 3.2). With ``momentum=m > 0`` the
compressor keeps the velocity itself, per device and bucket, and accumulates *it*:

    u <- m * u + g          (velocity, ``state.velocity``)
    v <- v + u              (accumulator, ``state.residual``)
    send the top entries of v, then zero them in both v and u (factor masking)

so the sum that reaches the optimizer already carries momentum: pair it with an optimizer
**without** momentum, e.g. ``optax.sgd(lr)``, not ``optax.sgd(lr, momentum=0.9)`` (that
would apply momentum twice). The compressor cannot see the optimizer, so this pairing is
documented, not checked. Momentum correction needs ``error_feedback=True``. At
``density=1.0`` every entry is sent and masked every step, so the velocity is cleared each
step and momentum has no effect: that is DGC's rule, not an error.

**Local clipping** (``clip_norm``). Before the gradient enters the velocity (or the
residual), each device scales its bucket's raw local gradient to L2 norm at most
``clip_norm``. The threshold is applied as given, per device and bucket. DGC clips each
node's gradient at ``N ** -0.5`` times the threshold meant for the gradient *summed* over
``N`` nodes; with ``lax.pmean`` (a mean over ``P`` devices) and noise-dominated gradients
the matching local threshold is ``sqrt(P)`` times one meant for the mean.

Example:
    >>> from jaxsched.runtime.compress import TopK
    >>> topk = TopK(0.01, warmup_steps=90)       # 25 % -> 1 % over 90 steps
    >>> [round(d, 4) for d in topk.density_levels()]   # 3 tiers, then the target
    [0.25, 0.0855, 0.0292, 0.01]
    >>> [round(topk.density_at(s), 4) for s in (0, 29, 30, 60, 89, 90, 10_000)]
    [0.25, 0.25, 0.0855, 0.0292, 0.0292, 0.01, 0.01]
    >>> round(topk.mean_density(300), 4)          # warm-up bytes averaged over 300 steps
    0.0435
    >>> topk.sim_compression().density, round(topk.sim_compression(steps=300).density, 4)
    (0.01, 0.0435)
"""

from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.runtime.collectives._base import BucketSpec, Collective
from jaxsched.runtime.compress._base import Compressor, Density, check_density_spec

__all__ = ["DEFAULT_WARMUP_DENSITY", "TIER_FACTOR", "Sparsifier", "sent_mask"]

#: Where the warm-up starts unless ``warmup_density`` says otherwise (DGC: 25 %).
DEFAULT_WARMUP_DENSITY = 0.25
#: Default ratio between consecutive warm-up tiers (DGC: 75 %, 93.75 %, 98.4 %, ... sparsity).
TIER_FACTOR = 4.0

T = TypeVar("T")

#: The carried momentum of a bucket: an array of its flat shape with momentum, else ``()``.
Velocity = jax.Array | tuple[()]


def sent_mask(indices: jax.Array, count: jax.Array, size: int) -> jax.Array:
    """Dense bool mask of the entries sent: the first ``count`` slots of ``indices``
    (slots at or past ``size`` mark nothing), so padded index lists need no masking.

    Args:
      indices: the selected entries' indices, padded to a static length.
      count: how many leading slots are real (a traced scalar).
      size: the bucket's length.

    Returns:
      A ``(size,)`` bool array.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.compress import sent_mask
        >>> sent_mask(jnp.array([3, 1, 0]), jnp.array(2), 5).tolist()
        [False, True, False, True, False]
    """
    valid = jnp.arange(indices.shape[0]) < count
    return jnp.zeros((size,), bool).at[jnp.where(valid, indices, size)].set(True, mode="drop")


def _number(value: Any, owner: str, name: str, rule: str) -> float:
    if isinstance(value, bool):
        raise JaxschedTypeError(f"{owner}({name}={value!r}): {name} must be {rule}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise JaxschedTypeError(f"{owner}({name}={value!r}): {name} must be {rule}") from None


def _count(value: Any, owner: str, name: str, rule: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise JaxschedValueError(f"{owner}({name}={value!r}): {name} must be {rule}")
    return int(value)


class Sparsifier(Compressor):
    """Base of the top-k sparsifiers: density, error feedback, warm-up, momentum
    correction and local clipping (see the module docstring).

    Args:
      density: fraction of each bucket's entries selected per step once warm-up is over,
        in (0, 1]; or one per bucket, or a function of the `BucketSpec` (LAGS).
      error_feedback: keep what was not sent and add it to the next step's gradient.
      inner: the collective that uncompressed operations (parameter all-gathers) go through.
      warmup_steps: steps over which the density decays from ``warmup_density`` to
        ``density``, exponentially, in tiers; 0 (default) turns warm-up off.
      warmup_density: the density of the first warm-up step, in (0, 1]; default
        ``max(0.25, density)``. A bucket whose ``density`` is at least this has no warm-up.
      warmup_tiers: how many density levels the warm-up steps through (each a branch of
        one ``lax.switch``, compiled once); default ``ceil(log4(warmup_density / density))``,
        DGC's factor of 4 between tiers. At most ``warmup_steps``.
      momentum: in [0, 1); above 0, DGC's momentum correction and factor masking, for an
        optimizer **without** momentum (``optax.sgd(lr)``). Needs ``error_feedback=True``.
      clip_norm: if given, each device scales its bucket's local gradient to L2 norm at
        most ``clip_norm`` before accumulating it.

    Example:
        A warm-up from density 0.16 to 0.01 over 4 steps, in tiers of a factor of 4:

        >>> from jaxsched.runtime.compress import TopK
        >>> topk = TopK(0.01, warmup_steps=4, warmup_density=0.16)
        >>> [round(d, 4) for d in topk.density_levels()], topk.density_at(0), topk.density_at(4)
        ([0.16, 0.04, 0.01], 0.16, 0.01)
        >>> round(topk.mean_density(8), 4)
        0.055
    """

    def __init__(
        self,
        density: Density = 0.01,
        error_feedback: bool = True,
        inner: Collective | None = None,
        *,
        warmup_steps: int = 0,
        warmup_density: float | None = None,
        warmup_tiers: int | None = None,
        momentum: float = 0.0,
        clip_norm: float | None = None,
    ):
        super().__init__(inner)
        owner = type(self).__name__
        self.density = check_density_spec(density, owner)
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = _count(
            warmup_steps,
            owner,
            "warmup_steps",
            "an int >= 0 (the steps over which the density decays to `density`; 0 turns warm-up off)",
            0,
        )
        if warmup_density is not None:
            start = _number(warmup_density, owner, "warmup_density", "a number in (0, 1]")
            if not 0.0 < start <= 1.0:
                raise JaxschedValueError(
                    f"{owner}(warmup_density={warmup_density!r}): warmup_density "
                    f"must be in (0, 1] (the density of the first warm-up step, "
                    f"e.g. {DEFAULT_WARMUP_DENSITY})"
                )
            if isinstance(self.density, float) and start < self.density:
                raise JaxschedValueError(
                    f"{owner}(density={self.density}, warmup_density={start}): the "
                    f"warm-up must start at least as dense as it ends; give "
                    f"warmup_density >= density"
                )
            warmup_density = start
        if warmup_tiers is not None:
            warmup_tiers = _count(
                warmup_tiers, owner, "warmup_tiers", "an int >= 1 (the density levels of the warm-up), or None", 1
            )
        if self.warmup_steps == 0 and (warmup_density is not None or warmup_tiers is not None):
            raise JaxschedValueError(
                f"{owner}: warmup_density and warmup_tiers shape a warm-up, but "
                f"warmup_steps=0 turns it off; give warmup_steps > 0 (e.g. 100)"
            )
        self.warmup_density = warmup_density
        self.warmup_tiers = warmup_tiers
        self.momentum = _number(momentum, owner, "momentum", "a number in [0, 1)")
        if not 0.0 <= self.momentum < 1.0:
            raise JaxschedValueError(
                f"{owner}(momentum={momentum!r}): momentum must be in [0, 1) (DGC "
                f"uses 0.9, with an optimizer without momentum such as "
                f"optax.sgd(lr)); 0 turns momentum correction off"
            )
        if self.momentum and not self.error_feedback:
            raise JaxschedValueError(
                f"{owner}(momentum={self.momentum}, error_feedback=False): momentum "
                f"correction accumulates the velocity in the error-feedback "
                f"residual; use error_feedback=True, or momentum=0"
            )
        if clip_norm is not None:
            clip_norm = _number(clip_norm, owner, "clip_norm", "a number > 0, or None")
            if not clip_norm > 0 or not math.isfinite(clip_norm):
                raise JaxschedValueError(
                    f"{owner}(clip_norm={clip_norm!r}): clip_norm must be a finite "
                    f"number > 0 (the largest L2 norm of a device's local gradient "
                    f"per bucket), or None for no clipping"
                )
        self.clip_norm = clip_norm

    def _options_repr(self) -> str:
        parts = [f"density={self.density}", f"error_feedback={self.error_feedback}"]
        if self.warmup_steps:
            parts += [
                f"warmup_steps={self.warmup_steps}",
                f"warmup_density={self.warmup_density or DEFAULT_WARMUP_DENSITY}",
            ]
        if self.warmup_tiers is not None:
            parts.append(f"warmup_tiers={self.warmup_tiers}")
        if self.momentum:
            parts.append(f"momentum={self.momentum}")
        if self.clip_norm is not None:
            parts.append(f"clip_norm={self.clip_norm}")
        return ", ".join(parts)

    # -- the schedule ---------------------------------------------------------------------
    def target_density(self, bucket: BucketSpec | None = None) -> float:
        """The density after warm-up (of ``bucket``; without one, the single float density).

        Args:
          bucket: the bucket (needed when the density differs per bucket).

        Returns:
          The density.

        Example:
            >>> from jaxsched.runtime.compress import TopK
            >>> TopK(0.01, warmup_steps=10).target_density()
            0.01
        """
        if bucket is not None:
            return self.density_of(bucket)
        if not isinstance(self.density, float):
            raise JaxschedValueError(
                f"{type(self).__name__}: the density differs per bucket ({self.density!r}); pass the bucket"
            )
        return self.density

    def density_levels(self, bucket: BucketSpec | None = None) -> tuple[float, ...]:
        """The densities the step switches between: the warm-up tiers in order, then the
        target (just the target without warm-up).

        Args:
          bucket: the bucket (needed when the density differs per bucket).

        Returns:
          The densities, densest first.

        Example:
          >>> from jaxsched.runtime.compress import TopK
          >>> TopK(0.25, warmup_steps=4, warmup_density=1.0).density_levels(), TopK(0.25).density_levels()
          ((1.0, 0.25), (0.25,))
        """
        target = self.target_density(bucket)
        start = max(target, self.warmup_density or DEFAULT_WARMUP_DENSITY)
        if not self.warmup_steps or start <= target:
            return (target,)
        tiers = self.warmup_tiers or max(1, math.ceil(math.log(start / target) / math.log(TIER_FACTOR) - 1e-9))
        tiers = min(tiers, self.warmup_steps)
        return tuple(start * (target / start) ** (j / tiers) for j in range(tiers)) + (target,)

    def _tier(self, step: Any, levels: int) -> Any:
        """Index into `density_levels` at ``step`` (an int or an int32 array)."""
        tiers = levels - 1
        if tiers == 0:
            return 0 * step
        if isinstance(step, (int, np.integer)):
            return min(int(step), self.warmup_steps) * tiers // self.warmup_steps
        return jnp.minimum(step, self.warmup_steps) * tiers // self.warmup_steps

    def density_at(self, step: int, bucket: BucketSpec | None = None) -> float:
        """The density used at ``step`` (0 is the first step).

        Args:
          step: the step, from 0.
          bucket: the bucket (needed when the density differs per bucket).

        Returns:
          The density.

        Example:
          >>> from jaxsched.runtime.compress import TopK
          >>> topk = TopK(0.25, warmup_steps=4, warmup_density=1.0)
          >>> topk.density_at(0), topk.density_at(3), topk.density_at(4)
          (1.0, 1.0, 0.25)
        """
        if step < 0:
            raise JaxschedValueError(f"step must be >= 0, got {step}")
        levels = self.density_levels(bucket)
        return levels[self._tier(int(step), len(levels))]

    def mean_density(self, steps: int, bucket: BucketSpec | None = None) -> float:
        """The mean density over the first ``steps`` steps (warm-up included): what a run
        of that length sends on average, relative to dense.

        Args:
          steps: the run's length.
          bucket: the bucket (needed when the density differs per bucket).

        Returns:
          The mean density.

        Example:
          >>> from jaxsched.runtime.compress import TopK
          >>> TopK(0.25, warmup_steps=4, warmup_density=1.0).mean_density(8)  # 4 dense steps, 4 at 0.25
          0.625
        """
        if steps < 1:
            raise JaxschedValueError(f"steps must be >= 1, got {steps}")
        levels = self.density_levels(bucket)
        tiers = np.minimum(np.arange(steps), self.warmup_steps) * (len(levels) - 1)
        tiers = tiers // max(self.warmup_steps, 1)
        return float(np.mean(np.asarray(levels)[tiers]))

    def sim_compression(self, selection_s_per_byte: float = 0.0, *, step: int | None = None, steps: int | None = None):
        """This compressor as the simulator and the bucket planner model it
        (`jaxsched.sim.Compression`, one density for every bucket).

        Without ``step`` or ``steps``: the density after warm-up, the steady state that the
        planners plan buckets for (``schedule(..., buckets="auto")`` does so). ``step=s``:
        the density of step ``s`` (a warm-up step is denser). ``steps=n``: the mean density
        over a run of ``n`` steps, warm-up included.

        Args:
          selection_s_per_byte: the selection's time per gradient byte (measured by
            `jaxsched.plan._profiling.measure_selection_s_per_byte`).
          step: model this step's density.
          steps: model the mean density of a run this long.

        Returns:
          A `jaxsched.sim.Compression`.

        Example:
            >>> from jaxsched.runtime.compress import TopK
            >>> TopK(0.01, warmup_steps=4, warmup_density=0.16).sim_compression(steps=8)
            Compression(kind='topk', density=0.055, selection_s_per_byte=0.0)
        """
        from jaxsched.sim import Compression

        if step is not None and steps is not None:
            raise JaxschedValueError("give step= (one step) or steps= (the mean over a run), not both")
        if not isinstance(self.density, float):
            raise JaxschedValueError(
                f"{type(self).__name__}: the simulator models one density for every bucket; got {self.density!r}"
            )
        density = (
            self.density_at(step)
            if step is not None
            else self.mean_density(steps)
            if steps is not None
            else self.density
        )
        if self.sim_kind is None:
            raise JaxschedValueError(f"{type(self).__name__}: the simulator does not model it")
        return Compression(self.sim_kind, density, selection_s_per_byte)

    def at_scheduled_density(self, step: jax.Array, bucket: BucketSpec, exchange: Callable[[float], T]) -> T:
        """``exchange(density)`` at this step's density: one ``lax.switch`` branch per level
        of `density_levels` (no switch without warm-up).

        Args:
          step: the step counter (an int32 array inside the body).
          bucket: the bucket.
          exchange: the exchange at a given density.

        Returns:
          What ``exchange`` returns.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxsched.runtime.collectives import BucketSpec
          >>> from jaxsched.runtime.compress import TopK
          >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
          >>> topk = TopK(0.25, warmup_steps=4, warmup_density=1.0)
          >>> [float(topk.at_scheduled_density(jnp.int32(s), spec, jnp.float32)) for s in (0, 5)]
          [1.0, 0.25]
        """
        levels = self.density_levels(bucket)
        if len(levels) == 1:
            return exchange(levels[0])
        branches = [lambda d=d: exchange(d) for d in levels]
        return lax.switch(self._tier(step, len(levels)), branches)

    # -- clipping and momentum correction --------------------------------------------------
    def accumulate(self, buffer: jax.Array, velocity: Velocity) -> tuple[jax.Array, Velocity]:
        """What enters the residual this step, and the new velocity before masking:
        ``(g, velocity)`` without momentum, ``(u, u)`` with ``u = m * velocity + g``;
        ``g`` is ``buffer`` clipped to ``clip_norm``.

        Args:
          buffer: this device's flat gradient buffer.
          velocity: the carried velocity (``()`` without momentum).

        Returns:
          ``(to_residual, velocity)``.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxsched.runtime.compress import TopK
          >>> TopK(0.5, clip_norm=1.0).accumulate(jnp.array([3.0, 4.0]), ())[0].tolist()  # clipped to norm 1
          [0.6000000238418579, 0.800000011920929]
          >>> u, velocity = TopK(0.5, momentum=0.9).accumulate(jnp.array([1.0, 2.0]), jnp.array([1.0, 1.0]))
          >>> u.tolist()  # 0.9 * velocity + g
          [1.899999976158142, 2.9000000953674316]
        """
        grad = buffer
        if self.clip_norm is not None:
            norm = jnp.sqrt(jnp.sum(jnp.square(buffer.astype(jnp.float32))))
            scale = jnp.minimum(1.0, self.clip_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
            grad = (buffer.astype(jnp.float32) * scale).astype(buffer.dtype)
        if not self.momentum or isinstance(velocity, tuple):
            return grad, velocity
        velocity = (self.momentum * velocity + grad).astype(buffer.dtype)
        return velocity, velocity

    def mask_velocity(self, velocity: Velocity, sent: jax.Array | None) -> Velocity:
        """Momentum factor masking: the velocity of every entry sent is cleared.

        Args:
          velocity: the velocity.
          sent: a boolean mask of the entries sent (`sent_mask`).

        Returns:
          The masked velocity (as given without momentum).

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxsched.runtime.compress import TopK
          >>> TopK(0.5, momentum=0.9).mask_velocity(jnp.ones(4), jnp.array([True, False, False, True])).tolist()
          [0.0, 1.0, 1.0, 0.0]
        """
        if not self.momentum or sent is None or isinstance(velocity, tuple):
            return velocity
        return jnp.where(sent, jnp.zeros((), velocity.dtype), velocity)

    def init_velocity(self, bucket: BucketSpec) -> Velocity:
        """The carried velocity: zeros of the bucket's shape with momentum; otherwise ``()``,
        no array at all (orbax refuses to save zero-size arrays).

        Args:
          bucket: the bucket.

        Returns:
          The initial velocity.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxsched.runtime.collectives import BucketSpec
          >>> from jaxsched.runtime.compress import TopK
          >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
          >>> TopK(0.25, momentum=0.9).init_velocity(spec).shape, TopK(0.25).init_velocity(spec)
          ((8,), ())
        """
        if self.momentum and self.compresses(bucket):
            return jnp.zeros((bucket.size,), bucket.dtype)
        return ()

    def residual_size(self, bucket: BucketSpec) -> int:
        """Elements of the carried residual: the bucket's with error feedback, else 0.

        Args:
          bucket: the bucket.

        Returns:
          The residual's size.

        Example:
            >>> import jax.numpy as jnp
            >>> from jaxsched.runtime.collectives import BucketSpec
            >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4)
            >>> from jaxsched.runtime.compress import TopK
            >>> TopK(0.01).residual_size(spec), TopK(0.01, error_feedback=False).residual_size(spec)
            (1000, 0)
        """
        return bucket.size if self.error_feedback and self.compresses(bucket) else 0
