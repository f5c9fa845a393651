"""Simulated counterparts of published settings (DeAR, MG-WFBP, ByteScheduler, gTop-k).

Every number this script prints is SIMULATED (zoo roofline profiles, ring alpha-beta
presets); docs/simulator.md sets them next to what the papers report.
Writes ``benchmarks/results/published_comparison.json``.

    python benchmarks/published_comparison.py
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxsched.sim._costmodel import device_preset, network_preset, topk_selection_s_per_byte
from jaxsched.plan import plan_buckets
from jaxsched.sim import Compression, simulate
from jaxsched.sim._zoo_profiles import zoo_profile


def run(model: str, network: str, workers: int, device: str = "v100") -> dict[str, float]:
    layers, net = zoo_profile(model, device), network_preset(network, workers)
    t = {
        "allreduce": simulate(layers, net, "allreduce").iteration_s,
        "wfbp": simulate(layers, net, "wfbp").iteration_s,
        "mgwfbp": simulate(layers, net, "mgwfbp", plan_buckets(layers, net, "mgwfbp")).iteration_s,
        "wfbp_threshold25": simulate(layers, net, "wfbp", plan_buckets(layers, net, "threshold")).iteration_s,
        "wfbp_optimal": simulate(layers, net, "wfbp", plan_buckets(layers, net, "optimal")).iteration_s,
        "dear_optimal": simulate(layers, net, "dear", plan_buckets(layers, net, "optimal", "dear")).iteration_s,
    }
    best_bs = min(
        simulate(
            layers,
            net,
            "bytescheduler",
            partition_bytes=(1 << 20) << e,
            credit_bytes=((1 << 20) << e) * c,
            keep_spans=False,
        ).iteration_s
        for e in range(7)
        for c in (1, 2, 4)
    )
    t["bytescheduler"] = best_bs
    sel = topk_selection_s_per_byte(device_preset(device))
    for kind in ("topk", "gtopk"):
        comp = Compression(kind, 0.001, sel)
        t[f"wfbp+{kind}"] = simulate(
            layers, net, "wfbp", plan_buckets(layers, net, "optimal", compression=comp), compression=comp
        ).iteration_s
    return t


def main() -> None:
    settings = [
        ("resnet50", "10gbe", 64),
        ("bert-base", "10gbe", 64),
        ("resnet50", "100gbib", 64),
        ("bert-base", "100gbib", 64),
        ("vgg16", "10gbe", 16),
        ("resnet50", "10gbe", 8),
        ("vgg16", "1gbe", 32),
        ("resnet50", "1gbe", 32),
    ]
    results = {}
    for model, network, workers in settings:
        key = f"{model}/{network}/{workers}"
        results[key] = run(model, network, workers)
        t = results[key]
        baseline = min(t["wfbp"], t["mgwfbp"], t["wfbp_threshold25"], t["bytescheduler"])
        print(f"{key:<26} " + " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in t.items()))
        print(
            f"{'':<26} dear vs best(wfbp,mgwfbp,threshold,bytescheduler) {baseline / t['dear_optimal']:.2f}x; "
            f"mgwfbp vs wfbp {t['wfbp'] / t['mgwfbp']:.2f}x; bytescheduler vs allreduce "
            f"{t['allreduce'] / t['bytescheduler']:.2f}x; gtopk vs dense wfbp {t['wfbp'] / t['wfbp+gtopk']:.2f}x, "
            f"vs topk {t['wfbp+topk'] / t['wfbp+gtopk']:.2f}x"
        )
    out = Path(__file__).parent / "results" / "published_comparison.json"
    out.write_text(
        json.dumps({"simulated": True, "device": "v100 fp32 roofline, efficiency 0.5", "results": results}, indent=1)
    )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
