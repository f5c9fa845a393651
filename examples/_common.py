"""Plumbing shared by the example trainers: options, devices, and a `Run` that owns
checkpoints, metrics, progress, Ctrl-C, the summary and the loss curve.

Why here and not in each trainer: the trainers (``digits.py``, ``cifar_synthetic.py``,
``tiny_lm.py``) should show the part a user copies, building a step and scheduling it;
this module is the same bookkeeping for all three. Options are validated before any
work starts: a bad value ends the program with exit status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

import numpy as np

from jaxsched.demo import config as config_lib
from jaxsched.tools import launch
from jaxsched.tools.cli._options import HelpFormatter, positive_int

EXIT_INTERRUPTED = 130  # what a shell reports for a program stopped by Ctrl-C (128 + SIGINT)
COMPRESSIONS = "none, topk:DENSITY, gtopk:DENSITY, powersgd:RANK, bf16"


#: the final loss and train accuracy of a summary are averages over this many last steps
RECENT_STEPS = 10


def parser(description: str, default_config: str | None, default_out: str) -> argparse.ArgumentParser:
    """The options every trainer takes (each may add its own). ``default_config=None``:
    the trainer picks one from the other options (see `parse`)."""
    from jaxsched.strategies import STRATEGIES

    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument(
        "--config",
        default=default_config,
        help="TOML experiment config: [model], [data], [optimizer], [train] "
        "(jaxsched/config.py); the options below override it",
    )
    p.add_argument("--strategy", default="dear", choices=list(STRATEGIES), help="how gradients are communicated")
    p.add_argument(
        "--buckets",
        default=None,
        type=bucket_plan,
        help="none (25 MB buckets), a byte threshold, auto (cost-model plan), or "
        "an explicit plan: buckets separated by ';', path prefixes by ',' "
        "(e.g. 'hidden;head')",
    )
    p.add_argument("--compression", default=None, type=compression, help=f"gradient compressor: {COMPRESSIONS}")
    p.add_argument("--engine", default="auto", type=engine_name, help="auto, xla or host (jaxsched.runtime.engine)")
    p.add_argument("--steps", type=positive_int, help="steps in all (default: train.steps)")
    p.add_argument(
        "--devices",
        type=positive_int,
        help="devices in the mesh (default: train.devices on one process; one per process under jaxsched launch)",
    )
    p.add_argument("--batch-size", type=positive_int, help="global batch (default: data.batch_size)")
    p.add_argument("--seed", type=int, help="model init and data order (default: train.seed)")
    p.add_argument(
        "--out", default=default_out, help="folder for metrics.jsonl, summary.json, loss.png and checkpoints/"
    )
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=50,
        help="save the scheduled state every N steps (and after the last)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out/checkpoints")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    return p


def bucket_plan(text: str) -> Any:
    """``--buckets``: None, ``"auto"``, a byte count, or a list of lists of path prefixes."""
    if text in ("none", "default", ""):
        return None
    if text == "auto":
        return "auto"
    if text.isdigit():
        if int(text) <= 0:
            raise argparse.ArgumentTypeError(f"{text} bytes: a threshold must be positive")
        return int(text)
    plan = [[p.strip() for p in group.split(",") if p.strip()] for group in text.split(";")]
    if not all(plan):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty bucket; e.g. 'hidden;head'")
    return plan


def compression(text: str) -> Any:
    """``--compression``: a `jaxsched.runtime.compress` compressor, or None for ``none``."""
    if text in ("none", ""):
        return None
    from jaxsched.tools.bench import parse_compression

    try:
        return parse_compression(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's message as it is
        raise argparse.ArgumentTypeError(str(err)) from None


def engine_name(text: str) -> str:
    from jaxsched.runtime.engine import engine_names

    if text not in engine_names():
        raise argparse.ArgumentTypeError(f"{text!r} is unknown; choose one of {', '.join(engine_names())}")
    return text


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options: the parsed arguments and the config they override."""

    args: argparse.Namespace
    cfg: config_lib.Config
    steps: int
    devices: int
    batch_size: int
    seed: int
    processes: int
    out: Path


