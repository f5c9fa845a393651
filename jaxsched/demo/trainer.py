"""The baseline trainer: config in, a trained model, a JSONL log and a summary out.

The step is pluggable: the trainer builds the user's plain step and hands it to a
``wrap(step, strategy)`` callable that returns an object with ``init``, ``__call__``
and ``finalize`` (by default [`jaxsched.schedule`][jaxsched._schedule.schedule]; ``allreduce`` is the plain step).
Only one multi-device step is kept in flight: with 8 virtual CPU devices on 2 cores,
steps queued unblocked deadlocked in a collective rendezvous (docs/benchmarks.md).
The initial state is placed on the mesh exactly as the step returns it, so the step
compiles once: a second compilation on step 2 used to land inside the timed steps and
halved the plain step's steps/s in ``jaxsched demo`` (docs/benchmarks.md).

Example:
    >>> from jaxsched.demo import config, trainer
    >>> cfg = config.parse({"model": {"name": "mlp", "hidden": [16]},
    ...                     "data": {"name": "digits", "batch_size": 32},
    ...                     "train": {"steps": 3, "devices": 1}})
    >>> trainer.train(cfg, progress=False).steps
    3
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.zoo import data as data_lib
from jaxsched.zoo import models as models_lib
from jaxsched.demo import steps as steps_lib
from jaxsched.demo.config import Config, ConfigError
from jaxsched.core._progress import progress as progress_bar

if TYPE_CHECKING:
    from jaxsched.strategies._base import ScheduledState

__all__ = [
    "default_wrap",
    "devices_for",
    "Experiment",
    "experiment",
    "FINAL_WINDOW",
    "RunResult",
    "StepRunner",
    "summary_table",
    "train",
    "train_side_by_side",
    "verify_config",
]


class StepRunner(Protocol):
    """What the trainer drives: a plain step, or a scheduled one."""

    def init(self, params: Any, opt_state: Any, /) -> Any: ...
    def __call__(self, state: Any, batch: Any, /) -> Any: ...
    def finalize(self, state: Any) -> tuple[Any, Any]: ...


#: final loss and train accuracy are averages over this many last steps (batches)
FINAL_WINDOW = 10


def default_wrap(step: steps_lib.Step, strategy: str) -> StepRunner:
    """Schedule ``step`` with ``strategy`` through [`jaxsched.schedule`][jaxsched._schedule.schedule]."""
    from jaxsched._schedule import STRATEGIES, Scheduled

    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategies: {strategy!r} is unknown; choose from {', '.join(STRATEGIES)}")
    return Scheduled(step, strategy=strategy)


@dataclasses.dataclass
class RunResult:
    """What one training run produced (`train` returns it).

    A median step time, because on a shared machine a few slow steps would otherwise
    decide a comparison of strategies.

    Attributes:
      strategy: the strategy's name.
      steps: steps run.
      median_step_s: the median time of steps 2..N (the first compiles), from the call
        until its metrics are ready.
      steps_per_s: ``1 / median_step_s``.
      final_loss: the mean loss over the last steps.
      train_accuracy: the mean train accuracy over the last steps.
      test_accuracy: accuracy on the test split.
      losses: every step's loss.
      params: the trained parameters.
      opt_state: the final optimizer state.

    Example:
        >>> result = RunResult("wfbp", 2, 0.01, 100.0, 0.5, 0.9, 0.8, [0.7, 0.5], {}, ())
        >>> result.steps_per_s
        100.0
    """

    strategy: str
    steps: int
    median_step_s: float
    steps_per_s: float
    final_loss: float
    train_accuracy: float
    test_accuracy: float
    losses: list[float]
    params: Any
    opt_state: Any


def devices_for(cfg: Config) -> list:
    """The first ``train.devices`` devices, or a clear error if there are fewer."""
    available = jax.devices()
    if len(available) < cfg.train.devices:
        raise ConfigError(
            f"{cfg.source}: train.devices={cfg.train.devices} but only {len(available)} "
            f"{available[0].platform} device(s) exist; on CPU start with "
            f"jax.config.update('jax_num_cpu_devices', {cfg.train.devices}) "
            "before JAX is first used (the CLI does this)"
        )
    return available[: cfg.train.devices]


def _metric_row(aux: dict) -> dict[str, float]:
    return {k: float(np.asarray(v).reshape(-1)[0]) for k, v in aux.items()}


class Experiment(NamedTuple):
    """A config made concrete: data, model, optimizer, the user's step and its inputs."""

    split: Any
    apply_fn: Callable
    tx: Any
    params: Any
    opt_state: Any
    make_step: Callable[[], steps_lib.Step]
    place: Callable[[Any], Any]
    batches: Callable[[], Any]


