"""What each part of distributed K-FAC saves: measured on 8 virtual CPU devices, and
simulated for ResNet-50 on 64 workers.

Measured (one process, 8 virtual CPU devices, an MLP whose layer widths differ so that the
factors range from 10x10 to 513x513), every variant compiled first and then stepped in
turns (variant after variant, ``--steps`` rounds), medians per variant, ratios against the
baseline of the same run:

* **placement**: ``balanced`` against ``naive`` and ``round_robin``, inverses refreshed every
  step (``inverse_interval=1``); also each variant with inverses never refreshed
  (``inverse_interval`` larger than the run) so the inversion's own cost is the difference;
* **pipelining**: factor all-reduces in backward (``pipeline=True``) against after backward,
  inverses not refreshed (so the factor communication is what differs).

Simulated (``jaxsched.sim.simulate``, marked as such in the output): ResNet-50, V100
roofline, 64 workers on 100 Gb/s InfiniBand (ring costs), every combination of
pipelining and placement, at three assumed inversion efficiencies, beside SPD-KFAC's
published 10-35%.

    python benchmarks/kfac_speed.py [--steps 30]

Writes ``benchmarks/results/kfac_speed.json``.
"""

from __future__ import annotations

import os

# One BLAS thread per caller: jaxlib's CPU eigh/Cholesky call LAPACK, and 8 virtual devices
# inverting at once with OpenBLAS's default threads took 29 s for eight 513x513 eighs on
# 2 cores, against 0.8 s with one thread each (measured 2026-11-22; docs/kfac.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxsched  # noqa: E402
from jaxsched.zoo import models  # noqa: E402
from jaxsched.demo import steps
from jaxsched.sim._costmodel import KFAC_PATTERN, network_preset  # noqa: E402
from jaxsched.sim._kfac_placement import max_load, plan_placement, worker_loads  # noqa: E402
from jaxsched.sim import simulate  # noqa: E402
from jaxsched.sim._zoo_profiles import zoo_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IN_FEATURES, HIDDEN, CLASSES = 128, (512, 256, 128, 64), 10
PUBLISHED = "SPD-KFAC (Shi, Zhang & Li, 2021): 10-35% faster than prior distributed K-FAC, 64 GPUs, 100 Gb/s InfiniBand"


def measured(args) -> dict:
    mesh = jax.make_mesh((8,), ("data",))
    params, apply_fn = models.pure(models.MLP(IN_FEATURES, CLASSES, hidden=HIDDEN, rngs=__import__("flax").nnx.Rngs(0)))
    tx = optax.sgd(0.01)
    rng = np.random.default_rng(0)
    batch = steps.shard_batch(
        (
            rng.normal(size=(args.batch, IN_FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, args.batch).astype(np.int32),
        ),
        mesh,
    )
    never = 10**9
    variants = {
        "balanced": dict(placement="balanced", inverse_interval=1),
        "round_robin": dict(placement="round_robin", inverse_interval=1),
        "naive": dict(placement="naive", inverse_interval=1),
        "balanced, no refresh": dict(placement="balanced", inverse_interval=never),
        "round_robin, no refresh": dict(placement="round_robin", inverse_interval=never),
        "naive, no refresh": dict(placement="naive", inverse_interval=never),
        "pipelined factors": dict(placement="balanced", inverse_interval=never, pipeline=True),
        "factors after backward": dict(placement="balanced", inverse_interval=never, pipeline=False),
    }
    runs = {}
    for name, options in variants.items():
        strategy = jaxsched.integrations.kfac.KFAC(damping=1e-2, factor_buckets="per_layer", **options)
        sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy)
        state = sched.init(params, tx.init(params))
        state, aux = sched(state, batch)  # the refreshing step 0 of every variant, and compile
        jax.block_until_ready(aux)
        runs[name] = [sched, state, []]
    plain = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="allreduce")
    runs["plain step (no K-FAC)"] = [plain, plain.init(params, tx.init(params)), []]
    for _ in range(args.steps):
        for name, run in runs.items():
            sched, state, times = run
            start = time.perf_counter()
            state, aux = sched(state, batch)
            jax.block_until_ready((state, aux))
            times.append(time.perf_counter() - start)
            run[1] = state
    median = {name: statistics.median(run[2][2:]) for name, run in runs.items()}
    layers = runs["balanced"][0].strategy.layers(runs["balanced"][0].program.planned).layers
    dims = [n for layer in layers for n in layer.dims]
    layer_of = [i for i, layer in enumerate(layers) for _ in layer.dims]
    plans = {m: plan_placement(dims, 8, m, layer_of) for m in ("balanced", "round_robin", "naive")}
    inversion = {m: median[m] - median[f"{m}, no refresh"] for m in ("balanced", "round_robin", "naive")}
    return {
        "model": f"MLP {IN_FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}",
        "devices": 8,
        "global_batch": args.batch,
        "steps": args.steps,
        "factor_dims": dims,
        "median_step_s": median,
        "inversion_s (refresh - no refresh)": inversion,
        "ratios": {
            "naive / balanced (step, refresh every step)": median["naive"] / median["balanced"],
            "round_robin / balanced (step, refresh every step)": median["round_robin"] / median["balanced"],
            "naive / balanced (inversion only)": inversion["naive"] / inversion["balanced"],
            "round_robin / balanced (inversion only)": inversion["round_robin"] / inversion["balanced"],
            "after backward / pipelined (step)": median["factors after backward"] / median["pipelined factors"],
        },
        "plans": {
            m: {"owners": p, "busiest_worker_n3": max_load(dims, p, 8), "total_n3": sum(worker_loads(dims, p, 8))}
            for m, p in plans.items()
        },
    }


