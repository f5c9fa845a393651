"""The partitioner's rules by primitive: the forward rules
(`jaxsched.core.partition._forward_rules`: which kinds an equation needs of its operands and
which its results have) and the narrowing rules
(`jaxsched.core.partition._narrowing_rules`: how a replicated producer computes only the
block its readers want), under one name.

Example:
    >>> "dot_general" in RULES and "scan" not in RULES  # loops: control_flow.CONTROL_RULES
    True
    >>> NARROW["sin"] is not None and "threefry2x32" not in NARROW
    True
"""

from __future__ import annotations

from jaxsched.core.partition._forward_rules import (
    ELEMENTWISE,
    LINEAR_IN,
    PARTIAL,
    REPLICATED,
    RULES,
    SHARDING_PARAMS,
    Finish,
    Rule,
    RuleDict,
    _linear_positions,
    _partial_inputs,
    _partial_ok,
    _plan,
    _shape,
    bind_local,
    elementwise_rule,
    identity_rule,
    local_sharding,
    microbatch_rows,
    moving_rule,
    refuse_rule,
    replicated_rule,
    reshaped_dim,
    rule_for,
)
from jaxsched.core.partition._narrowing_rules import NARROW, NARROWABLE_ELEMENTWISE, NarrowRule, narrow_rule_for

__all__ = [
    "ELEMENTWISE",
    "Finish",
    "LINEAR_IN",
    "NARROW",
    "NARROWABLE_ELEMENTWISE",
    "NarrowRule",
    "PARTIAL",
    "REPLICATED",
    "RULES",
    "Rule",
    "RuleDict",
    "SHARDING_PARAMS",
    "bind_local",
    "elementwise_rule",
    "identity_rule",
    "local_sharding",
    "microbatch_rows",
    "moving_rule",
    "narrow_rule_for",
    "refuse_rule",
    "replicated_rule",
    "reshaped_dim",
    "rule_for",
    # used by `jaxsched.core.partition._blocks`, kept for old imports
    "_linear_positions",
    "_partial_inputs",
    "_partial_ok",
    "_plan",
    "_shape",
]