def parse(
    p: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    config_for: Callable[[argparse.Namespace], str] | None = None,
) -> Options:
    """Parse and check every option, the config and the output folder; touch no device.
    ``config_for(args)`` names the config when ``--config`` is not given."""
    from jaxsched.runtime.compress import PowerSGD
    from jaxsched.strategies import make_strategy

    args = p.parse_args(argv)
    if args.config is None and config_for is not None:
        args.config = config_for(args)
    try:
        cfg = config_lib.load(args.config)
    except config_lib.ConfigError as err:
        p.error(f"--config: {err}")
    processes = int(os.environ.get(launch.ENV_NUM_PROCESSES) or 1)
    devices = args.devices or (cfg.train.devices if processes == 1 else processes)
    batch = args.batch_size or cfg.data.batch_size
    if devices % processes:
        p.error(f"--devices {devices} is not divisible by the {processes} processes")
    if batch % devices:
        p.error(
            f"the global batch {batch} (--batch-size or data.batch_size) is not divisible "
            f"by --devices {devices}; pick a multiple of {devices}"
        )
    try:
        make_strategy(args.strategy, collective=args.compression)
    except ValueError as err:
        p.error(f"--strategy {args.strategy} --compression: {err}")
    if isinstance(args.compression, PowerSGD) and args.strategy != "wfbp":
        p.error(f"--compression powersgd needs whole gradient tensors: use --strategy wfbp, not {args.strategy}")
    out = Path(args.out)
    has_checkpoints = (out / "checkpoints").is_dir() and any(c.name.isdigit() for c in (out / "checkpoints").iterdir())
    if has_checkpoints and not args.resume:
        p.error(f"--out {out} already holds checkpoints: pass --resume to continue that run, or choose another --out")
    steps = args.steps or cfg.train.steps
    seed = cfg.train.seed if args.seed is None else args.seed
    opts = Options(args, cfg, steps, devices, batch, seed, processes, out)
    saved = out / "run.json"
    if has_checkpoints and saved.exists():
        before, now = json.loads(saved.read_text()), settings(opts)
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            diffs = ", ".join(f"{k} was {before.get(k)!r}, now {now.get(k)!r}" for k in changed)
            p.error(
                f"--resume: {diffs}; a run resumes with the settings it started with "
                "(only --steps, --engine and --checkpoint-every may change)"
            )
    return opts


def settings(opts: Options) -> dict[str, Any]:
    """What decides a run's trajectory, as flat ``name: value`` pairs; a resumed run must
    match the ones its first part wrote to ``--out/run.json``."""
    cfg = dataclasses.asdict(opts.cfg)
    flat = {
        f"{table}.{key}": value
        for table in ("model", "data", "optimizer")
        for key, value in cfg[table].items()
        if key != "options"
    }
    flat.update(
        {f"{table}.{key}": value for table in ("model", "data") for key, value in cfg[table]["options"].items()}
    )
    a = opts.args
    flat.update(
        {
            "strategy": a.strategy,
            "buckets": a.buckets,
            "seed": opts.seed,
            "compression": repr(a.compression) if a.compression else None,
            "devices": opts.devices,
            "batch_size": opts.batch_size,
        }
    )
    flat.pop("data.batch_size")
    return json.loads(json.dumps(flat))


