"""The baseline trainer: config in, a trained model, a JSONL log and a summary out.

The step is pluggable: the trainer builds the user's plain step and hands it to a
``wrap(step, strategy)`` callable that returns an object with ``init``, ``__call__``
and ``finalize`` (by default :func:`jaxsched.schedule`; ``allreduce`` is the plain step). Only one multi-device step
is kept in flight: FACTS.md records rendezvous deadlocks on virtual CPU devices when
steps are queued unblocked.

Example:
    >>> from jaxsched import config, trainer
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
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxsched import data as data_lib
from jaxsched import models as models_lib
from jaxsched import steps as steps_lib
from jaxsched.config import Config, ConfigError


class StepRunner(Protocol):
    """What the trainer drives: a plain step, or a scheduled one."""

    def init(self, params: Any, opt_state: Any) -> Any: ...
    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]: ...
    def finalize(self, state: Any) -> tuple[Any, Any]: ...


def default_wrap(step: steps_lib.Step, strategy: str) -> StepRunner:
    """Schedule ``step`` with ``strategy`` through :func:`jaxsched.schedule`."""
    from jaxsched.schedule import STRATEGIES, Scheduled

    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategies: {strategy!r} is unknown; choose from {', '.join(STRATEGIES)}")
    return Scheduled(step, strategy=strategy)


@dataclasses.dataclass
class RunResult:
    """What one training run produced; ``losses`` holds every step's loss."""

    strategy: str
    steps: int
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
            "before JAX is first used (the CLI does this)")
    return available[: cfg.train.devices]


def _metric_row(aux: dict) -> dict[str, float]:
    return {k: float(np.asarray(v).reshape(-1)[0]) for k, v in aux.items()}


def train(cfg: Config, strategy: str | None = None, *, progress: bool = True,
          log_path: str | Path | None = None,
          wrap: Callable[[steps_lib.Step, str], StepRunner] = default_wrap) -> RunResult:
    """Train ``cfg`` with one strategy (default: the first in ``train.strategies``)."""
    strategy = strategy or cfg.train.strategies[0]
    devices = devices_for(cfg)
    n = len(devices)
    split = data_lib.load(cfg.data.name, seed=cfg.train.seed, **cfg.data.options)
    if cfg.data.batch_size > len(split.train_x):
        raise ConfigError(f"{cfg.source}: data.batch_size={cfg.data.batch_size} exceeds the "
                          f"{len(split.train_x)} training examples of {cfg.data.name!r}")
    model = models_lib.build(cfg.model.name, split.train_x.shape[1:], split.num_classes,
                             seed=cfg.train.seed, **cfg.model.options)
    params, apply_fn = models_lib.pure(model)
    tx = steps_lib.make_optimizer(cfg.optimizer)
    opt_state = tx.init(params)

    if cfg.train.api == "shard_map":
        mesh = jax.make_mesh((n,), ("data",), devices=devices)
        step = steps_lib.make_step(apply_fn, tx, mesh)
        place = lambda batch: steps_lib.shard_batch(batch, mesh)
    else:
        step = steps_lib.make_pmap_step(apply_fn, tx, devices=devices)
        params, opt_state = steps_lib.replicate((params, opt_state), n)
        place = lambda batch: steps_lib.split_batch(batch, n)

    runner = wrap(step, strategy)
    state = runner.init(params, opt_state)
    batches = data_lib.batches(split.train_x, split.train_y, cfg.data.batch_size, seed=cfg.train.seed)
    log = open(log_path, "a") if log_path else None
    losses, accuracies = [], []
    started = None
    try:
        bar = tqdm(range(cfg.train.steps), desc=f"{cfg.model.name}/{strategy}", disable=not progress,
                   unit="step")
        for i in bar:
            state, aux = runner(state, place(next(batches)))
            aux = jax.block_until_ready(aux)  # one multi-device step in flight (FACTS.md)
            if i == 0:
                started = time.perf_counter()  # exclude compilation from steps/s
            row = _metric_row(aux)
            losses.append(row["loss"])
            accuracies.append(row.get("accuracy", float("nan")))
            if log and i % cfg.train.log_every == 0:
                log.write(json.dumps({"strategy": strategy, "step": i, **row}) + "\n")
            bar.set_postfix(loss=f"{row['loss']:.4f}")
        elapsed = time.perf_counter() - started
    finally:
        if log:
            log.close()
    params, opt_state = runner.finalize(state)
    if cfg.train.api == "pmap":
        params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
    logits = jax.jit(apply_fn)(params, jnp.asarray(split.test_x))
    test_acc = float(steps_lib.accuracy(logits, jnp.asarray(split.test_y)))
    tail = max(1, min(10, len(losses)))
    return RunResult(
        strategy=strategy, steps=cfg.train.steps,
        steps_per_s=(cfg.train.steps - 1) / elapsed if cfg.train.steps > 1 and elapsed > 0 else float("nan"),
        final_loss=float(np.mean(losses[-tail:])), train_accuracy=float(np.mean(accuracies[-tail:])),
        test_accuracy=test_acc, losses=losses, params=params, opt_state=opt_state)


def summary_table(results: list[RunResult]) -> str:
    """A plain-text table of runs, with each loss trajectory's largest gap to the first run."""
    header = ["strategy", "steps/s", "final loss", "train acc", "test acc", "max |dloss| vs first"]
    rows = []
    for r in results:
        gap = max(abs(a - b) for a, b in zip(r.losses, results[0].losses))
        rows.append([r.strategy, f"{r.steps_per_s:.1f}", f"{r.final_loss:.4f}",
                     f"{r.train_accuracy:.3f}", f"{r.test_accuracy:.3f}", f"{gap:.2e}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
