"""Skip marks for tests that compile for GPU or TPU clusters without the hardware.

The compile-only devices come from the optional `aot` extra, which `make test` installs in a
separate environment (.venv-aot) so that plain CPU runs never load the GPU and TPU plugins:
only a checkout without it skips, with a reason that names the missing module and the
extra; a device that cannot be built where the extra is installed fails the test. `make test`
sets JAXSCHED_REQUIRE_TOOLCHAINS=1 for its run in .venv-aot: there a missing toolchain fails
the tests instead of skipping them, so CI cannot pass with the accelerator tests unrun.
"""

import os

import pytest

import jaxsched.tools.aot

_REQUIRED = os.environ.get("JAXSCHED_REQUIRE_TOOLCHAINS") == "1"
GPU_MISSING = None if _REQUIRED else jaxsched.tools.aot.toolchain_missing("gpu")
TPU_MISSING = None if _REQUIRED else jaxsched.tools.aot.toolchain_missing("tpu")


def needs_gpu(test):
    """Marks ``test`` ``aot`` (it runs in the environment with the toolchains: ``make test``
    runs those tests with ``.venv-aot``) and skips it where the GPU toolchain is missing."""
    return pytest.mark.aot(pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))(test))


def needs_tpu(test):
    """As `needs_gpu`, for the TPU toolchain (libtpu)."""
    return pytest.mark.aot(pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))(test))
