"""Convergence on real data with compression: digits, 8 devices, density 1 %.

Run from the repository root (about 10 minutes on 2 shared cores):

    .venv/bin/python benchmarks/compression_convergence.py

Trains the zoo MLP on scikit-learn digits (``jaxsched.zoo.data.load_digits``), data parallel
over 8 virtual CPU devices, with ``jaxsched.schedule(step, strategy="wfbp",
compression=...)``. It runs these variants, for 3 seeds each:

- dense (no compression), with SGD momentum 0.9 (the baseline) and with plain SGD;
- TopK(1 %) and GlobalTopK(1 %), with error feedback;
- TopK(1 %) without error feedback, for contrast;
- PowerSGD at rank 1 and at rank 4;
- Deep Gradient Compression's options on TopK(1 %) and GlobalTopK(1 %): warm-up
  (``warmup_steps``, 25 % -> 1 %), momentum correction (compressor ``momentum=0.9`` with
  ``optax.sgd(lr)``, no optimizer momentum), and both.

Every run uses the same seeds, initial parameters and batch order, and a constant learning
rate, so the runs are evaluated at each of ``--steps`` (300 and 660 by default) on the way:
the 300-step numbers are what a 300-step run gives. Bytes per step are ``bytes_sent`` read
after every step, averaged over the steps up to that point (warm-up included). It writes
``benchmarks/results/compression_convergence.json``, a loss plot
``docs/compression_convergence.png`` and one table per step count between the
``convergence-<steps>`` markers in ``docs/benchmarks.md``.

The warm-up sweep in the docs: ``--no-doc --warmup-steps 50 --variants dense "topk 1% +
warm-up" "topk 1% + warm-up + momentum corr." "topk 1% + warm-up + clipping" --out
benchmarks/results/compression_convergence_sweep_w50.json`` (and 150; 150 with
``--warmup-tiers 6``), then ``--sweep-table FILES`` writes the table between the
``convergence-sweep`` markers. ``--render FILE`` rewrites the tables and the plot from a
result file without training.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # create the CPU client before numpy's BLAS runs (docs/benchmarks.md hazard)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import data  # noqa: E402
from jaxsched.zoo import models
from jaxsched.demo import steps
from jaxsched.runtime.compress import GlobalTopK, PowerSGD, TopK, bytes_sent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8
#: Warm-up steps of the DGC variants (``--warmup-steps``), from 25 % to the target density.
WARMUP_STEPS = 100
#: Density levels of the warm-up (``--warmup-tiers``; None: DGC's factor of 4 between levels).
WARMUP_TIERS = None
#: Local clipping of the clipping variants (``--clip-norm``): the largest L2 norm of a
#: device's gradient per bucket (the whole local gradient's norm is about 1 at the start).
CLIP_NORM = 0.5
#: Momentum: the optimizer's (``optax.sgd(lr, momentum=...)``) or, with momentum correction,
#: the compressor's (then the optimizer is plain ``optax.sgd(lr)``).
MOMENTUM = 0.9
#: variant -> (compressor or None, the optimizer's momentum)
VARIANTS = {
    "dense": lambda: (None, MOMENTUM),
    "dense, sgd without momentum": lambda: (None, 0.0),
    "topk 1% + EF": lambda: (TopK(0.01), MOMENTUM),
    "gtopk 1% + EF": lambda: (GlobalTopK(0.01), MOMENTUM),
    "topk 1%, no EF": lambda: (TopK(0.01, error_feedback=False), MOMENTUM),
    "powersgd rank 1": lambda: (PowerSGD(rank=1), MOMENTUM),
    "powersgd rank 4": lambda: (PowerSGD(rank=4), MOMENTUM),
    "topk 1% + warm-up": lambda: (TopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS), MOMENTUM),
    "topk 1% + momentum corr.": lambda: (TopK(0.01, momentum=MOMENTUM), 0.0),
    "topk 1% + warm-up + momentum corr.": lambda: (
        TopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS, momentum=MOMENTUM),
        0.0,
    ),
    "topk 1% + warm-up + clipping": lambda: (
        TopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS, clip_norm=CLIP_NORM),
        MOMENTUM,
    ),
    "topk 1% + warm-up + momentum corr. + clipping": lambda: (
        TopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS, momentum=MOMENTUM, clip_norm=CLIP_NORM),
        0.0,
    ),
    "gtopk 1% + warm-up": lambda: (GlobalTopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS), MOMENTUM),
    "gtopk 1% + momentum corr.": lambda: (GlobalTopK(0.01, momentum=MOMENTUM), 0.0),
    "gtopk 1% + warm-up + momentum corr.": lambda: (
        GlobalTopK(0.01, warmup_steps=WARMUP_STEPS, warmup_tiers=WARMUP_TIERS, momentum=MOMENTUM),
        0.0,
    ),
}
#: The variants of each panel of the loss plot.
ISSUE_11 = ["dense", "topk 1% + EF", "gtopk 1% + EF", "topk 1%, no EF", "powersgd rank 1", "powersgd rank 4"]


def optimizer_name(momentum: float) -> str:
    return f"sgd, momentum {momentum}" if momentum else "sgd"


def run(
    variant: str, seed: int, split: data.Split, checkpoints: list[int], batch: int, lr: float, hidden: tuple[int, ...]
) -> dict:
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, seed=seed, hidden=hidden))
    compression, momentum = VARIANTS[variant]()
    tx = optax.sgd(lr, momentum=momentum or None)
    step = steps.make_step(apply_fn, tx, mesh)
    sched = (
        jaxsched.schedule(step, strategy="wfbp", compression=compression)
        if compression is not None
        else jaxsched.schedule(step, strategy="wfbp")
    )
    state = sched.init(params, tx.init(params))
    rng = np.random.default_rng(1000 + seed)
    n = len(split.train_x) // batch * batch
    dense_bytes = 4 * sum(np.size(p) for p in jax.tree.leaves(params))
    losses, sent, accuracy, mean_bytes = [], [], {}, {}
    start = time.perf_counter()
    while len(losses) < max(checkpoints):
        order = rng.permutation(len(split.train_x))[:n]
        for i in range(0, n, batch):
            idx = order[i : i + batch]
            state, aux = sched(state, steps.shard_batch((split.train_x[idx], split.train_y[idx]), mesh))
            jax.block_until_ready(state)  # one multi-device step in flight (docs/benchmarks.md)
            losses.append(float(aux["loss"]))
            sent.append(float(bytes_sent(state).mean()) if compression is not None else dense_bytes)
            if len(losses) in checkpoints:  # evaluate on the way (constant lr: a shorter run)
                final, _ = sched.finalize(state)
                logits = apply_fn(final, split.test_x)
                accuracy[str(len(losses))] = float(np.mean(np.argmax(np.asarray(logits), -1) == split.test_y))
                mean_bytes[str(len(losses))] = float(np.mean(sent))
            if len(losses) == max(checkpoints):
                break
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "seed": seed,
        "optimizer": optimizer_name(momentum),
        "compressor": repr(compression),
        "test_accuracy": accuracy,
        "losses": losses,
        "bytes_per_step_per_device": mean_bytes,
        "dense_bytes_per_step_per_device": dense_bytes,
        "train_seconds": seconds,
    }


def summarize(runs: list[dict], steps_done: int) -> list[dict]:
    """One row per variant after ``steps_done`` steps; gaps against ``dense`` (SGD momentum)."""
    key = str(steps_done)
    rows = []
    dense = np.mean([r["test_accuracy"][key] for r in runs if r["variant"] == "dense"])
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        acc = np.array([r["test_accuracy"][key] for r in mine])
        sent = np.mean([r["bytes_per_step_per_device"][key] for r in mine])
        rows.append(
            {
                "variant": variant,
                "optimizer": mine[0]["optimizer"],
                "compressor": mine[0]["compressor"],
                "steps": steps_done,
                "accuracy_mean": float(acc.mean()),
                "accuracy_per_seed": acc.tolist(),
                "gap_to_dense_points": float(100 * (acc.mean() - dense)),
                "final_loss_mean": float(np.mean([np.mean(r["losses"][steps_done - 20 : steps_done]) for r in mine])),
                "bytes_per_step_per_device": float(sent),
                "compression_ratio": float(mine[0]["dense_bytes_per_step_per_device"] / sent),
            }
        )
    return rows


def table(rows: list[dict], meta: dict) -> str:
    steps_done = rows[0]["steps"]
    lines = [
        f"Digits, zoo MLP {tuple(meta['hidden'])}, {DEVICES} devices, `wfbp`, lr {meta['lr']}, global "
        f"batch {meta['batch']}, **{steps_done} steps** ({steps_done / meta['steps_per_epoch']:.1f} "
        f"epochs), seeds {meta['seeds']}. Test accuracy is on the 360 held-out images; "
        f'"vs dense" is against dense training with SGD momentum {meta["momentum"]}. Momentum '
        f"correction runs `optax.sgd(lr)` with the compressor's `momentum={meta['momentum']}`; "
        f"warm-up is `warmup_steps={meta['warmup_steps']}` from 25 % to 1 % "
        f"({meta['warmup_tiers'] or 'the default'} tiers); clipping is `clip_norm={meta['clip_norm']}`. "
        f"Bytes: compressed payload per "
        f"device per step (`jaxsched.runtime.compress.bytes_sent` after every step), averaged over the "
        f"{steps_done} steps, warm-up included; dense float32 is {meta['dense_bytes']} B.",
        "",
        "| variant | optimizer | test accuracy (mean of seeds) | per seed | vs dense (points) "
        "| loss (last 20 steps) | bytes/step/device | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{100 * a:.1f}" for a in r["accuracy_per_seed"])
        lines.append(
            f"| {r['variant']} | {r['optimizer']} | {100 * r['accuracy_mean']:.2f} % | "
            f"{per_seed} | {r['gap_to_dense_points']:+.2f} | {r['final_loss_mean']:.4f} | "
            f"{r['bytes_per_step_per_device']:.0f} | {r['compression_ratio']:.1f}x |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, warmup_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("error feedback, PowerSGD", [v for v in VARIANTS if v in ISSUE_11]),
        (
            "DGC warm-up and momentum correction",
            ["dense", "dense, sgd without momentum", "topk 1% + EF"]
            + [v for v in VARIANTS if "warm-up" in v or "momentum corr." in v],
        ),
    ]
    panels = [(title, [v for v in names if any(r["variant"] == v for r in runs)]) for title, names in panels]
    panels = [(title, names) for title, names in panels if names]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False, sharey=True)
    palette = plt.get_cmap("tab20").colors
    color = {v: palette[(2 * i) % 20 + (2 * i) // 20 % 2] for i, v in enumerate(VARIANTS)}
    for ax, (title, names) in zip(axes[0], panels):
        for variant in names:
            curves = np.array([r["losses"] for r in runs if r["variant"] == variant])
            mean = curves.mean(0)
            window = 10
            smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
            ax.plot(
                np.arange(len(smooth)) + window - 1,
                smooth,
                label=variant,
                lw=1.3,
                ls="--" if "gtopk" in variant else "-",
                color=color[variant],
            )
        if "DGC" in title:
            ax.axvline(warmup_steps, color="gray", lw=0.8, ls=":")
            ax.text(warmup_steps, ax.get_ylim()[1], " end of warm-up", va="top", fontsize=8, color="gray")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5)
    axes[0][0].set_ylabel("training loss (mean of seeds, 10-step moving average)")
    fig.suptitle("digits, 8 devices: dense vs compressed gradients (density 1 %)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_doc(section: str, marker: str) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else ""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    block = f"{begin}\n{section}\n{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    doc.write_text(text)


def to_json(result: dict) -> str:
    """Readable JSON with each run's loss curve on one line (rounded to 6 significant digits)."""
    runs = result["runs"]
    body = {k: v for k, v in result.items() if k != "runs"}
    text = json.dumps(body, indent=1)[:-2]
    lines = [json.dumps({**r, "losses": [float(f"{x:.6g}") for x in r["losses"]]}) for r in runs]
    return text + ',\n "runs": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"


