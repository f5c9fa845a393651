"""Compile-only devices of a GPU or TPU cluster you do not have (ahead of time).

Why: the only way to know what XLA:GPU or XLA:TPU does with a scheduled step (which
collectives stay async, what compute sits in their windows, what XLA's own scheduler
estimates) is to compile it for that target. JAX can do that without the hardware,
through ``jax.experimental.topologies``: TPU through libtpu, GPU through the CUDA PJRT
plugin and a target description (shipped here, ``targets/*.pbtxt``). A mesh over these
devices traces, lowers and compiles like a real one, but nothing can run on it.

Targets (``target:topology``):

* GPU: ``h100`` or ``a100`` with topology ``"SxHxD"`` (slices x hosts x GPUs per host),
  e.g. ``("h100", "1x2x4")``: 2 hosts of 4 H100s.
* TPU: ``v5p``, ``v5e``, ``v4``, ... with libtpu's chip topology, e.g. ``("v5p", "2x2x2")``;
  ``slices=2`` joins two such slices over DCN (a multi-slice pod).

The toolchain is the optional extra ``aot`` (``pip install 'jaxsched[aot]'``): libtpu as
pinned by ``jax[tpu]``, and ``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and
``nvidia-cuda-nvcc-cu12`` at the jax version. No driver and no accelerator are needed.

Example (needs the ``aot`` extra):
    >>> import jaxsched.tools.aot
    >>> devs = jaxsched.tools.aot.devices("h100", "1x2x4")          # doctest: +SKIP
    >>> len(devs), devs[0].platform                           # doctest: +SKIP
    (8, 'gpu')
    >>> mesh = jax.sharding.Mesh(np.array(devs), ("data",))   # doctest: +SKIP
"""

from __future__ import annotations

from jaxsched import _deprecations

import contextlib
import functools
import importlib.util
import os
import re
from pathlib import Path
from typing import Iterator

from jaxsched._errors import JaxschedError, JaxschedValueError

# every private module's public names, explicitly
from jaxsched.tools.aot._compare import Comparison, Experiment, compare_strategies
from jaxsched.tools.aot._experiment import (
    AbstractExperiment,
    ModelSpec,
    ZOO,
    abstract_experiment,
    from_config,
    mesh_for,
)

__all__ = [
    "AbstractExperiment",
    "AotUnavailableError",
    "Comparison",
    "Experiment",
    "GPU_TARGETS",
    "ModelSpec",
    "TPU_TARGETS",
    "ZOO",
    "abstract_experiment",
    "compare_strategies",
    "devices",
    "from_config",
    "mesh_for",
    "parse_target",
    "target_config",
    "toolchain_missing",
]

#: GPU models with a shipped target description (``targets/<name>.pbtxt``).
GPU_TARGETS = tuple(sorted(p.stem for p in (Path(__file__).parent / "targets").glob("*.pbtxt")))
#: TPU generations libtpu compiles for (the topology string is libtpu's).
TPU_TARGETS = ("v4", "v5e", "v5p", "v6e")

_EXTRA_HINT = (
    "install the optional extra, best in an environment of its own (its CUDA plugin and "
    "libtpu print load errors on CPU runs): pip install 'jaxsched[aot]'; in a checkout, "
    "`make aot` builds .venv-aot, then run .venv-aot/bin/jaxsched inspect ..."
)


class AotUnavailableError(JaxschedError, RuntimeError):
    """The compile-only toolchain for a target is not installed, or the target is unknown."""


def toolchain_missing(platform: str) -> str | None:
    """Why compile-only devices of ``platform`` (``"gpu"`` or ``"tpu"``) cannot be made
    here, or None when they can. Tests use it as a skip reason."""
    modules = {"gpu": ("jax_cuda12_plugin", "jax_plugins"), "tpu": ("libtpu",)}[platform]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"the {platform.upper()} compile-only toolchain is missing ({', '.join(missing)} "
            f"not importable); {_EXTRA_HINT}"
        )
    return None


def parse_target(spec: str) -> tuple[str, str, int]:
    """``"h100:1x2x4"`` or ``"v5p:2x2x2"`` (optionally ``"...:slices=2"`` or ``"...x2slices"``)
    -> ``(target, topology, slices)``.

    >>> parse_target("v5p:2x2x2:slices=2")
    ('v5p', '2x2x2', 2)
    """
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise JaxschedValueError(
            f"target {spec!r}: write TARGET:TOPOLOGY[:slices=N], e.g. h100:1x2x4 or v5p:2x2x2:slices=2"
        )
    slices = 1
    if len(parts) == 3:
        match = re.fullmatch(r"slices=(\d+)", parts[2])
        if not match or int(match.group(1)) < 1:
            raise JaxschedValueError(f"target {spec!r}: the third field must be slices=N with N >= 1")
        slices = int(match.group(1))
    return parts[0].lower(), parts[1], slices


