"""Rewrite building blocks shared by strategies: the backward walk and the shard rules."""

from jaxsched import _deprecations

from jaxsched.core.rewrite._backward import walk_backward
from jaxsched.core.rewrite._rules import FallbackWarning, Shard, ShardContext, apply_rule, eval_sharded

__all__ = ["FallbackWarning", "Shard", "ShardContext", "apply_rule", "eval_sharded", "walk_backward"]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
