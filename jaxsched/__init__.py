"""jaxsched: scheduled gradient communication for data-parallel JAX training."""
from jaxsched.config import Config, ConfigError
from jaxsched.models import pure
from jaxsched.steps import make_pmap_step, make_step
from jaxsched.trainer import RunResult, Unscheduled, train

__all__ = [
    "Config",
    "ConfigError",
    "RunResult",
    "Unscheduled",
    "make_pmap_step",
    "make_step",
    "pure",
    "train",
]
__version__ = "0.1.0"
