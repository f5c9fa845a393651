"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched.capture import UnsupportedStepError
from jaxsched.config import Config, ConfigError
from jaxsched.models import pure
from jaxsched.rewrite.rules import FallbackWarning
from jaxsched.schedule import STRATEGIES, SchedState, Scheduled
from jaxsched.schedule import schedule  # noqa: E402  (the function shadows the module name)
from jaxsched.steps import make_pmap_step, make_step
from jaxsched.trainer import RunResult, train

__all__ = [
    "STRATEGIES",
    "Config",
    "ConfigError",
    "FallbackWarning",
    "RunResult",
    "SchedState",
    "Scheduled",
    "UnsupportedStepError",
    "make_pmap_step",
    "make_step",
    "pure",
    "schedule",
    "train",
]
__version__ = "0.1.0"
