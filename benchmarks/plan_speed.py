"""How fast is the optimal planner on a 1000-layer model? (target: under 1 s)

Times ``plan_buckets(..., "optimal", strategy="wfbp")`` (exact DP) on a seeded random
1000-layer profile and on DenseNet-201, plus one 1000-layer simulation and the
simulator-searched DeAR plan, as medians of several runs on this machine. Writes
``benchmarks/results/plan_speed.json``.

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path

from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
from jaxsched.plan import plan_buckets
from jaxsched.sim import simulate
from jaxsched.sim._zoo_profiles import zoo_profile


def random_profile(num: int, seed: int = 0) -> LayerProfile:
    rng = random.Random(seed)
    return LayerProfile(
        [
            Layer(f"l{i}", n, 4 * n, rng.uniform(1e-4, 1e-3), rng.uniform(2e-4, 2e-3))
            for i, n in enumerate(rng.randint(1, 2_000_000) for _ in range(num))
        ]
    )


def median_seconds(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    net = network_preset("10gbe", 64)
    big = random_profile(1000)
    densenet = zoo_profile("densenet201", "v100")
    results = {
        "optimal_wfbp_1000_layers_s": median_seconds(lambda: plan_buckets(big, net, "optimal", "wfbp"), 7),
        "optimal_wfbp_densenet201_s": median_seconds(lambda: plan_buckets(densenet, net, "optimal", "wfbp"), 7),
        "simulate_wfbp_1000_layers_8_iterations_s": median_seconds(lambda: simulate(big, net, "wfbp"), 3),
        "optimal_dear_search_1000_layers_s": median_seconds(lambda: plan_buckets(big, net, "optimal", "dear"), 1),
    }
    buckets = plan_buckets(big, net, "optimal", "wfbp")
    results["optimal_wfbp_1000_layers_buckets"] = len(buckets)
    results["machine"] = f"{platform.processor() or platform.machine()}, {platform.python_version()}"
    out = Path(__file__).parent / "results" / "plan_speed.json"
    out.write_text(json.dumps(results, indent=1))
    for key, value in results.items():
        print(f"{key:<45} {value:.4f}" if isinstance(value, float) else f"{key:<45} {value}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