def experiment(cfg: Config) -> Experiment:
    """Build what a training run of ``cfg`` needs (parameters placed as the step returns them)."""
    devices = devices_for(cfg)
    n = len(devices)
    split = data_lib.load(cfg.data.name, seed=cfg.train.seed, **cfg.data.options)
    if cfg.data.batch_size > len(split.train_x):
        raise ConfigError(
            f"{cfg.source}: data.batch_size={cfg.data.batch_size} exceeds the "
            f"{len(split.train_x)} training examples of {cfg.data.name!r}"
        )
    model = models_lib.build(
        cfg.model.name, split.train_x.shape[1:], split.num_classes, seed=cfg.train.seed, **cfg.model.options
    )
    params, apply_fn = models_lib.pure(model)
    tx = steps_lib.make_optimizer(cfg.optimizer)
    opt_state = tx.init(params)
    if cfg.train.api in ("jit", "shard_map"):
        # a jit step on global arrays leaves the partitioning to XLA: an Auto axis (an Explicit
        # one asks the step for every output's sharding, e.g. an embedding lookup's)
        auto = (jax.sharding.AxisType.Auto,) if cfg.train.api == "jit" else None
        mesh = jax.make_mesh((n,), ("data",), devices=devices, axis_types=auto)
        if cfg.train.api == "jit":
            make_step = lambda: steps_lib.make_jit_step(apply_fn, tx)
        else:
            make_step = lambda: steps_lib.make_step(apply_fn, tx, mesh)
        params, opt_state = steps_lib.place_replicated((params, opt_state), mesh)
        place = lambda batch: steps_lib.shard_batch(batch, mesh)
    else:
        make_step = lambda: steps_lib.make_pmap_step(apply_fn, tx, devices=devices)
        params, opt_state = steps_lib.place_stacked(steps_lib.replicate((params, opt_state), n), devices)
        place = lambda batch: steps_lib.split_batch(batch, n)
    batches = lambda: data_lib.batches(split.train_x, split.train_y, cfg.data.batch_size, seed=cfg.train.seed)
    return Experiment(split, apply_fn, tx, params, opt_state, make_step, place, batches)


def verify_config(
    cfg: Config,
    strategies: Sequence[str] | None = None,
    steps: int | None = None,
    rtol: float = 1e-5,
    precision: str = "float64",
    progress: bool = False,
) -> list:
    """``Scheduled.verify`` of every strategy (but the identity) on ``cfg``'s own step and data."""
    from jaxsched._schedule import Scheduled

    exp = experiment(cfg)
    steps = steps or cfg.train.steps
    reports = []
    for strategy in strategies or [s for s in cfg.train.strategies if s != "allreduce"]:
        sched = Scheduled(exp.make_step(), strategy=strategy)
        batches = (exp.place(b) for b in exp.batches())
        reports.append(
            sched.verify(
                cast("ScheduledState", sched.init(exp.params, exp.opt_state)),
                batches,
                steps=steps,
                rtol=rtol,
                precision=precision,
                progress=progress,
            )
        )
    return reports


def train(
    cfg: Config,
    strategy: str | None = None,
    *,
    progress: bool = True,
    log_path: str | Path | None = None,
    wrap: Callable[[steps_lib.Step, str], StepRunner] = default_wrap,
) -> RunResult:
    """Train ``cfg`` with one strategy.

    Args:
      cfg: the experiment (`jaxsched.demo.config.parse` or ``load``).
      strategy: the strategy's name (default: the first in ``train.strategies``).
      progress: show a progress bar.
      log_path: write one JSON line of metrics per logged step there.
      wrap: ``wrap(step, strategy)`` gives the object that runs the step
        (default: [`jaxsched.schedule`][jaxsched._schedule.schedule]).

    Returns:
      The run's `RunResult`: losses, timings, accuracies and the final trees.

    Example:
        >>> from jaxsched.demo import config
        >>> cfg = config.parse({"model": {"name": "mlp", "hidden": [8]},
        ...                     "data": {"name": "digits", "batch_size": 16},
        ...                     "train": {"steps": 2, "devices": 1}})
        >>> result = train(cfg, progress=False)
        >>> result.strategy, len(result.losses)
        ('allreduce', 2)
    """
    return train_side_by_side(
        cfg, [strategy or cfg.train.strategies[0]], progress=progress, log_path=log_path, wrap=wrap
    )[0]


