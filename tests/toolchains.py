"""Skip marks for tests that compile for GPU or TPU clusters without the hardware.

The compile-only devices come from the optional `aot` extra, which `make test` installs:
only a checkout without it skips, with a reason that names the missing module and the
extra; a device that cannot be built where the extra is installed fails the test.
"""
import pytest

import jaxsched.tools.aot

GPU_MISSING = jaxsched.tools.aot.toolchain_missing("gpu")
TPU_MISSING = jaxsched.tools.aot.toolchain_missing("tpu")
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
needs_tpu = pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))
