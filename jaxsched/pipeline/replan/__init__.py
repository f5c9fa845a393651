"""Plans that follow the network as it is measured during training (``schedule(..., replan=)``).

A bucket plan is optimal for one α-β network. When the links change under a running job
(a neighbour's traffic, a degraded link), the optimum moves. With ``replan=`` the
scheduled step keeps measuring the network and switches to a new plan when it drifted:

* **measured**: every ``every`` steps is a decision point. On the host engine its own
  collective stages are timed on the ``repeats`` steps before it (no extra traffic); the
  times of the same large collectives, against those measured when the plan was made, scale
  the plan's β. Elsewhere (or with ``monitor="probe"``), once the step's outputs are ready,
  every process times a small *probe*: each collective the strategy sends (``wfbp``:
  all-reduce; ``dear``: reduce-scatter and all-gather) at two sizes, ``repeats`` times, on
  the step's own mesh, and α and β are fitted per collective. Either way the estimate is the
  median of a sliding window of the last ``window`` measurements, restarted when the newest
  leaves the window's range by more than ``drift`` (a step change is followed at once).
* **agreed**: the processes exchange their estimates through jax.distributed's key-value
  store and all take the slowest (largest α and β): every process computes the same
  decision from the same numbers, so all switch at the same step. A message that does not
  arrive within ``timeout_s``, cannot be read, or comes from another step raises
  `ReplanAgreementError` on every process that waits for it, never a hang.
* **decided**: when the measured cost of the plan's average bucket differs from the cost
  the plan assumed by more than ``drift``, the planner runs again for the measured network
  (the layer profile is the one of the first plan); the step switches only if the
  simulator predicts the new plan at least ``min_gain`` faster than the current one on
  that network.
* **switched**: at the next step boundary. Programs are cached per plan, so a network that
  alternates recompiles nothing after each plan's first use. The state is carried as it
  is: every built-in strategy's state layout is independent of the buckets (``dear``
  shards each leaf flat, not each bucket), so the new program's ``convert`` takes it
  unchanged; a collective that carries state per bucket is refused
  (`refuse_per_bucket_state`).

Example:
    >>> r = Replan(every=20, drift=0.3)
    >>> r.every, r.drift, r.min_gain, r.monitor
    (20, 0.3, 0.05, 'auto')

The pieces, one concern each: `options` (`Replan` and the records), `estimate` (windows,
α-β fits, drift), `agreement` (the processes' key-value exchange), `monitor` (stage timings
and probes) and `replanner` (`Replanner`, which a `Scheduled` holds).
"""

from jaxsched import _deprecations

from jaxsched.pipeline.replan._agreement import KeyValueStore, Store, agree, slowest
from jaxsched.pipeline.replan._estimate import (
    Samples,
    bucket_groups,
    drift_between,
    fit_window,
    measured_network,
    merge_samples,
    scaled_network,
    update_window,
    window_ratio,
    without_engine_costs,
)
from jaxsched.pipeline.replan._monitor import (
    STAGE_COLLECTIVES,
    STAGE_MIN_BYTES,
    probe,
    probe_programs,
    stage_bytes,
    stage_samples,
    stage_threshold,
)
from jaxsched.pipeline.replan._options import MONITORS, Decision, Replan, ReplanAgreementError, SwitchRecord, as_replan
from jaxsched.pipeline.replan._replanner import (
    Replanner,
    plan_key,
    program_buckets,
    refuse_per_bucket_state,
    resolved_key,
)

__all__ = [
    "Decision",
    "KeyValueStore",
    "Store",
    "refuse_per_bucket_state",
    "Replan",
    "ReplanAgreementError",
    "Replanner",
    "SwitchRecord",
    "as_replan",
    "bucket_groups",
    "drift_between",
    "fit_window",
    "measured_network",
    "scaled_network",
    "stage_samples",
    "update_window",
    "window_ratio",
    "without_engine_costs",
    # also importable from here, as before the split
    "agree",
    "merge_samples",
    "MONITORS",
    "plan_key",
    "probe",
    "probe_programs",
    "program_buckets",
    "resolved_key",
    "Samples",
    "slowest",
    "STAGE_COLLECTIVES",
    "STAGE_MIN_BYTES",
    "stage_bytes",
    "stage_threshold",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
