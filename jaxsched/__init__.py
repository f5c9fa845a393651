"""jaxsched: scheduled gradient communication for data-parallel JAX training.

The public names load on first use, so that ``import jaxsched`` and the ``jaxsched`` command
line's ``--help`` do not import JAX.

Example:
    >>> import jaxsched
    >>> sorted(jaxsched.STRATEGIES)[:3]
    ['allreduce', 'approx', 'auto']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxsched import _legacy_paths
from jaxsched._version import __version__ as __version__

_legacy_paths.install()

#: public name -> the module that defines it (a module itself when the name is a subpackage)
_EXPORTS: dict[str, str] = {
    "Collective": "jaxsched.runtime.collectives",
    "CollectiveWrapper": "jaxsched.runtime.collectives",
    "Config": "jaxsched.demo.config",
    "ConfigError": "jaxsched.demo.config",
    "Engine": "jaxsched.runtime.engine",
    "FallbackWarning": "jaxsched.core.rewrite.rules",
    "GatherWarning": "jaxsched.core.partition",
    "JaxschedError": "jaxsched._errors",
    "JaxschedRuntimeError": "jaxsched._errors",
    "JaxschedTypeError": "jaxsched._errors",
    "JaxschedValueError": "jaxsched._errors",
    "JaxschedWarning": "jaxsched._errors",
    "Layer": "jaxsched.sim.costmodel",
    "LayerProfile": "jaxsched.sim.costmodel",
    "NetworkProfile": "jaxsched.sim.costmodel",
    "Replan": "jaxsched.pipeline.replan",
    "ReplanAgreementError": "jaxsched.pipeline.replan",
    "RunResult": "jaxsched.demo.trainer",
    "STRATEGIES": "jaxsched._schedule",
    "SchedState": "jaxsched._schedule",
    "Scheduled": "jaxsched._schedule",
    "Strategy": "jaxsched.strategies",
    "UnsupportedStepError": "jaxsched.core.capture",
    "UnshardedStepWarning": "jaxsched._errors",
    "make_pmap_step": "jaxsched.demo.steps",
    "make_step": "jaxsched.demo.steps",
    "network_preset": "jaxsched.sim.costmodel",
    "plan_buckets": "jaxsched.plan",
    "profile_network": "jaxsched.plan.profiling",
    "profile_zoo_model": "jaxsched.plan.profiling",
    "pure": "jaxsched.zoo.models",
    "register_engine": "jaxsched.runtime.engine",
    "register_strategy": "jaxsched.strategies",
    "schedule": "jaxsched._schedule",
    "simulate": "jaxsched.sim",
    "train": "jaxsched.demo.trainer",
}
#: public subpackages reached as attributes (``jaxsched.compress.TopK``)
_MODULES: dict[str, str] = {
    "compress": "jaxsched.runtime.compress",
    "kfac": "jaxsched.integrations.kfac",
    "nnx": "jaxsched.integrations.nnx",
}

__all__ = [
    "Collective",
    "CollectiveWrapper",
    "Config",
    "ConfigError",
    "Engine",
    "FallbackWarning",
    "GatherWarning",
    "JaxschedError",
    "JaxschedRuntimeError",
    "JaxschedTypeError",
    "JaxschedValueError",
    "JaxschedWarning",
    "Layer",
    "LayerProfile",
    "NetworkProfile",
    "Replan",
    "ReplanAgreementError",
    "RunResult",
    "STRATEGIES",
    "SchedState",
    "Scheduled",
    "Strategy",
    "UnshardedStepWarning",
    "UnsupportedStepError",
    "compress",
    "kfac",
    "make_pmap_step",
    "make_step",
    "network_preset",
    "nnx",
    "plan_buckets",
    "profile_network",
    "profile_zoo_model",
    "pure",
    "register_engine",
    "register_strategy",
    "schedule",
    "simulate",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        try:  # a subpackage not yet imported: jaxsched.strategies, jaxsched.sim, ...
            value = importlib.import_module(f"jaxsched.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'jaxsched' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools (type checkers, the API reference) read
    from jaxsched._errors import (
        JaxschedError,
        JaxschedRuntimeError,
        JaxschedTypeError,
        JaxschedValueError,
        JaxschedWarning,
        UnshardedStepWarning,
    )
    from jaxsched._schedule import STRATEGIES, SchedState, Scheduled, schedule
    from jaxsched.core.capture import UnsupportedStepError
    from jaxsched.core.partition import GatherWarning
    from jaxsched.core.rewrite.rules import FallbackWarning
    from jaxsched.demo.config import Config, ConfigError
    from jaxsched.demo.steps import make_pmap_step, make_step
    from jaxsched.demo.trainer import RunResult, train
    from jaxsched.integrations import kfac, nnx
    from jaxsched.plan import plan_buckets
    from jaxsched.pipeline.replan import Replan, ReplanAgreementError
    from jaxsched.plan.profiling import profile_network, profile_zoo_model
    from jaxsched.runtime import compress
    from jaxsched.runtime.collectives import Collective, CollectiveWrapper
    from jaxsched.runtime.engine import Engine, register_engine
    from jaxsched.sim import simulate
    from jaxsched.sim.costmodel import Layer, LayerProfile, NetworkProfile, network_preset
    from jaxsched.strategies import Strategy, register_strategy
    from jaxsched.zoo.models import pure
