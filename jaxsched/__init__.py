"""jaxsched: scheduled gradient communication for data-parallel JAX training.

The public names load on first use, so that ``import jaxsched`` and the ``jaxsched`` command
line's ``--help`` do not import JAX. Module paths from before the layered layout
(``jaxsched.costmodel``, ...) are attributes that warn and return the module at its new home
(`jaxsched._deprecations`).

Example:
    Quick start: wrap the jitted step you already have; ``init`` converts your trees into the
    strategy's state, ``sched(state, batch)`` runs one step, ``finalize`` gives the trees back.

    >>> import jax, optax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 3, hidden=(8,)))
    >>> tx = optax.sgd(0.1)
    >>> @jax.jit
    ... def train_step(params, opt_state, batch):
    ...     x, y = batch
    ...     loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, x), y))(params)
    ...     updates, opt_state = tx.update(grads, opt_state, params)
    ...     return optax.apply_updates(params, updates), opt_state, {"loss": loss}
    >>> sched = jaxsched.schedule(train_step, strategy="dear")
    >>> state = sched.init(params, tx.init(params))
    >>> mesh = jax.make_mesh((2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> batch = (jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32"))
    >>> state, aux = sched(state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    >>> params, opt_state = sched.finalize(state)
    >>> sorted(aux), sorted(jaxsched.STRATEGIES)[:3]
    (['loss'], ['allreduce', 'approx', 'auto'])
"""

import importlib as _importlib
import sys as _sys
import typing as _typing
import warnings as _warnings

from jaxsched import _deprecations
from jaxsched._version import __version__ as __version__

#: public name -> the module that defines it (a module itself when the name is a subpackage)
_EXPORTS: dict[str, str] = {
    "Collective": "jaxsched.runtime.collectives",
    "CollectiveWrapper": "jaxsched.runtime.collectives",
    "Config": "jaxsched.demo.config",
    "ConfigError": "jaxsched.demo.config",
    "Engine": "jaxsched.runtime.engine",
    "FallbackWarning": "jaxsched.core.rewrite._rules",
    "GatherWarning": "jaxsched.core.partition",
    "JaxschedError": "jaxsched._errors",
    "JaxschedRuntimeError": "jaxsched._errors",
    "JaxschedTypeError": "jaxsched._errors",
    "JaxschedValueError": "jaxsched._errors",
    "JaxschedWarning": "jaxsched._errors",
    "Layer": "jaxsched.sim._costmodel",
    "LayerProfile": "jaxsched.sim._costmodel",
    "NetworkProfile": "jaxsched.sim._costmodel",
    "Replan": "jaxsched.pipeline.replan",
    "ReplanAgreementError": "jaxsched.pipeline.replan",
    "RunResult": "jaxsched.demo.trainer",
    "STRATEGIES": "jaxsched._schedule",
    "SchedState": "jaxsched._schedule",
    "Scheduled": "jaxsched._schedule",
    "Strategy": "jaxsched.strategies",
    "UnsupportedStepError": "jaxsched.core._capture",
    "UnshardedStepWarning": "jaxsched._errors",
    "make_pmap_step": "jaxsched.demo.steps",
    "make_step": "jaxsched.demo.steps",
    "network_preset": "jaxsched.sim._costmodel",
    "plan_buckets": "jaxsched.plan",
    "profile_network": "jaxsched.plan._profiling",
    "profile_zoo_model": "jaxsched.plan._profiling",
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
#: subpackages reached as attributes before they are imported (``jaxsched.strategies.Strategy``)
_SUBPACKAGES = frozenset(
    ("check", "core", "demo", "integrations", "pipeline", "plan", "runtime", "sim", "strategies", "tools", "zoo")
)

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


def __getattr__(name: str) -> _typing.Any:
    # An ImportError raised below (a missing dependency) propagates as it is: only a name
    # that is none of these is an AttributeError.
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = _importlib.import_module(_MODULES[name])
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"jaxsched.{name}")
    elif name in _deprecations.MOVED:
        # ``from jaxsched import models`` asks twice, first from the import machinery: warn once
        if not _sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):
            _warnings.warn(_deprecations.message(name), DeprecationWarning, stacklevel=2)
        return _importlib.import_module(_deprecations.MOVED[name])  # not cached: it warns each time
    else:
        raise AttributeError(f"module 'jaxsched' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})


if _typing.TYPE_CHECKING:  # what static tools (type checkers, the API reference) read
    from jaxsched._errors import (
        JaxschedError,
        JaxschedRuntimeError,
        JaxschedTypeError,
        JaxschedValueError,
        JaxschedWarning,
        UnshardedStepWarning,
    )
    from jaxsched._schedule import STRATEGIES, SchedState, Scheduled, schedule
    from jaxsched.core._capture import UnsupportedStepError
    from jaxsched.core.partition import GatherWarning
    from jaxsched.core.rewrite._rules import FallbackWarning
    from jaxsched.demo.config import Config, ConfigError
    from jaxsched.demo.steps import make_pmap_step, make_step
    from jaxsched.demo.trainer import RunResult, train
    from jaxsched.integrations import kfac, nnx
    from jaxsched.plan import plan_buckets
    from jaxsched.pipeline.replan import Replan, ReplanAgreementError
    from jaxsched.plan._profiling import profile_network, profile_zoo_model
    from jaxsched.runtime import compress
    from jaxsched.runtime.collectives import Collective, CollectiveWrapper
    from jaxsched.runtime.engine import Engine, register_engine
    from jaxsched.sim import simulate
    from jaxsched.sim._costmodel import Layer, LayerProfile, NetworkProfile, network_preset
    from jaxsched.strategies import Strategy, register_strategy
    from jaxsched.zoo.models import pure