def target_config(name: str) -> str:
    """The shipped GPU target description (a ``GpuTargetConfigProto`` in text form)."""
    path = Path(__file__).parent / "targets" / f"{name}.pbtxt"
    if not path.exists():
        raise AotUnavailableError(f"no GPU target description for {name!r}; shipped: {', '.join(GPU_TARGETS)}")
    return path.read_text()


def devices(target: str, topology: str, *, slices: int = 1) -> list:
    """Compile-only devices of ``target`` with ``topology``; build a ``Mesh`` over them.

    Args:
      target: a GPU model (`GPU_TARGETS`) or a TPU generation (`TPU_TARGETS`).
      topology: GPU ``"SxHxD"`` (slices x hosts x GPUs per host; ``slices`` must then
        be 1 or match S) or TPU chips such as ``"2x2x2"``.
      slices: TPU slices joined over DCN (each device has ``slice_index``).

    The devices are cached per argument set, so two calls return the same objects (a
    mesh built from either compares equal).
    """
    target = target.lower()
    if not isinstance(slices, int) or slices < 1:
        raise JaxschedValueError(f"slices must be an integer >= 1, got {slices!r}")
    if target in GPU_TARGETS:
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", topology)
        if not match:
            raise JaxschedValueError(f"GPU topology {topology!r}: write SLICESxHOSTSxGPUS, e.g. 1x2x4")
        if slices != 1 and int(match.group(1)) != slices:
            raise JaxschedValueError(
                f"GPU topology {topology!r} already says {match.group(1)} slice(s); slices={slices} disagrees"
            )
        return list(_gpu_devices(target, topology))
    if target in TPU_TARGETS:
        if not re.fullmatch(r"\d+(x\d+)+", topology):
            raise JaxschedValueError(f"TPU topology {topology!r}: write chips per dimension, e.g. 2x2x2")
        return list(_tpu_devices(target, topology, slices))
    raise AotUnavailableError(
        f"unknown target {target!r}; GPU: {', '.join(GPU_TARGETS)}; TPU: {', '.join(TPU_TARGETS)}"
    )


@functools.lru_cache(maxsize=None)
def _gpu_devices(target: str, topology: str) -> tuple:
    reason = toolchain_missing("gpu")
    if reason:
        raise AotUnavailableError(reason)
    # Without a CUDA runtime the plugin refuses to register unless told that its version
    # check does not apply; compiling needs only the plugin's compiler. This must happen
    # before JAX discovers its plugins (its first use), see the error below otherwise.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(target, "cuda", target_config=target_config(target), topology=topology)
    except Exception as err:  # the plugin reports what it cannot build
        hint = _EXTRA_HINT
        if "not implemented for cuda" in str(err):
            hint = (
                "the CUDA plugin did not register: JAX had already started and checked for a "
                "CUDA runtime; call jaxsched.tools.aot.devices before anything else uses JAX, or set "
                "JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before starting Python"
            )
        raise AotUnavailableError(f"could not make compile-only {target} devices {topology}: {err}; {hint}") from None
    return tuple(desc.devices)


@functools.lru_cache(maxsize=None)
def _tpu_devices(target: str, topology: str, slices: int) -> tuple:
    reason = toolchain_missing("tpu")
    if reason:
        raise AotUnavailableError(reason)
    # libtpu takes a lockfile per process unless told several loads are fine; a compile-only
    # topology never opens a TPU, so the lock protects nothing here.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    options: dict[str, str | int] = {"chip_config_name": "megachip_tccontrol"}
    if slices > 1:
        options["num_slices"] = slices
    try:
        with _libtpu_env():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{target}:{topology}", **options)
    except Exception as err:
        raise AotUnavailableError(f"libtpu could not make {target}:{topology} x{slices} slices: {err}") from None
    return tuple(desc.devices)


#: What libtpu reads when it starts and, off a Cloud TPU VM, would ask the VM's metadata
#: server for: without it, it logs ``E0000 ... unexpected worker hostname ... from env var
#: TPU_WORKER_HOSTNAMES`` to stderr. A compile-only topology runs on no worker: this host.
_LIBTPU_ENV = {"TPU_WORKER_HOSTNAMES": "localhost"}


@contextlib.contextmanager
def _libtpu_env() -> Iterator[None]:
    """`_LIBTPU_ENV` (where the user set none) while libtpu starts, the user's environment
    restored afterwards: libtpu reads it once, at its first use in the process."""
    added = {k: v for k, v in _LIBTPU_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
