"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched.capture import UnsupportedStepError
from jaxsched.config import Config, ConfigError
from jaxsched.costmodel import Layer, LayerProfile, NetworkProfile, network_preset
from jaxsched.models import pure
from jaxsched.plan import plan_buckets
from jaxsched.profile import profile_network, profile_zoo_model
from jaxsched.rewrite.rules import FallbackWarning
from jaxsched.schedule import STRATEGIES, SchedState, Scheduled
from jaxsched.schedule import schedule  # noqa: E402  (the function shadows the module name)
from jaxsched.sim import simulate
from jaxsched.steps import make_pmap_step, make_step
from jaxsched.trainer import RunResult, train

__all__ = [
    "Config",
    "ConfigError",
    "FallbackWarning",
    "Layer",
    "LayerProfile",
    "NetworkProfile",
    "RunResult",
    "STRATEGIES",
    "SchedState",
    "Scheduled",
    "UnsupportedStepError",
    "make_pmap_step",
    "make_step",
    "network_preset",
    "plan_buckets",
    "profile_network",
    "profile_zoo_model",
    "pure",
    "schedule",
    "simulate",
    "train",
]
__version__ = "0.1.0"