def simulated() -> dict:
    """ResNet-50 on 64 V100s over 100 Gb/s InfiniBand: every variant, simulated."""
    net = network_preset("100gbib", 64)
    out = {
        "label": "SIMULATED (jaxsched.sim, roofline profiles, ring collectives; not measured)",
        "model": "resnet50",
        "device": "v100",
        "workers": 64,
        "network": "100gbib",
        "published": PUBLISHED,
        "by_inverse_efficiency": {},
    }
    for eff in (0.02, 0.1, 0.5):
        prof = zoo_profile("resnet50", "v100", kfac=True, inverse_efficiency=eff)
        rows = {"first-order wfbp (no K-FAC)": simulate(prof, net, "wfbp").iteration_s}
        for pipe in (True, False):
            for placement in ("balanced", "round_robin", "naive"):
                pattern = dataclasses.replace(KFAC_PATTERN, factors_in_backward=pipe, inverse_placement=placement)
                name = f"{'pipelined' if pipe else 'after backward'}, {placement}"
                rows[name] = simulate(prof, net, pattern, keep_spans=False).iteration_s
        spd = rows["pipelined, balanced"]
        out["by_inverse_efficiency"][str(eff)] = {
            "iteration_s": rows,
            "inversion_s_one_worker": sum(sum(layer.inverse_s) for layer in prof.layers),
            "factor_s": sum(layer.factor_s for layer in prof.layers),
            "saving_vs": {
                name: 1 - spd / t
                for name, t in rows.items()
                if name not in ("pipelined, balanced", "first-order wfbp (no K-FAC)")
            },
        }
    return out


