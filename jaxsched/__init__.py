"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched import _legacy_paths

_legacy_paths.install()

from jaxsched.core.capture import UnsupportedStepError
from jaxsched.demo.config import Config, ConfigError
from jaxsched.sim.costmodel import Layer, LayerProfile, NetworkProfile, network_preset
from jaxsched.zoo.models import pure
from jaxsched.plan import plan_buckets
from jaxsched.plan.profiling import profile_network, profile_zoo_model
from jaxsched.runtime.collectives import Collective, CollectiveWrapper
from jaxsched.runtime import compress
from jaxsched.integrations import kfac
from jaxsched.runtime.engine import Engine, register_engine
from jaxsched.core.partition import GatherWarning
from jaxsched.core.rewrite.rules import FallbackWarning
from jaxsched._schedule import STRATEGIES, SchedState, Scheduled
from jaxsched._schedule import schedule
from jaxsched.strategies import Strategy, register_strategy
from jaxsched.sim import simulate
from jaxsched.demo.steps import make_pmap_step, make_step
from jaxsched.demo.trainer import RunResult, train
from jaxsched.integrations import nnx  # noqa: E402  (after schedule: the adapter wraps it)

__all__ = [
    "Collective",
    "CollectiveWrapper",
    "Config",
    "ConfigError",
    "compress",
    "kfac",
    "Engine",
    "FallbackWarning",
    "GatherWarning",
    "Layer",
    "LayerProfile",
    "NetworkProfile",
    "RunResult",
    "STRATEGIES",
    "SchedState",
    "Scheduled",
    "Strategy",
    "UnsupportedStepError",
    "make_pmap_step",
    "make_step",
    "network_preset",
    "nnx",
    "plan_buckets",
    "profile_network",
    "profile_zoo_model",
    "register_engine",
    "register_strategy",
    "pure",
    "schedule",
    "simulate",
    "train",
]
__version__ = "0.1.0"
