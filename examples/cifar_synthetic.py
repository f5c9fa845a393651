"""Throughput of a small image model: the residual CNN on synthetic CIFAR-shaped data.

    python examples/cifar_synthetic.py --strategy wfbp --compression topk:0.01 --steps 50
    jaxsched launch --hosts 2 --cpu-devices 2 -- python examples/cifar_synthetic.py --steps 20

The images (32x32x3) are generated, nothing is downloaded: each class is a coloured
grating of its own orientation and frequency at a random phase, under noise
(``jaxsched.zoo.data.synthetic_cifar``), so the loss falls as it would on real data. Reports
images/s per step (metrics.jsonl) and the median over the run (summary.json); the first
step, which compiles, is left out of the median. Options: ``--help`` or ``_common.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere

import _common  # noqa: E402

CONFIG = Path(__file__).parent.parent / "configs" / "cnn_cifar_synthetic.toml"


def main(argv: Sequence[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], default_config=str(CONFIG), default_out="runs/cifar_synthetic")
    opts = _common.parse(p, argv)
    if opts.cfg.data.name != "synthetic_cifar" or opts.cfg.model.name != "cnn":
        p.error(
            f"--config {opts.args.config}: this trainer runs model 'cnn' on data "
            f"'synthetic_cifar', not {opts.cfg.model.name!r} on {opts.cfg.data.name!r}"
        )
    mesh = _common.start_devices(opts)  # first touch of a device: after validation

    import jax
    import numpy as np

    import jaxsched
    from jaxsched.zoo import data
    from jaxsched.zoo import models
    from jaxsched.demo import steps

    split = data.load("synthetic_cifar", seed=opts.seed, **opts.cfg.data.options)
    if opts.batch_size > len(split.train_x):
        p.error(f"--batch-size {opts.batch_size} exceeds the {len(split.train_x)} training images")
    net = models.build("cnn", split.train_x.shape[1:], split.num_classes, seed=opts.seed, **opts.cfg.model.options)
    params, apply_fn = models.pure(net)
    _common.check_buckets(opts.args.buckets, params)
    tx = steps.make_optimizer(opts.cfg.optimizer)
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
    with _common.Run(opts, "cifar_synthetic", unit="images") as run:
        state = run.restore(state)
        for step in run.steps():
            state, aux = sched(state, batch(step))
            run.log(step, aux, state)
    if run.interrupted:
        return run.stopped()

    params, _ = sched.finalize(state)
    evaluate = jax.jit(apply_fn)
    logits = np.concatenate(
        [evaluate(_common.host(params), split.test_x[i : i + 256]) for i in range(0, len(split.test_x), 256)]
    )
    test_accuracy = float(np.mean(np.argmax(logits, -1) == split.test_y))
    return run.finish(sched, train_accuracy=run.recent_mean("accuracy"), test_accuracy=test_accuracy)


if __name__ == "__main__":
    sys.exit(_common.script(main))
