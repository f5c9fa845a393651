"""Does K-FAC reach a target accuracy in fewer steps than SGD and Adam? Digits, 8 devices.

Every optimizer gets the same tuning effort: a sweep of four learning rates, nothing else
tuned (K-FAC's damping, moving-average decay and intervals stay at the values below).
``sgd`` and ``adam`` run the plain step (``strategy="allreduce"``); ``kfac`` runs the same
step with ``optax.sgd`` under ``strategy=jaxsched.integrations.kfac.KFAC(...)``. Every run of a seed
sees the same batches; test accuracy (held-out split) is evaluated every ``--eval-every``
steps. For each optimizer, the best learning rate is the one that reaches the target
first (ties: higher final accuracy). Writes ``benchmarks/results/kfac_convergence.json``,
``docs/kfac_convergence.png`` and the table between the markers in ``docs/benchmarks.md``.

    python benchmarks/kfac_convergence.py [--steps 300] [--seeds 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # before numpy/sklearn BLAS runs (docs/benchmarks.md hazard)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import data  # noqa: E402
from jaxsched.zoo import models
from jaxsched.demo import steps

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = {"sgd": (0.03, 0.1, 0.3, 1.0), "adam": (1e-3, 3e-3, 1e-2, 3e-2), "kfac": (0.01, 0.03, 0.1, 0.3)}
KFAC_OPTIONS = dict(damping=1e-2, ema_decay=0.95, factor_interval=1, inverse_interval=5, factor_buckets="per_layer")
HIDDEN = (64, 32)


def optimizer(name: str, lr: float):
    return optax.adam(lr) if name == "adam" else optax.sgd(lr)


def train(name: str, lr: float, seed: int, split, args, mesh) -> dict:
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, seed=seed, hidden=HIDDEN))
    tx = optimizer(name, lr)
    strategy = jaxsched.integrations.kfac.KFAC(**KFAC_OPTIONS) if name == "kfac" else "allreduce"
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy)
    state = sched.init(params, tx.init(params))
    evaluate = jax.jit(lambda p: steps.accuracy(apply_fn(p, split.test_x), split.test_y))
    curve, losses, times = [], [], []
    batches = data.batches(split.train_x, split.train_y, args.batch, seed=seed)
    for t in range(1, args.steps + 1):
        start = time.perf_counter()
        state, aux = sched(state, steps.shard_batch(next(batches), mesh))
        jax.block_until_ready(aux)  # one multi-device step in flight (docs/benchmarks.md)
        times.append(time.perf_counter() - start)
        losses.append(float(aux["loss"]))
        if t % args.eval_every == 0:
            p = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), state.params)
            curve.append([t, float(evaluate(p))])
    first = {str(target): next((s for s, acc in curve if acc >= target), None) for target in args.targets}
    return {
        "optimizer": name,
        "lr": lr,
        "seed": seed,
        "accuracy": curve,
        "loss": losses,
        "steps_to": first,
        "final_accuracy": curve[-1][1],
        "median_step_s": statistics.median(times[5:]),
    }


def best_runs(runs: list[dict], target: float) -> dict:
    """Per optimizer, the learning rate whose median steps-to-target over seeds is lowest."""
    key = str(target)
    best = {}
    for name in SWEEPS:
        scored = []
        for lr in SWEEPS[name]:
            mine = [r for r in runs if r["optimizer"] == name and r["lr"] == lr]
            reached = [r["steps_to"][key] for r in mine]
            steps_needed = statistics.median(reached) if all(s is not None for s in reached) else float("inf")
            final = statistics.mean(r["final_accuracy"] for r in mine)
            scored.append((steps_needed, -final, lr, reached))
        steps_needed, neg_final, lr, reached = min(scored)
        best[name] = {
            "lr": lr,
            "steps_to_target": None if steps_needed == float("inf") else steps_needed,
            "per_seed": reached,
            "final_accuracy": -neg_final,
            "sweep": {str(s[2]): (None if s[0] == float("inf") else s[0]) for s in scored},
        }
    return best


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    target = results["targets"][0]
    for name, color in zip(SWEEPS, ("tab:blue", "tab:orange", "tab:green")):
        lr = results["best"][str(target)][name]["lr"]
        runs = [r for r in results["runs"] if r["optimizer"] == name and r["lr"] == lr]
        steps_axis = [s for s, _ in runs[0]["accuracy"]]
        acc = np.mean([[a for _, a in r["accuracy"]] for r in runs], axis=0)
        loss = np.mean([r["loss"] for r in runs], axis=0)
        axes[0].plot(steps_axis, acc, color=color, label=f"{name} lr={lr}")
        window = 10
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        axes[1].plot(np.arange(window, len(loss) + 1), smooth, color=color, label=f"{name} lr={lr}")
    axes[0].axhline(target, color="gray", ls=":", lw=1)
    axes[0].set(
        xlabel="step",
        ylabel="test accuracy",
        ylim=(0.5, 1.0),
        title=f"digits, MLP {HIDDEN}, 8 devices (mean of {results['seeds']} seeds)",
    )
    axes[1].set(xlabel="step", ylabel="training loss (10-step mean)", yscale="log")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(results: dict) -> str:
    lines = [
        f"Digits (1438 train / 359 test), MLP {HIDDEN}, 8 virtual devices, global batch "
        f"{results['batch']}, {results['steps']} steps, {results['seeds']} seeds; test "
        f"accuracy every {results['eval_every']} steps. K-FAC options: "
        + ", ".join(f"{k}={v}" for k, v in KFAC_OPTIONS.items())
        + ".",
        "",
    ]
    for target in results["targets"]:
        best = results["best"][str(target)]
        lines += [
            f"Steps to {target:.0%} test accuracy (median over seeds; best learning rate of "
            "the sweep; `-` never within the run):",
            "",
            "| optimizer | best lr | steps to target | per seed | sweep (lr: steps) | final accuracy |",
            "|---|---|---|---|---|---|",
        ]
        for name, b in best.items():
            sweep = ", ".join(f"{lr}: {'-' if s is None else int(s)}" for lr, s in b["sweep"].items())
            per_seed = ", ".join("-" if s is None else str(s) for s in b["per_seed"])
            steps_needed = "-" if b["steps_to_target"] is None else f"{b['steps_to_target']:g}"
            lines.append(f"| {name} | {b['lr']} | {steps_needed} | {per_seed} | {sweep} | {b['final_accuracy']:.3f} |")
        lines.append("")
    timing = {
        name: statistics.median(r["median_step_s"] for r in results["runs"] if r["optimizer"] == name)
        for name in SWEEPS
    }
    lines.append(
        "Median step time in the same run (8 virtual devices on a shared 2-core machine; "
        "K-FAC's step does more work, so steps are not seconds): "
        + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in timing.items())
        + "."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.9])
    args = parser.parse_args()
    split = data.load_digits()
    mesh = jax.make_mesh((8,), ("data",))
    runs = []
    for seed in range(args.seeds):
        for name, lrs in SWEEPS.items():
            for lr in lrs:
                run = train(name, lr, seed, split, args, mesh)
                runs.append(run)
                print(
                    f"seed {seed} {name} lr={lr}: steps to {args.targets}: {run['steps_to']}, "
                    f"final {run['final_accuracy']:.3f}",
                    flush=True,
                )
    results = {
        "steps": args.steps,
        "seeds": args.seeds,
        "batch": args.batch,
        "eval_every": args.eval_every,
        "targets": args.targets,
        "kfac_options": KFAC_OPTIONS,
        "hidden": HIDDEN,
        "sweeps": SWEEPS,
        "runs": runs,
        "best": {str(t): best_runs(runs, t) for t in args.targets},
    }
    out = ROOT / "benchmarks" / "results" / "kfac_convergence.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results, ROOT / "docs" / "kfac_convergence.png")
    table = render(results)
    doc = ROOT / "docs" / "benchmarks.md"
    if doc.exists():
        text = doc.read_text()
        text = re.sub(
            r"(<!-- kfac_convergence:start -->\n).*?(<!-- kfac_convergence:end -->)",
            lambda m: m.group(1) + table + "\n" + m.group(2),
            text,
            flags=re.S,
        )
        doc.write_text(text)
    print(table)


if __name__ == "__main__":
    main()
