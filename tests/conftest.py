"""Every test process sees 8 virtual CPU devices (docs/benchmarks.md: set before JAX's first use).

The `aot` extra installs the GPU and TPU compile-only toolchains; with them JAX would probe
for a TPU and CUDA driver at start-up (and print libtpu's errors) in every process. Tests run
on CPU, and compile for accelerators only through jaxsched.tools.aot's compile-only devices, which
need no backend: so this process and every subprocess it starts use the CPU backend only.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # create the CPU client before numpy/scipy BLAS runs (docs/benchmarks.md, rendezvous hazard)


#: Checks heavy enough that ``make test`` (every test not marked slow, on 2 cores) would pass
#: 5 minutes with them (tests/heavy_tests.txt, by node id): most have a lighter sibling there
#: (another strategy, model or size); all run with the slow tests in ``make test-slow`` and CI.
HEAVY = frozenset(
    line.strip()
    for line in (Path(__file__).parent / "heavy_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in HEAVY:
            item.add_marker(pytest.mark.slow)
