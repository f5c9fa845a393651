"""The rule table the partitioner is built with: the rules by primitive, the narrowing rules,
and the rules for parameter blocks.

Example:
    >>> import jax.numpy as jnp
    >>> from jax import make_jaxpr
    >>> eqn = make_jaxpr(lambda a, b: a * b)(jnp.ones(2), jnp.ones(2)).jaxpr.eqns[0]
    >>> TABLE.rule_for(eqn).__name__, TABLE.block_rule_for(eqn).__name__
    ('elementwise_rule', 'elementwise_rule')
"""

from __future__ import annotations

from jaxsched.core.partition import (
    _blocks as blocks,
    _forward_rules as forward_rules,
    _narrowing_rules as narrowing_rules,
)
from jaxsched.core.partition._interpreter import RuleTable

__all__ = ["TABLE"]

#: Where `Partitioner` finds its rules.
TABLE = RuleTable(
    rule_for=forward_rules.rule_for,
    narrow_rule_for=narrowing_rules.narrow_rule_for,
    block_rule_for=blocks.block_rule_for,
    hints_for=blocks.block_hints,
)
