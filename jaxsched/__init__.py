"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched.capture import UnsupportedStepError
from jaxsched.config import Config, ConfigError
from jaxsched.costmodel import Layer, LayerProfile, NetworkProfile, network_preset
from jaxsched.models import pure
from jaxsched.plan import plan_buckets
from jaxsched.profile import profile_network, profile_zoo_model
from jaxsched.collectives import Collective, CollectiveWrapper
from jaxsched import compress
from jaxsched import kfac
from jaxsched.engine import Engine, register_engine
from jaxsched.partition import GatherWarning
from jaxsched.rewrite.rules import FallbackWarning
from jaxsched.schedule import STRATEGIES, SchedState, Scheduled
from jaxsched.replan import Replan, ReplanAgreementError
from jaxsched.schedule import schedule  # noqa: E402  (the function shadows the module name)
from jaxsched.strategies import Strategy, register_strategy
from jaxsched.sim import simulate
from jaxsched.steps import make_pmap_step, make_step
from jaxsched.trainer import RunResult, train
from jaxsched import nnx  # noqa: E402  (after schedule: the adapter wraps it)

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
    "Replan",
    "ReplanAgreementError",
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
