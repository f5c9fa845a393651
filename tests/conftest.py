"""Every test process sees 8 virtual CPU devices (docs/cpu_facts.md: set before JAX's first use)."""
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # create the CPU client before numpy/scipy BLAS runs (docs/cpu_facts.md, rendezvous hazard)
