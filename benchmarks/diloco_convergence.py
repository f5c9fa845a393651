"""Does DiLoCo keep up with data parallelism at equal tokens? 8 replicas, a tiny LM.

The zoo's ``TransformerLM`` (1 block, dim 32) on structured synthetic tokens (a sparse
Markov chain, ``jaxsched.zoo.data.synthetic_tokens``), 8 virtual CPU devices on one data axis:
every device is one DiLoCo replica. Every run sees the same batches for a given seed (so
the same tokens); the inner optimizer is the data-parallel run's (AdamW). Configurations:
plain data parallelism (``allreduce``) and ``diloco`` with H in {10, 50}, fragments in {1,
4} (streaming with τ=1 when 4), outer gradients in float32 or 4 bits
(``Quantize(bits=4)``, error feedback). Reports the held-out loss of the final
parameters (``sched.finalize``: replicas averaged) and the mean training loss of the last
20 steps, per seed, and writes ``benchmarks/results/diloco_convergence.json``.

    python benchmarks/diloco_convergence.py [--steps 300] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # before numpy BLAS runs (FACTS.md: rendezvous hazard)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import data  # noqa: E402
from jaxsched.zoo import models
from jaxsched.demo import steps
from jaxsched.runtime.compress import Quantize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEQ, VOCAB = 16, 32
MODEL = {"dim": 32, "heads": 2, "layers": 1}


def configs():
    yield "data parallel", "allreduce", {}
    for h in (10, 50):
        for f in (1, 4):
            for bits in (None, 4):
                options = {"inner_steps": h, "fragments": f, "overlap_steps": 1 if f > 1 else 0}
                if bits:
                    options["compression"] = Quantize(bits=bits)
                name = f"diloco H={h} F={f}" + (" tau=1" if f > 1 else "") + (" 4-bit" if bits else "")
                yield name, "diloco", options


def test_loss(apply_fn, params, split) -> float:
    logits = jax.jit(apply_fn)(params, jnp.asarray(split.test_x[:512]))
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(split.test_y[:512])).mean())


def run(args) -> dict:
    split = data.synthetic_tokens(n=8192, seq_len=SEQ, vocab_size=VOCAB, seed=0)
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.adamw(args.lr)
    results = {
        "steps": args.steps,
        "batch_per_replica": args.batch,
        "replicas": 8,
        "model": {"name": "transformer", "seq_len": SEQ, "vocab": VOCAB, **MODEL},
        "inner_optimizer": f"adamw({args.lr})",
        "outer_optimizer": "sgd(0.7, momentum=0.9, nesterov=True)",
        "command": f"python benchmarks/diloco_convergence.py --steps {args.steps} --seeds {args.seeds}",
        "runs": {},
    }
    chosen = [c for c in configs() if not args.only or any(o in c[0] for o in args.only)]
    for name, strategy, options in chosen:
        runs = []
        for seed in range(args.seeds):
            params, apply_fn = models.pure(models.build("transformer", (SEQ,), VOCAB, seed=seed, **MODEL))
            step = steps.make_step(apply_fn, tx, mesh)
            sched = jaxsched.schedule(step, strategy=strategy, engine="xla", **options)
            state = sched.init(params, tx.init(params))
            rng = np.random.default_rng(100 + seed)
            losses, start = [], time.perf_counter()
            for _ in range(args.steps):
                idx = rng.integers(0, split.train_x.shape[0], 8 * args.batch)
                batch = steps.shard_batch((jnp.asarray(split.train_x[idx]), jnp.asarray(split.train_y[idx])), mesh)
                state, aux = sched(state, batch)
                losses.append(float(jax.block_until_ready(aux["loss"])))
            final, _ = sched.finalize(state)
            runs.append(
                {
                    "seed": seed,
                    "test_loss": test_loss(apply_fn, final, split),
                    "train_loss_last20": float(np.mean(losses[-20:])),
                    "seconds": time.perf_counter() - start,
                }
            )
            print(
                f"{name:<32} seed {seed}: test {runs[-1]['test_loss']:.4f} "
                f"train {runs[-1]['train_loss_last20']:.4f} ({runs[-1]['seconds']:.1f} s)",
                flush=True,
            )
        tests = [r["test_loss"] for r in runs]
        results["runs"][name] = {
            "strategy": strategy,
            "options": {k: (repr(v) if k == "compression" else v) for k, v in options.items()},
            "per_seed": runs,
            "test_loss_mean": float(np.mean(tests)),
            "test_loss_std": float(np.std(tests)),
        }
    base = results["runs"].get("data parallel")
    if base:
        for name, r in results["runs"].items():
            r["vs_data_parallel"] = r["test_loss_mean"] / base["test_loss_mean"] - 1
    for h in (10, 50):
        for f in (1, 4):
            stem = f"diloco H={h} F={f}" + (" tau=1" if f > 1 else "")
            full, quant = results["runs"].get(stem), results["runs"].get(stem + " 4-bit")
            if full and quant:
                quant["vs_full_precision"] = quant["test_loss_mean"] / full["test_loss_mean"] - 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--only", nargs="*", help="run only configurations whose name contains one of these")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/diloco_convergence.json"))
    args = parser.parse_args()
    results = run(args)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"{'configuration':<32} {'test loss':>18} {'vs DP':>8} {'vs full':>8}")
    for name, r in results["runs"].items():
        vs = r.get("vs_data_parallel")
        vf = r.get("vs_full_precision")
        print(
            f"{name:<32} {r['test_loss_mean']:.4f} ± {r['test_loss_std']:.4f} "
            f"{'' if vs is None else f'{100 * vs:+.2f}%':>8} {'' if vf is None else f'{100 * vf:+.2f}%':>8}"
        )


if __name__ == "__main__":
    main()
