"""Equinox's data-parallel example, as Equinox writes it, scheduled by jaxsched.

    python examples/equinox_digits.py                    # 8 CPU devices, wfbp
    python examples/equinox_digits.py --strategy dear --steps 300

The step is Equinox's own: ``eqx.filter_jit``, the model and optimizer state replicated and
the batch split with ``eqx.filter_shard``, the sharding passed as an argument, and a model
(``eqx.nn.MLP``) whose leaves include its activation functions. jaxsched takes such leaves
as static, as ``eqx.filter_jit`` does, and returns the model with them in place.

It trains on scikit-learn's handwritten digits (8x8 images, 10 classes) on ``--devices``
virtual CPU devices; the first ``--check-steps`` steps are compared with the plain
``filter_jit`` step on the same batches. Writes ``--out/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere
import _common  # noqa: E402

STRATEGIES = ("wfbp", "dear", "allreduce", "auto")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="wfbp", choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--width", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--check-steps", type=int, default=3, help="steps compared with the plain filter_jit step")
    p.add_argument("--out", type=Path, default=Path("runs/equinox_digits"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "devices", "batch_size", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.batch_size % args.devices:
        p.error(f"--batch-size {args.batch_size} is not divisible by --devices {args.devices}")
    return args


def train(args: argparse.Namespace) -> int:
    _common.ask_for_cpu_devices(args.devices)  # before JAX's first use
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits
    from tqdm import tqdm

    import jaxsched

    if len(jax.devices()) < args.devices:
        sys.exit(f"--devices {args.devices}: JAX has {len(jax.devices())} devices (XLA_FLAGS was set before)")
    mesh = jax.make_mesh(
        (args.devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[: args.devices]
    )
    sharding = jax.NamedSharding(mesh, jax.P("batch"))
    replicated = jax.NamedSharding(mesh, jax.P())

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    train_x, train_y, test_x, test_y = images[:1500], labels[:1500], images[1500:], labels[1500:]

    optim = optax.adam(args.learning_rate)

    def compute_loss(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def train_step(model, opt_state, x, y, sharding):  # Equinox's example, as written
        replicated = jax.NamedSharding(sharding.mesh, jax.P())
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        x, y = eqx.filter_shard((x, y), sharding)
        loss, grads = eqx.filter_value_and_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        return model, opt_state, loss

    def batch(k: int) -> tuple:
        rows = np.random.default_rng(k).integers(0, len(train_x), args.batch_size)
        return eqx.filter_shard((jnp.asarray(train_x[rows]), jnp.asarray(train_y[rows])), sharding)

    def fresh() -> tuple:
        model = eqx.nn.MLP(64, 10, args.width, 2, activation=jax.nn.relu, key=jax.random.key(0))
        return eqx.filter_shard((model, optim.init(eqx.filter(model, eqx.is_array))), replicated)

    sched = jaxsched.schedule(train_step, strategy=args.strategy)
    state = sched.init(*fresh())
    plain = fresh()
    worst, losses = 0.0, []
    start = time.perf_counter()
    for k in tqdm(range(args.steps), desc=f"equinox_digits {args.strategy}", disable=args.no_progress):
        x, y = batch(k)
        state, loss = sched(state, x, y, sharding)
        losses.append(float(loss))
        if k < args.check_steps:  # the plain filter_jit step on the same batch: the same loss
            *plain, plain_loss = train_step(*plain, x, y, sharding)
            worst = max(worst, abs(losses[-1] - float(plain_loss)) / abs(float(plain_loss)))
    seconds = time.perf_counter() - start
    model, _ = sched.finalize(state)  # an eqx.nn.MLP again, its activation function in place
    accuracy = float(jnp.mean(jnp.argmax(jax.vmap(model)(jnp.asarray(test_x)), -1) == jnp.asarray(test_y)))
    summary = {
        "strategy": args.strategy,
        "devices": args.devices,
        "steps": args.steps,
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-5:])),
        "test_accuracy": accuracy,
        "max_relative_loss_difference_to_plain_step": worst,
        "steps_per_second": args.steps / seconds,
        "model": type(model).__name__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{args.strategy} on {args.devices} devices: loss {losses[0]:.3f} -> {summary['final_loss']:.3f}, "
        f"held-out accuracy {accuracy:.3f}; the first {min(args.check_steps, args.steps)} steps match the "
        f"plain filter_jit step to {worst:.1e} (relative)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return train(parse(argv))


if __name__ == "__main__":
    raise SystemExit(main())
