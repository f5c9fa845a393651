"""Where XLA places the plain ``jax.jit`` step's outputs, read by compiling it once.

A scheduled step must return every leaf with the sharding the plain step gives it. For the
state that is the layout it came in, except where XLA's propagation moves a leaf (an FSDP
step's replicated bias comes back split, because XLA reduce-scatters its gradient). For an
array in the aux it is wherever XLA's propagation puts it: on a model axis a gradient
returned as a metric stays split like its parameter, and over a data axis XLA splits the
row sums of an FSDP gradient. The scheduled program cannot always reproduce that (a
strategy that packs gradients into flat buckets leaves XLA nothing to propagate from; a
partial sum is summed whole). Only compiling the plain step tells, so it is compiled once
per program, and only where the answer can differ (a jit step with split state or model
axes, on devices that run here: never for compile-only targets).

Example:
    >>> import jax, optax
    >>> from jaxsched.core._capture import capture
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(8,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    >>> tx = optax.sgd(0.1)
    >>> step = steps.make_jit_step(apply_fn, tx)
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, "int32")), mesh)
    >>> captured = capture(step, params, tx.init(params), batch)
    >>> needs_plain_aux_layout(captured, [0])      # scalar metrics: replicated either way
    False
    >>> [s.is_fully_replicated for s in plain_output_shardings(captured)][-1]  # the loss
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jaxsched.core._axes import spec_axes
from jaxsched.core._capture import CapturedStep

__all__ = ["needs_plain_aux_layout", "plain_output_shardings", "runs_here"]


def runs_here(device: Any) -> bool:
    """Whether ``device`` is one of this process's backends' (not a compile-only device)."""
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:
        return False


def plain_output_shardings(captured: CapturedStep) -> list | None:
    """The shardings of the plain step's flat outputs (new params, optimizer state, aux) as
    XLA compiles it with nothing but the step's own annotations (its captured global
    jaxpr, the same computation); None where it cannot say.

    Args:
      captured: the captured ``jax.jit`` step (its example inputs and global jaxpr).

    Returns:
      One sharding per flat output, or None.
    """
    if captured.kind != "jit" or captured.example_inputs is None or captured.global_step is None:
        return None
    closed = captured.global_step
    flat = jax.tree.leaves(captured.example_inputs)
    if len(flat) != len(closed.jaxpr.invars):
        return None
    try:
        compiled = jax.jit(jax.extend.core.jaxpr_as_fun(closed)).trace(*flat).lower().compile()
        return list(jax.tree.leaves(compiled.output_shardings))
    except Exception:  # the scheduled layout stands where XLA will not say
        return None


def needs_plain_aux_layout(captured: CapturedStep, aux_ranks: Sequence[int]) -> bool:
    """Whether the aux may need the plain step's layout: a jit step on several devices that
    returns an aux array of rank >= 1 (scalar metrics are replicated either way), where
    its state is split over some axis or it leaves axes to XLA, on devices that run here.
    Over model axes XLA's propagation places it; over the data axes XLA splits what it
    computes from blocks (the row sums of an FSDP gradient), where the partitioned program
    returns the sum whole."""
    sharded_state = any(
        spec_axes(spec) for src, spec in zip(captured.sources, captured.in_specs) if src.role in ("params", "opt_state")
    )
    return (
        captured.kind == "jit"
        and captured.mesh.devices.size > 1
        and (captured.manual_axes is not None or sharded_state)  # else the specs say it all
        and any(rank >= 1 for rank in aux_ranks)
        and runs_here(captured.mesh.devices.flat[0])
    )