def train_side_by_side(
    cfg: Config,
    strategies: Sequence[str] | None = None,
    *,
    progress: bool = True,
    log_path: str | Path | None = None,
    wrap: Callable[[steps_lib.Step, str], StepRunner] = default_wrap,
) -> list[RunResult]:
    """Train ``cfg`` once per strategy, in lockstep: every step runs each strategy once on the
    same batch, from the same initial parameters.

    Why lockstep: on a shared machine the load changes from second to second; runs one
    after the other then differ by more than the strategies do. Interleaved, every
    strategy's step times see the same load, so their medians compare.
    """
    strategies = list(strategies or cfg.train.strategies)
    exp = experiment(cfg)
    split, apply_fn, place = exp.split, exp.apply_fn, exp.place
    params, opt_state = exp.params, exp.opt_state
    runners = [wrap(exp.make_step(), strategy) for strategy in strategies]
    states = [runner.init(params, opt_state) for runner in runners]
    batches = exp.batches()
    log = open(log_path, "a") if log_path else None
    losses: list[list[float]] = [[] for _ in strategies]
    accuracies: list[list[float]] = [[] for _ in strategies]
    step_seconds: list[list[float]] = [[] for _ in strategies]
    try:
        bar = progress_bar(
            range(cfg.train.steps), f"{cfg.model.name}/{','.join(strategies)}", enabled=progress, unit="step"
        )
        for i in bar:
            batch = place(next(batches))
            for k, (strategy, runner) in enumerate(zip(strategies, runners)):
                started = time.perf_counter()
                states[k], aux = runner(states[k], batch)
                aux = jax.block_until_ready(aux)  # one multi-device step in flight (docs/benchmarks.md)
                if i > 0:  # the first step compiles
                    step_seconds[k].append(time.perf_counter() - started)
                row = _metric_row(aux)
                losses[k].append(row["loss"])
                accuracies[k].append(row.get("accuracy", float("nan")))
                if log and i % cfg.train.log_every == 0:
                    # the first step's time includes compiling
                    log.write(
                        json.dumps({"strategy": strategy, "step": i, **row, "step_s": time.perf_counter() - started})
                        + "\n"
                    )
            bar.set_postfix(loss=f"{losses[0][-1]:.4f}")
    finally:
        if log:
            log.close()
    evaluate = jax.jit(apply_fn)
    results = []
    for k, (strategy, runner) in enumerate(zip(strategies, runners)):
        final_params, final_opt_state = runner.finalize(states[k])
        if cfg.train.api == "pmap":
            final_params, final_opt_state = jax.tree.map(lambda a: a[0], (final_params, final_opt_state))
        logits = evaluate(final_params, jnp.asarray(split.test_x))
        tail = max(1, min(FINAL_WINDOW, len(losses[k])))
        median_step_s = float(np.median(step_seconds[k])) if step_seconds[k] else float("nan")
        results.append(
            RunResult(
                strategy=strategy,
                steps=cfg.train.steps,
                median_step_s=median_step_s,
                steps_per_s=1.0 / median_step_s if median_step_s > 0 else float("nan"),
                final_loss=float(np.mean(losses[k][-tail:])),
                train_accuracy=float(np.mean(accuracies[k][-tail:])),
                test_accuracy=float(steps_lib.accuracy(logits, jnp.asarray(split.test_y))),
                losses=losses[k],
                params=final_params,
                opt_state=final_opt_state,
            )
        )
    return results


def summary_table(results: list[RunResult]) -> str:
    """A plain-text table of runs, with each loss trajectory's largest gap to the first run."""
    header = [
        "strategy",
        "steps/s",
        f"loss (avg last {FINAL_WINDOW})",
        f"train acc (avg last {FINAL_WINDOW})",
        "test acc",
        "max |dloss| vs first",
    ]
    rows = []
    for r in results:
        gap = max(abs(a - b) for a, b in zip(r.losses, results[0].losses))
        rows.append(
            [
                r.strategy,
                f"{r.steps_per_s:.1f}",
                f"{r.final_loss:.4f}",
                f"{r.train_accuracy:.3f}",
                f"{r.test_accuracy:.3f}",
                f"{gap:.2e}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