def publish(result: dict) -> None:
    """The loss plot and one table per step count, into docs/."""
    meta, runs = result["meta"], result["runs"]
    plot(runs, ROOT / "docs" / "compression_convergence.png", meta["warmup_steps"])
    for key, rows in result["rows"].items():
        figure = "\n\n![training loss](compression_convergence.png)" if int(key) == max(meta["steps"]) else ""
        write_doc(table(rows, meta) + figure, f"convergence-{key}")


def sweep_table(paths: list[Path]) -> str:
    """The DGC variants of several ``--no-doc`` runs (other warm-up lengths, tiers, clipping)."""
    lines = [
        "| file | warmup_steps | warmup_tiers | clip_norm | variant | optimizer | "
        + " | ".join(f"{k} steps: accuracy, vs dense" for k in ("300", "660"))
        + " | bytes/step/device (300 steps) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        result = json.loads(path.read_text())
        meta = result["meta"]
        by_steps = {k: {r["variant"]: r for r in rows} for k, rows in result["rows"].items()}
        for variant, row in by_steps["300"].items():
            if not any(option in variant for option in ("warm-up", "momentum corr.", "clipping")):
                continue
            cells = [
                f"{100 * by_steps[k][variant]['accuracy_mean']:.2f} %, "
                f"{by_steps[k][variant]['gap_to_dense_points']:+.2f}"
                for k in ("300", "660")
            ]
            clip = meta["clip_norm"] if "clipping" in variant else "-"
            lines.append(
                f"| `{path.name}` | {meta['warmup_steps']} | {meta['warmup_tiers'] or 'default'} | "
                f"{clip} | {variant} | {row['optimizer']} | {' | '.join(cells)} | "
                f"{row['bytes_per_step_per_device']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    global VARIANTS, WARMUP_STEPS, WARMUP_TIERS, CLIP_NORM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=[300, 660],
        help="evaluate (and write a table) after each of these step counts",
    )
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    parser.add_argument("--warmup-tiers", type=int, default=WARMUP_TIERS)
    parser.add_argument("--clip-norm", type=float, default=CLIP_NORM)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compression_convergence.json")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="train nothing: write the tables and the plot from this result file"
    )
    parser.add_argument(
        "--sweep-table",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="train nothing: write the table of these --no-doc result files between the convergence-sweep markers",
    )
    args = parser.parse_args()
    if args.render:
        publish(json.loads(args.render.read_text()))
        return
    if args.sweep_table:
        write_doc(sweep_table(args.sweep_table), "convergence-sweep")
        return
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or "dense" not in args.variants:
        parser.error(
            f"unknown variants {unknown}; choose from {list(VARIANTS)} (dense included: "
            f"the gaps are measured against it)"
        )
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants}
    WARMUP_STEPS, WARMUP_TIERS, CLIP_NORM = args.warmup_steps, args.warmup_tiers, args.clip_norm
    checkpoints = sorted(set(args.steps))
    split = data.load_digits()
    runs = []
    for seed in args.seeds:
        for variant in VARIANTS:
            r = run(variant, seed, split, checkpoints, args.batch, args.lr, tuple(args.hidden))
            print(
                f"seed {seed} {variant:46s} test accuracy "
                + " ".join(f"{k}: {100 * a:.2f} %" for k, a in r["test_accuracy"].items())
                + f" bytes {r['bytes_per_step_per_device'][str(checkpoints[-1])]:.0f} "
                f"({r['train_seconds']:.1f} s)",
                flush=True,
            )
            runs.append(r)
    tables = {steps_done: summarize(runs, steps_done) for steps_done in checkpoints}
    meta = {
        "hidden": tuple(args.hidden),
        "lr": args.lr,
        "batch": args.batch,
        "steps": checkpoints,
        "steps_per_epoch": len(split.train_x) // args.batch,
        "seeds": args.seeds,
        "warmup_steps": WARMUP_STEPS,
        "warmup_tiers": WARMUP_TIERS,
        "clip_norm": CLIP_NORM,
        "momentum": MOMENTUM,
        "dense_bytes": runs[0]["dense_bytes_per_step_per_device"],
    }
    for rows in tables.values():
        print(table(rows, meta))
    result = {
        "meta": meta,
        "rows": {str(k): v for k, v in tables.items()},
        "runs": runs,
        "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(result))
    if not args.no_doc:
        publish(result)


if __name__ == "__main__":
    main()
