"""Rewrite building blocks shared by strategies: the backward walk and the shard rules."""

from jaxsched.core.rewrite.backward import walk_backward
from jaxsched.core.rewrite.rules import FallbackWarning, Shard, ShardContext, apply_rule, eval_sharded

__all__ = ["FallbackWarning", "Shard", "ShardContext", "apply_rule", "eval_sharded", "walk_backward"]
