"""A tiny decoder-only language model (the zoo's TransformerLM) on generated sequences.

    python examples/tiny_lm.py --strategy dear --steps 200
    jaxsched launch --hosts 2 --cpu-devices 2 -- python examples/tiny_lm.py --steps 100

The sequences come from a sparse Markov chain (``jaxsched.zoo.data.synthetic_tokens``): each
token has two possible successors, so a model that learned the chain reaches a loss of
ln 2 = 0.693 and about 50% next-token accuracy, and no model can do better. The summary
reports the held-out loss against that bound; tokens/s per step go to metrics.jsonl.
Options: ``--help`` or ``_common.py``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere

import _common  # noqa: E402

CONFIG = Path(__file__).parent.parent / "configs" / "tiny_lm.toml"


def main(argv: Sequence[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], default_config=str(CONFIG), default_out="runs/tiny_lm")
    opts = _common.parse(p, argv)
    if opts.cfg.data.name != "synthetic_tokens" or opts.cfg.model.name != "transformer":
        p.error(
            f"--config {opts.args.config}: this trainer runs model 'transformer' on data "
            f"'synthetic_tokens', not {opts.cfg.model.name!r} on {opts.cfg.data.name!r}"
        )
    mesh = _common.start_devices(opts)  # first touch of a device: after validation

    import jax
    import numpy as np

    import jaxsched
    from jaxsched.zoo import data
    from jaxsched.zoo import models
    from jaxsched.demo import steps

    split = data.load("synthetic_tokens", seed=opts.seed, **opts.cfg.data.options)
    seq_len = split.train_x.shape[1]
    net = models.build("transformer", (seq_len,), split.num_classes, seed=opts.seed, **opts.cfg.model.options)
    params, apply_fn = models.pure(net)
    _common.check_buckets(opts.args.buckets, params)
    tx = steps.make_optimizer(opts.cfg.optimizer)
    # make_step's loss is the mean cross-entropy over every position: next-token prediction.
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
    with _common.Run(opts, "tiny_lm", unit="tokens", per_example=seq_len) as run:
        state = run.restore(state)
        for step in run.steps():
            state, aux = sched(state, batch(step))
            run.log(step, aux, state)
    if run.interrupted:
        return run.stopped()

    params, _ = sched.finalize(state)
    logits = jax.jit(apply_fn)(_common.host(params), split.test_x)
    test_loss = float(steps.cross_entropy(logits, split.test_y))
    return run.finish(
        sched,
        test_loss=test_loss,
        best_possible_loss=math.log(2),
        test_token_accuracy=float(np.mean(np.argmax(logits, -1) == split.test_y)),
    )


if __name__ == "__main__":
    sys.exit(_common.script(main))
