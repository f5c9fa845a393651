"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched.capture import UnsupportedStepError
from jaxsched.costmodel import Layer, LayerProfile, NetworkProfile, network_preset
from jaxsched.plan import plan_buckets
from jaxsched.profile import profile_network, profile_zoo_model
from jaxsched.sim import simulate
from jaxsched.config import Config, ConfigError
from jaxsched.models import pure
from jaxsched.rewrite.rules import FallbackWarning
from jaxsched.schedule import STRATEGIES, SchedState, Scheduled
from jaxsched.schedule import schedule  # noqa: E402  (the function shadows the module name)
from jaxsched.steps import make_pmap_step, make_step
from jaxsched.trainer import RunResult, train

__all__ = [
    "STRATEGIES",
    "Layer",
    "LayerProfile",
    "NetworkProfile",
    "Config",
    "ConfigError",
    "FallbackWarning",
    "RunResult",
    "SchedState",
    "Scheduled",
    "UnsupportedStepError",
    "make_pmap_step",
    "network_preset",
    "plan_buckets",
    "profile_network",
    "profile_zoo_model",
    "make_step",
    "pure",
    "schedule",
    "simulate",
    "train",
]
__version__ = "0.1.0"
