"""A MaxText-style language model trained with FSDP inside a slice and data parallelism
across slices (HSDP), its step scheduled by jaxsched.

    python examples/fsdp_lm.py --steps 60                      # 8 CPU devices: 2 slices x 4
    python examples/fsdp_lm.py --strategy dear --slices 1      # FSDP over all 8
    .venv-aot/bin/python examples/fsdp_lm.py --compile-for v5p:2x2x2:slices=2

The model (``jaxsched.zoo.stacked_lm``) is written as MaxText writes its decoder: the layers'
weights stacked on a leading axis and run by ``lax.scan`` with ``jax.checkpoint``, every
matrix split over ``"fsdp"``, the batch over ``("data", "fsdp")``, and the training step a
plain ``jax.jit`` on global arrays. jaxsched reads the shardings from the arguments: it
gathers each layer's weights one iteration ahead (the next layer's gather runs under the
current layer's compute), reduce-scatters each layer's gradient in its own iteration, and
sums it across slices.

Training runs on ``--devices`` virtual CPU devices, on sequences of a sparse Markov chain
(each token has two successors, so the best possible loss is ln 2 = 0.693); the first
``--check-steps`` steps are compared with the plain step on the same batches. With
``--compile-for TARGET`` nothing runs: the step is compiled for a cluster we do not have
(``jaxsched.tools.aot``, needs the ``aot`` extra) and XLA's schedule estimate of the
scheduled step is printed beside the plain step's, as ``sched.inspect`` reports them.
Writes ``--out/summary.json`` (and ``inspect.json`` with ``--compile-for``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # _common, when run from anywhere
import _common  # noqa: E402

STRATEGIES = ("wfbp", "dear", "allreduce", "auto")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="wfbp", choices=STRATEGIES, help="how gathers and scatters are scheduled")
    p.add_argument("--steps", type=int, default=60, help="training steps")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--slices", type=int, default=2, help="data-parallel replicas (FSDP inside each)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--check-steps", type=int, default=3, help="steps compared with the plain jit step")
    p.add_argument("--unrolled", action="store_true", help="a Python loop over the layers instead of lax.scan")
    p.add_argument("--compile-for", metavar="TARGET", help="compile only, e.g. h100:1x8x8 or v5p:2x2x2:slices=2")
    p.add_argument("--out", type=Path, default=Path("runs/fsdp_lm"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "devices", "slices", "layers", "dim", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.compile_for is None:
        if args.devices % args.slices:
            p.error(f"--devices {args.devices} is not divisible by --slices {args.slices}")
        if args.batch_size % args.devices:
            p.error(f"--batch-size {args.batch_size} is not divisible by --devices {args.devices}")
        if args.dim % (args.devices // args.slices):
            p.error(f"--dim {args.dim} must be divisible by the {args.devices // args.slices} FSDP devices of a slice")
    return args


def compile_for(args: argparse.Namespace) -> int:
    """XLA's estimate for a cluster: the scheduled step against the plain one."""
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxsched
    import jaxsched.tools.aot as aot
    from jaxsched.zoo import stacked_lm

    try:
        name, topology, slices = aot.parse_target(args.compile_for)
        devices = np.array(aot.devices(name, topology, slices=slices))
    except (ValueError, RuntimeError, ImportError) as err:
        sys.exit(f"--compile-for {args.compile_for}: {err}")
    mesh = Mesh(devices.reshape(slices, -1), ("data", "fsdp")) if slices > 1 else Mesh(devices, ("fsdp",))
    config = stacked_lm.StackedLM(scan=not args.unrolled)  # 8 layers of 1024, MLP 4096
    tx = optax.adamw(1e-4)
    params, opt_state, batch = stacked_lm.abstract(config, mesh, tx, rows_per_device=4)
    sched = jaxsched.schedule(stacked_lm.make_step(config, tx, mesh), strategy=args.strategy)
    inspection = sched.inspect(sched.init(params, opt_state), batch)
    print(inspection.table())
    ratios = inspection.ratios()
    print(
        f"\n{args.compile_for}, {'unrolled' if args.unrolled else 'scanned'} layers (XLA's estimates, not measured): "
        f"step {ratios['step']:.2f}x and exposed communication {ratios['exposed_comm']:.2f}x the plain step's"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inspect.json").write_text(json.dumps(inspection.to_json(), indent=1) + "\n")
    return 0


def train(args: argparse.Namespace) -> int:
    _common.ask_for_cpu_devices(args.devices)  # before JAX's first use
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from tqdm import tqdm

    import jaxsched
    from jaxsched.zoo import data, stacked_lm

    if len(jax.devices()) < args.devices:
        sys.exit(f"--devices {args.devices}: JAX has {len(jax.devices())} devices (XLA_FLAGS was set before)")
    shape, names = ((args.slices, args.devices // args.slices), ("data", "fsdp"))
    if args.slices == 1:
        shape, names = (args.devices,), ("fsdp",)
    mesh = jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=jax.devices()[: args.devices]
    )
    split = data.synthetic_tokens(n=4096, seq_len=32, vocab_size=64, seed=0)
    config = stacked_lm.StackedLM(
        dim=args.dim, mlp=4 * args.dim, layers=args.layers, heads=4, vocab=64, seq=32, scan=not args.unrolled
    )
    tx = optax.adamw(args.learning_rate)
    step = stacked_lm.make_step(config, tx, mesh)
    sharding = NamedSharding(mesh, stacked_lm.batch_spec(mesh))

    def batch(k: int) -> tuple:
        rows = np.random.default_rng(k).integers(0, len(split.train_x), args.batch_size)
        return jax.device_put((split.train_x[rows], split.train_y[rows]), sharding)

    params = stacked_lm.init(config, mesh, seed=0)
    sched = jaxsched.schedule(step, strategy=args.strategy)
    state = sched.init(jax.tree.map(lambda a: a.copy(), params), tx.init(params))
    plain = (params, tx.init(params))
    worst = 0.0
    losses = []
    start = time.perf_counter()
    for k in tqdm(range(args.steps), desc=f"fsdp_lm {args.strategy}", disable=args.no_progress):
        state, aux = sched(state, batch(k))
        losses.append(float(aux["loss"]))
        if k < args.check_steps:  # the plain jit step on the same batch: the same loss
            *plain, plain_aux = step(*plain, batch(k))
            worst = max(worst, abs(losses[-1] - float(plain_aux["loss"])) / abs(float(plain_aux["loss"])))
    seconds = time.perf_counter() - start
    tokens, targets = split.test_x[:256], split.test_y[:256]
    final_params, _ = sched.finalize(state)
    test_loss = float(jax.jit(lambda p: stacked_lm.loss(config, p, tokens, targets))(final_params))
    summary = {
        "strategy": args.strategy,
        "mesh": dict(mesh.shape),
        "layers": "unrolled" if args.unrolled else "scanned + remat",
        "steps": args.steps,
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-5:])),
        "test_loss": test_loss,
        "best_possible_loss": math.log(2),
        "max_relative_loss_difference_to_plain_step": worst,
        "steps_per_second": args.steps / seconds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{args.strategy} on {dict(mesh.shape)}: loss {losses[0]:.3f} -> {summary['final_loss']:.3f}, "
        f"held-out {test_loss:.3f} (best possible {math.log(2):.3f}); the first {min(args.check_steps, args.steps)} "
        f"steps match the plain jit step to {worst:.1e} (relative)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    return compile_for(args) if args.compile_for else train(args)


if __name__ == "__main__":
    raise SystemExit(main())
