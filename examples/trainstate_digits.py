"""Digits with a Flax linen model and a ``TrainState`` step, ``train_step(state, batch)``.

    python examples/trainstate_digits.py --model cnn --strategy dear --steps 200
    jaxsched launch --hosts 2 --cpu-devices 2 -- python examples/trainstate_digits.py --steps 100

The step is the Flax one, written the way the JAX sharding tutorial writes data
parallelism: ``jax.jit`` on global arrays, the batch placed with ``NamedSharding(mesh,
P("data"))``, no collective in sight. ``flax.training.train_state.TrainState`` carries the
parameters, the optimizer state and the step counter, and ``state.apply_gradients`` updates
it. It returns ``(state, metrics)``; ``jaxsched.schedule`` takes it as it is: it partitions
the step per device (``jaxsched.core.partition``) and finds the trained leaves
(``state.params``). Options, checkpoints, metrics and Ctrl-C live
in ``_common.py``; ``--help`` lists every option with its default.
"""

import sys  # no `from __future__ import annotations`: linen's dataclasses read the annotations
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere

import _common  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "configs"


def build_model(name: str, classes: int, options: dict):
    """A Flax linen MLP (``hidden``: layer widths) or CNN (``channels``, ``blocks``: 3x3
    convolutions, every other one with stride 2) for 8x8x1 images."""
    from flax import linen as nn

    class MLP(nn.Module):
        hidden: tuple = (128, 128)

        @nn.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            for width in self.hidden:
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(classes)(x)

    class CNN(nn.Module):
        channels: int = 16
        blocks: int = 2

        @nn.compact
        def __call__(self, x):
            for i in range(self.blocks):
                x = nn.relu(nn.Conv(self.channels, (3, 3), strides=1 + i % 2)(x))
            return nn.Dense(classes)(x.reshape(x.shape[0], -1))

    if name == "mlp":
        return MLP(hidden=tuple(options.get("hidden", (128, 128))))
    return CNN(channels=options.get("channels", 16), blocks=options.get("blocks", 2))


def main(argv: Sequence[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], default_config=None, default_out="runs/trainstate-digits")
    p.add_argument("--model", choices=("mlp", "cnn"), help="mlp (the default) or cnn: reads configs/MODEL_digits.toml")
    opts = _common.parse(p, argv, lambda a: str(CONFIGS / f"{a.model or 'mlp'}_digits.toml"))
    cfg, model_name = opts.cfg, opts.args.model
    if cfg.data.name != "digits" or cfg.model.name not in ("mlp", "cnn") or model_name not in (None, cfg.model.name):
        p.error(
            f"--config {opts.args.config} trains {cfg.model.name!r} on {cfg.data.name!r}, "
            f"but this trainer reads the digits with an mlp or cnn"
            f"{' (--model ' + model_name + ')' if model_name else ''}"
        )
    mesh = _common.start_devices(opts)  # first touch of a device: after validation

    import jax
    import numpy as np
    from flax.training.train_state import TrainState

    import jaxsched
    from jaxsched.zoo import data
    from jaxsched.demo import steps

    split = data.load_digits()
    model = build_model(cfg.model.name, split.num_classes, cfg.model.options)
    variables = model.init(jax.random.key(opts.seed), split.train_x[:1])
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=steps.make_optimizer(cfg.optimizer))
    _common.check_buckets(opts.args.buckets, {"params": state.params})  # paths: params/...

    @jax.jit
    def train_step(state, batch):  # the Flax step you already have, on the global batch
        x, y = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return steps.cross_entropy(logits, y), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        return state, {"loss": loss, "accuracy": steps.accuracy(logits, y)}

    sched = jaxsched.schedule(
        train_step,
        strategy=opts.args.strategy,
        buckets=opts.args.buckets,
        engine=opts.args.engine,
        compression=opts.args.compression,
    )

    def batch(step: int) -> tuple:
        return _common.global_batch(mesh, (split.train_x, split.train_y), opts.batch_size, step, opts.seed)

    # With an example batch, init splits the state (trained params / the rest) and returns
    # the scheduled layout at once: the checkpoint's target.
    sstate = sched.init(state, batch(0))
    with _common.Run(opts, "trainstate_digits", unit="images") as run:
        sstate = run.restore(sstate)
        for step in run.steps():
            sstate, aux = sched(sstate, batch(step))
            run.log(step, aux, sstate)
    if run.interrupted:
        return run.stopped()

    state = sched.finalize(sstate)  # a TrainState again (dear: the deferred all-gathers)
    logits = jax.jit(state.apply_fn)({"params": _common.host(state.params)}, split.test_x)
    test_accuracy = float(np.mean(np.argmax(logits, -1) == split.test_y))
    return run.finish(
        sched,
        train_accuracy=run.recent_mean("accuracy"),
        test_accuracy=test_accuracy,
        trained_steps=int(_common.host(state.step)),
    )


if __name__ == "__main__":
    sys.exit(_common.script(main))
