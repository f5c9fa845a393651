"""Rewrite: emit the scheduled body. One module per strategy; shared rules in ``rules``."""
from jaxsched.rewrite.common import RewrittenBody
from jaxsched.rewrite.dear import rewrite_dear
from jaxsched.rewrite.wfbp import rewrite_wfbp

__all__ = ["RewrittenBody", "rewrite_dear", "rewrite_wfbp"]
