"""Digits classification (scikit-learn's 8x8 digits) with a scheduled data-parallel step.

    python examples/digits.py --model cnn --strategy dear --steps 200
    jaxsched launch --hosts 2 --cpu-devices 2 -- python examples/digits.py --steps 100

The step is the one users already write (``jaxsched.demo.steps.make_step``: value_and_grad on
the local shard, ``lax.pmean`` of the gradients, an optax update inside ``jax.shard_map``);
``jaxsched.schedule`` reorders its gradient communication. Options, checkpoints, metrics
and Ctrl-C live in ``_common.py``; ``--help`` lists every option with its default.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere

import _common  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "configs"


def main(argv: Sequence[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], default_config=None, default_out="runs/digits")
    p.add_argument("--model", choices=("mlp", "cnn"), help="mlp (the default) or cnn: reads configs/MODEL_digits.toml")
    opts = _common.parse(p, argv, lambda a: str(CONFIGS / f"{a.model or 'mlp'}_digits.toml"))
    cfg, model = opts.cfg, opts.args.model
    if cfg.data.name != "digits" or model not in (None, cfg.model.name):
        p.error(
            f"--config {opts.args.config} trains {cfg.model.name!r} on {cfg.data.name!r}, "
            f"but this trainer reads the digits{' with --model ' + model if model else ''}"
        )
    mesh = _common.start_devices(opts)  # first touch of a device: after validation

    import jax
    import numpy as np

    import jaxsched
    from jaxsched.zoo import data
    from jaxsched.zoo import models
    from jaxsched.demo import steps

    split = data.load_digits()
    net = models.build(cfg.model.name, split.train_x.shape[1:], split.num_classes, seed=opts.seed, **cfg.model.options)
    params, apply_fn = models.pure(net)
    _common.check_buckets(opts.args.buckets, params)
    tx = steps.make_optimizer(cfg.optimizer)
    sched = jaxsched.schedule(
        steps.make_step(apply_fn, tx, mesh),
        strategy=opts.args.strategy,
        buckets=opts.args.buckets,
        engine=opts.args.engine,
        compression=opts.args.compression,
    )

    def batch(step: int) -> tuple:
        return _common.global_batch(mesh, (split.train_x, split.train_y), opts.batch_size, step, opts.seed)

    # With an example batch, init returns the scheduled layout: the checkpoint's target.
    state = sched.init(params, tx.init(params), batch(0))
    with _common.Run(opts, "digits", unit="images") as run:
        state = run.restore(state)
        for step in run.steps():
            state, aux = sched(state, batch(step))
            run.log(step, aux, state)
    if run.interrupted:
        return run.stopped()

    params, _ = sched.finalize(state)  # ordinary trees (dear: the deferred all-gathers)
    logits = jax.jit(apply_fn)(_common.host(params), split.test_x)
    test_accuracy = float(np.mean(np.argmax(logits, -1) == split.test_y))
    return run.finish(sched, train_accuracy=run.recent_mean("accuracy"), test_accuracy=test_accuracy)


if __name__ == "__main__":
    sys.exit(_common.script(main))
