"""Collectives strategies call per bucket; wrappers (compression, casts) plug in here."""
from jaxsched.collectives.base import (FORMS, BucketSpec, Collective, CollectiveWrapper, PlainCollective,
                                       stack_local, stacked_zeros, unstack_local)

__all__ = ["FORMS", "BucketSpec", "Collective", "CollectiveWrapper", "PlainCollective", "stack_local",
           "stacked_zeros", "unstack_local"]
