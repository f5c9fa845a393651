"""Every test process sees 8 virtual CPU devices (docs/benchmarks.md: set before JAX's first use).

The `aot` extra installs the GPU and TPU compile-only toolchains; with them JAX would probe
for a TPU and CUDA driver at start-up (and print libtpu's errors) in every process. Tests run
on CPU, and compile for accelerators only through jaxsched.tools.aot's compile-only devices, which
need no backend: so this process and every subprocess it starts use the CPU backend only.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # create the CPU client before numpy/scipy BLAS runs (docs/benchmarks.md, rendezvous hazard)
