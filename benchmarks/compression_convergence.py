"""Convergence on real data with compression (issue 11): digits, 8 devices, density 1 %.

Run from the repository root (about 5 minutes on 2 shared cores):

    PYTHONPATH=. .venv/bin/python benchmarks/compression_convergence.py

Trains the zoo MLP on scikit-learn digits (``jaxsched.data.load_digits``), data parallel
over 8 virtual CPU devices, with ``jaxsched.schedule(step, strategy="wfbp",
compression=...)``. It runs these variants, for 3 seeds each:

- dense (no compression);
- TopK(1 %) and GlobalTopK(1 %), with error feedback;
- TopK(1 %) without error feedback, for contrast;
- PowerSGD at rank 1 and at rank 4.

Every run uses the same seeds, initial parameters and batch order. It writes
``benchmarks/results/compression_convergence.json``, a loss plot
``docs/compression_convergence.png`` and the table between the ``convergence`` markers in
``docs/compression.md``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # create the CPU client before numpy's BLAS runs (docs/cpu_facts.md hazard)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched import data, models, steps  # noqa: E402
from jaxsched.compress import GlobalTopK, PowerSGD, TopK, bytes_sent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8
VARIANTS = {
    "dense": lambda: None,
    "topk 1% + EF": lambda: TopK(0.01),
    "gtopk 1% + EF": lambda: GlobalTopK(0.01),
    "topk 1%, no EF": lambda: TopK(0.01, error_feedback=False),
    "powersgd rank 1": lambda: PowerSGD(rank=1),
    "powersgd rank 4": lambda: PowerSGD(rank=4),
}


def run(variant: str, seed: int, split: data.Split, epochs: int, batch: int, lr: float,
        hidden: tuple[int, ...]) -> dict:
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, seed=seed, hidden=hidden))
    tx = optax.sgd(lr, momentum=0.9)
    step = steps.make_step(apply_fn, tx, mesh)
    compression = VARIANTS[variant]()
    sched = (jaxsched.schedule(step, strategy="wfbp", compression=compression)
             if compression is not None else jaxsched.schedule(step, strategy="wfbp"))
    state = sched.init(params, tx.init(params))
    rng = np.random.default_rng(1000 + seed)
    n = len(split.train_x) // batch * batch
    losses, sent = [], []
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(split.train_x))[:n]
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            state, aux = sched(state, steps.shard_batch((split.train_x[idx], split.train_y[idx]), mesh))
            jax.block_until_ready(state)  # one multi-device step in flight (docs/cpu_facts.md)
            losses.append(float(aux["loss"]))
            if compression is not None:
                sent.append(int(bytes_sent(state).mean()))
    seconds = time.perf_counter() - start
    final, _ = sched.finalize(state)
    logits = apply_fn(final, split.test_x)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == split.test_y))
    dense_bytes = 4 * sum(np.size(p) for p in jax.tree.leaves(params))
    return {"variant": variant, "seed": seed, "test_accuracy": accuracy, "losses": losses,
            "bytes_per_step_per_device": float(np.mean(sent)) if sent else float(dense_bytes),
            "dense_bytes_per_step_per_device": dense_bytes, "train_seconds": seconds}


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    dense = np.mean([r["test_accuracy"] for r in runs if r["variant"] == "dense"])
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        acc = np.array([r["test_accuracy"] for r in mine])
        rows.append({"variant": variant, "accuracy_mean": float(acc.mean()),
                     "accuracy_per_seed": acc.tolist(), "gap_to_dense_points": float(100 * (acc.mean() - dense)),
                     "final_loss_mean": float(np.mean([np.mean(r["losses"][-20:]) for r in mine])),
                     "bytes_per_step_per_device": float(np.mean([r["bytes_per_step_per_device"] for r in mine])),
                     "compression_ratio": float(mine[0]["dense_bytes_per_step_per_device"]
                                                / np.mean([r["bytes_per_step_per_device"] for r in mine]))})
    return rows


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"Digits, zoo MLP {meta['hidden']}, {DEVICES} devices, `wfbp`, SGD momentum 0.9, "
             f"lr {meta['lr']}, global batch {meta['batch']}, {meta['epochs']} epochs "
             f"({meta['steps']} steps), seeds {meta['seeds']}. Test accuracy is on the 360 held-out "
             f"images. Bytes: compressed payload per device per step (`jaxsched.compress.bytes_sent`); "
             f"dense float32 is {meta['dense_bytes']} B.",
             "",
             "| variant | test accuracy (mean of seeds) | per seed | vs dense (points) | loss (last 20 steps) | bytes/step/device | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = ", ".join(f"{100 * a:.1f}" for a in r["accuracy_per_seed"])
        lines.append(f"| {r['variant']} | {100 * r['accuracy_mean']:.2f} % | {per_seed} | "
                     f"{r['gap_to_dense_points']:+.2f} | {r['final_loss_mean']:.4f} | "
                     f"{r['bytes_per_step_per_device']:.0f} | {r['compression_ratio']:.1f}x |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant in VARIANTS:
        curves = np.array([r["losses"] for r in runs if r["variant"] == variant])
        mean = curves.mean(0)
        window = 10
        smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=variant, lw=1.4)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of seeds, 10-step moving average)")
    ax.set_title("digits, 8 devices: dense vs compressed gradients (density 1 %)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_doc(section: str, marker: str) -> None:
    doc = ROOT / "docs" / "compression.md"
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


def main() -> None:
    global VARIANTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compression_convergence.json")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/")
    args = parser.parse_args()
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants}
    split = data.load_digits()
    runs = []
    for seed in args.seeds:
        for variant in args.variants:
            r = run(variant, seed, split, args.epochs, args.batch, args.lr, tuple(args.hidden))
            print(f"seed {seed} {variant:18s} test accuracy {100 * r['test_accuracy']:.2f} % "
                  f"loss {np.mean(r['losses'][-20:]):.4f} bytes {r['bytes_per_step_per_device']:.0f} "
                  f"({r['train_seconds']:.1f} s)", flush=True)
            runs.append(r)
    rows = summarize(runs)
    meta = {"hidden": tuple(args.hidden), "lr": args.lr, "batch": args.batch, "epochs": args.epochs,
            "steps": len(runs[0]["losses"]), "seeds": args.seeds,
            "dense_bytes": runs[0]["dense_bytes_per_step_per_device"]}
    print(table(rows, meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json({"meta": meta, "rows": rows, "runs": runs,
                                 "machine": platform.processor() or platform.machine(),
                                 "jax": jax.__version__}))
    if not args.no_doc:
        plot(runs, ROOT / "docs" / "compression_convergence.png")
        write_doc(table(rows, meta) + "\n\n![training loss](compression_convergence.png)", "convergence")


if __name__ == "__main__":
    main()