def render(results: dict) -> str:
    m, sim = results["measured"], results["simulated"]
    med, inv, r = m["median_step_s"], m["inversion_s (refresh - no refresh)"], m["ratios"]
    load = results["machine"]
    lines = [
        f"**Measured** ({m['model']}, factors {min(m['factor_dims'])}x{min(m['factor_dims'])} to "
        f"{max(m['factor_dims'])}x{max(m['factor_dims'])}, 8 virtual CPU devices on a 2-core machine, global "
        f"batch {m['global_batch']}, median of {m['steps']} interleaved steps; load average "
        f"{load['loadavg_before'][0]:.1f} before and {load['loadavg_after'][0]:.1f} after: other work shared "
        "the cores, so read ratios, not seconds; OPENBLAS_NUM_THREADS=1):",
        "",
        "| variant | step (refresh every step) | step (no refresh) | inversion (difference) |",
        "|---|---|---|---|",
    ]
    for name in ("balanced", "round_robin", "naive"):
        lines.append(
            f"| {name} | {med[name] * 1e3:.0f} ms | {med[name + ', no refresh'] * 1e3:.0f} ms | "
            f"{inv[name] * 1e3:.0f} ms |"
        )
    lines += [
        "",
        f"Same run: naive / balanced = **{r['naive / balanced (step, refresh every step)']:.2f}x** per "
        f"refreshing step ({r['naive / balanced (inversion only)']:.2f}x on the inversion alone); "
        f"round_robin / balanced = **{r['round_robin / balanced (step, refresh every step)']:.2f}x** "
        f"({r['round_robin / balanced (inversion only)']:.2f}x on the inversion). Busiest worker's "
        "n^3 under each plan: "
        + ", ".join(f"{k} {v['busiest_worker_n3'] / 1e6:.0f}M" for k, v in m["plans"].items())
        + ". "
        f"The plain first-order step took {med['plain step (no K-FAC)'] * 1e3:.0f} ms.",
        "",
        f"Pipelining, same run, inverses not refreshed: factors after backward "
        f"{med['factors after backward'] * 1e3:.0f} ms, pipelined {med['pipelined factors'] * 1e3:.0f} ms "
        f"(after / pipelined = {r['after backward / pipelined (step)']:.2f}x).",
        "",
        f"**Simulated** ({sim['label']}): ResNet-50, V100 roofline, {sim['workers']} workers, "
        f"100 Gb/s InfiniBand; factors and inverses refreshed every iteration. Published beside it: "
        f"{sim['published']}.",
        "",
        "| inversion efficiency (assumed) | one worker inverting all | SPD-style (pipelined, balanced) | "
        "after backward, naive | after backward, round_robin | pipelined, round_robin | first-order wfbp |",
        "|---|---|---|---|---|---|---|",
    ]
    for eff, row in sim["by_inverse_efficiency"].items():
        it, save = row["iteration_s"], row["saving_vs"]
        lines.append(
            f"| {float(eff):.0%} of peak | {row['inversion_s_one_worker']:.2f} s | "
            f"{it['pipelined, balanced'] * 1e3:.0f} ms | {it['after backward, naive'] * 1e3:.0f} ms "
            f"(-{save['after backward, naive']:.0%}) | {it['after backward, round_robin'] * 1e3:.0f} ms "
            f"(-{save['after backward, round_robin']:.0%}) | {it['pipelined, round_robin'] * 1e3:.0f} ms "
            f"(-{save['pipelined, round_robin']:.1%}) | {it['first-order wfbp (no K-FAC)'] * 1e3:.0f} ms |"
        )
    lines.append("")
    lines.append("(-x%: the SPD-style iteration is that much shorter than the variant's.)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--render-only", action="store_true", help="re-render docs from the saved JSON")
    args = parser.parse_args()
    if args.render_only:
        results = json.loads((ROOT / "benchmarks" / "results" / "kfac_speed.json").read_text())
        print(render(results))
        return
    load_before = os.getloadavg()
    results = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        },
        "measured": measured(args),
    }
    results["machine"]["loadavg_after"] = os.getloadavg()
    results["simulated"] = simulated()
    out = ROOT / "benchmarks" / "results" / "kfac_speed.json"
    out.write_text(json.dumps(results, indent=1, default=float))
    table = render(json.loads(out.read_text()))
    doc = ROOT / "docs" / "benchmarks.md"
    if doc.exists():
        import re

        text = re.sub(
            r"(<!-- kfac_speed:start -->\n).*?(<!-- kfac_speed:end -->)",
            lambda mt: mt.group(1) + table + "\n" + mt.group(2),
            doc.read_text(),
            flags=re.S,
        )
        doc.write_text(text)
    print(table)
    print(
        json.dumps(
            {
                "machine": results["machine"],
                "ratios": results["measured"]["ratios"],
                "median_step_s": results["measured"]["median_step_s"],
                "inversion_s": results["measured"]["inversion_s (refresh - no refresh)"],
                "simulated": {k: v["saving_vs"] for k, v in results["simulated"]["by_inverse_efficiency"].items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