def ask_for_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` virtual CPU devices, unless ``XLA_FLAGS`` already says how many
    (it must be set before JAX's first use)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def start_devices(opts: Options) -> Any:
    """Join the other processes (under ``jaxsched launch``) or ask for ``--devices`` virtual
    CPU devices, then return the mesh: the first ``devices / processes`` local devices of
    every process, so a spare local device is left for the host engine."""
    import jax
    from jax._src import xla_bridge

    if os.environ.get(launch.ENV_PROCESS_ID):
        launch.initialize()
    elif not xla_bridge.backends_are_initialized():
        ask_for_cpu_devices(opts.devices)
    per_process = opts.devices // jax.process_count()
    chosen = []
    for p in range(jax.process_count()):
        local = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(local) < per_process:
            fail(
                f"--devices {opts.devices} needs {per_process} devices in process {p}, which "
                f"has {len(local)}; set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{per_process} (or jaxsched launch --cpu-devices) or lower --devices"
            )
        chosen += local[:per_process]
    return jax.sharding.Mesh(np.array(chosen), ("data",))


def fail(message: str) -> NoReturn:
    """End the program as argparse does for a bad option: one line, exit status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_buckets(plan: Any, params: Any) -> None:
    """An explicit ``--buckets`` plan against the model's parameter paths, before tracing."""
    if not isinstance(plan, list):
        return
    from jaxsched.core._bucketing import _explicit_groups, param_paths

    try:
        _explicit_groups(plan, param_paths(params))
    except ValueError as err:
        fail(f"--buckets: {err}")


def global_batch(mesh: Any, arrays: Sequence[np.ndarray], batch_size: int, step: int, seed: int) -> tuple:
    """Step ``step``'s batch, a function of ``(seed, step)`` only, on ``mesh``; each process
    reads and places only its own rows (``jax.make_array_from_process_local_data``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsched.zoo.data import batch_indices

    idx = batch_indices(len(arrays[0]), batch_size, step, seed)
    share = batch_size // jax.process_count()
    mine = idx[jax.process_index() * share : (jax.process_index() + 1) * share]
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.make_array_from_process_local_data(sharding, a[mine], (batch_size, *a.shape[1:])) for a in arrays)


def host(tree: Any) -> Any:
    """Replicated arrays (e.g. finalized params) as numpy, in every process."""
    import jax
    from jax.experimental import multihost_utils

    def one(a: Any) -> np.ndarray:
        if not isinstance(a, jax.Array):
            return np.asarray(a)
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, tree)


class Run:
    """Checkpoints, metrics, progress and Ctrl-C for one training run (a context manager).

    - ``restore(state)``: with ``--resume``, the latest checkpoint in ``state``'s layout
      (``state`` from ``sched.init(params, opt_state, batch)``), else ``state``.
    - ``steps()``: the step numbers still to run, under a progress bar; stops early after
      Ctrl-C/SIGTERM (the step in flight finishes; a second Ctrl-C stops at once).
    - ``log(step, aux, state)``: one JSON line, the bar's throughput, and a checkpoint
      every ``--checkpoint-every`` steps and after the last.
    - leaving the block waits for pending saves, so the newest checkpoint is complete;
      ``interrupted`` then says whether the run stopped early.
    """

    def __init__(self, opts: Options, name: str, unit: str, per_example: int = 1):
        import jax

        from jaxsched.integrations.checkpoint import Checkpoints

        self.opts, self.name, self.unit, self.per_example = opts, name, unit, per_example
        self.primary = jax.process_index() == 0
        opts.out.mkdir(parents=True, exist_ok=True)
        if self.primary:
            (opts.out / "run.json").write_text(json.dumps(settings(opts), indent=2) + "\n")
        self.checkpoints = Checkpoints(opts.out / "checkpoints")
        self.metrics_path = opts.out / "metrics.jsonl"
        self.start = 0
        self.step_seconds: list[float] = []
        self.last_row: dict[str, float] = {}
        self.recent_rows: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self.interrupted = self.stop_requested = False
        self._previous_handlers: dict[int, Any] = {}
        self._started = time.perf_counter()
        self._t0 = 0.0

    # -- Ctrl-C -------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step (again: at once); "
            "the last complete checkpoint is kept",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self.checkpoints.close()  # waits for the save in flight: the newest one is complete
        if exc_type is KeyboardInterrupt:
            self.stop_requested = True
        self.interrupted = self.stop_requested
        return exc_type is KeyboardInterrupt

    # -- the loop -----------------------------------------------------------------------
    def restore(self, state: Any) -> Any:
        """The latest checkpoint when resuming, else ``state``; trims metrics to match."""
        latest = self.checkpoints.latest_step() if self.opts.args.resume else None
        rows = [r for r in _read_jsonl(self.metrics_path) if r["step"] < (latest or 0)]
        self.last_row = rows[-1] if rows else {}
        self.recent_rows.extend(rows[-RECENT_STEPS:])
        if self.primary:  # metrics of steps after the checkpoint are run again: drop them
            with open(self.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if latest is None:
            if self.opts.args.resume:
                self.say(f"no checkpoint in {self.checkpoints.directory}; starting at step 0")
            return state
        self.start = latest
        self.say(f"resuming at step {latest} from {self.checkpoints.directory / str(latest)}")
        return self.checkpoints.restore(state, latest)

    def steps(self) -> Iterator[int]:
        from jaxsched.core._progress import progress

        desc = f"{self.name} from step {self.start}" if self.start else self.name
        bar = progress(
            range(self.start, self.opts.steps),
            desc,
            enabled=self.primary and not self.opts.args.no_progress,
            unit="step",
        )
        self._bar = bar
        for step in bar:
            if self.stop_requested:
                break
            self._t0 = time.perf_counter()
            yield step

    def log(self, step: int, aux: dict, state: Any) -> None:
        import jax

        aux = jax.block_until_ready(aux)  # one multi-device step in flight (docs/benchmarks.md)
        seconds = time.perf_counter() - self._t0
        if step > self.start:  # the first step of a process compiles
            self.step_seconds.append(seconds)
        rate = self.opts.batch_size * self.per_example / seconds
        metrics = {k: float(np.asarray(v.addressable_data(0))) for k, v in aux.items()}
        row = {"step": step, **metrics, "step_s": seconds, f"{self.unit}_per_s": rate}
        self.last_row = row
        self.recent_rows.append(row)
        if self.primary:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        self._bar.set_postfix(loss=f"{row['loss']:.4f}", **{f"{self.unit}/s": f"{rate:,.0f}"})
        done = step + 1
        if done % self.opts.args.checkpoint_every == 0 or done == self.opts.steps:
            self.checkpoints.save(done, state)

    # -- the end ------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.primary:
            print(text, flush=True)

    def stopped(self) -> int:
        """Report an interrupted run; the exit status to return."""
        latest = self.checkpoints.latest_step()
        where = f"step {latest} in {self.checkpoints.directory}" if latest else "none yet"
        self.say(f"interrupted; last complete checkpoint: {where}; continue with --resume")
        if self.opts.processes > 1:
            launch.exit_now(EXIT_INTERRUPTED)  # skip jax.distributed's shutdown barrier
        return EXIT_INTERRUPTED

    def recent_mean(self, key: str) -> float | None:
        """The average of ``key`` over the last `RECENT_STEPS` steps: what the
        summary reports as the final loss and train accuracy, as ``jaxsched train`` does."""
        values = [r[key] for r in self.recent_rows if key in r]
        return float(np.mean(values)) if values else None

    def finish(self, sched: Any, **results: Any) -> int:
        """Write ``summary.json`` and ``loss.png``, print the summary; exit status 0.
        ``sched`` says which engine ``--engine`` resolved to and how many buckets it sends."""
        args = self.opts.args
        median = float(np.median(self.step_seconds)) if self.step_seconds else float("nan")
        summary = {
            "example": self.name,
            "model": self.opts.cfg.model.name,
            "strategy": args.strategy,
            "buckets": args.buckets,
            "compression": repr(args.compression) if args.compression else None,
            "engine": args.engine,
            "devices": self.opts.devices,
            "engine_used": sched.program.engine.name,
            "buckets_used": len(sched.program.planned.buckets),
            "processes": self.opts.processes,
            "batch_size": self.opts.batch_size,
            "seed": self.opts.seed,
            "steps": self.opts.steps,
            "resumed_from": self.start,
            "final_loss": self.recent_mean("loss"),
            "median_step_s": median,
            f"{self.unit}_per_s": self.opts.batch_size * self.per_example / median,
            "wall_s": time.perf_counter() - self._started,
            **results,
            "checkpoint": str(self.checkpoints.directory / str(self.checkpoints.latest_step())),
        }
        summary = {
            k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in summary.items()
        }  # no step timed (e.g. resumed at the end)
        if self.primary:
            (self.opts.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            plot_losses(
                _read_jsonl(self.metrics_path),
                self.opts.out / "loss.png",
                f"{self.name}: {self.opts.cfg.model.name}, {args.strategy}, {self.opts.devices} devices",
                results.get("best_possible_loss"),
            )
            width = max(map(len, summary))
            print("\n".join(f"{k:>{width}}  {_fmt(v)}" for k, v in summary.items()))
            print(f"wrote {self.opts.out}/summary.json, metrics.jsonl, loss.png", flush=True)
        return 0


def script(main: Any) -> int:
    """Run a trainer's ``main()``; Ctrl-C before training starts (while compiling) ends it
    quietly with status 130 (during training, `Run` handles it)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted before training started", file=sys.stderr)
        return EXIT_INTERRUPTED


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(rows: list[dict], path: Path, title: str, floor: float | None = None) -> None:
    """The training loss per step, as a PNG (matplotlib's Agg backend: no display needed);
    ``floor``, if known, is drawn as the best loss any model can reach."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="training loss")
    if floor is not None:
        ax.axhline(floor, color="grey", ls="--", lw=1, label=f"best possible ({floor:.3f})")
        ax.legend()
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
