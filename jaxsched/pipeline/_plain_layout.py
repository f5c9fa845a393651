"""Where XLA places the plain ``jax.jit`` step's outputs, read by compiling it once.

A scheduled step must return every leaf with the sharding the plain step gives it. For the
state that is the layout it came in, except where XLA's propagation moves a leaf (an FSDP
step's replicated bias comes back split, because XLA reduce-scatters its gradient). For the
aux of a step with model axes (tensor parallelism) it is wherever XLA's propagation puts a
value on those axes (a gradient returned as a metric stays split like its parameter),
which the scheduled program cannot always reproduce: a strategy that packs gradients into
flat buckets leaves XLA nothing to propagate from. Only compiling the plain step tells, so
it is compiled once per program, and only where the answer can differ (a jit step, on
devices that run here: never for compile-only targets).

Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxsched
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> sched = jaxsched.schedule(jax.jit(lambda p, o, b: (p, o, {"loss": jnp.sum(b)})))
    >>> state, aux = sched(sched.init({"w": jnp.ones(2)}, ()), jnp.ones(8))
    >>> sched.program.per_device.aux_shardings is None   # no model axes: nothing to read
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax

from jaxsched.core._capture import CapturedStep

if TYPE_CHECKING:
    from jaxsched.pipeline._program import Program

__all__ = ["needs_plain_aux_layout", "plain_output_shardings", "plain_returned_shardings", "runs_here"]


def runs_here(device: Any) -> bool:
    """Whether ``device`` is one of this process's backends' (not a compile-only device)."""
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:
        return False


def plain_output_shardings(captured: CapturedStep, step: Callable | None = None) -> list | None:
    """The shardings of the plain step's flat outputs (new params, optimizer state, aux) as
    XLA compiles it with nothing but the step's own annotations; None where it cannot say.

    Args:
      captured: the captured ``jax.jit`` step (its example inputs and global jaxpr).
      step: the step itself (None: run the captured global jaxpr, the same computation).

    Returns:
      One sharding per flat output, or None.
    """
    if captured.kind != "jit" or captured.example_inputs is None:
        return None
    try:
        if step is None:
            if captured.global_step is None:
                return None
            closed = captured.global_step
            flat = jax.tree.leaves(captured.example_inputs)
            if len(flat) != len(closed.jaxpr.invars):
                return None
            compiled = jax.jit(jax.extend.core.jaxpr_as_fun(closed)).trace(*flat).lower().compile()
        else:
            compiled = jax.jit(step).trace(*captured.example_inputs).lower().compile()
        return list(jax.tree.leaves(compiled.output_shardings))
    except Exception:  # the scheduled layout stands where XLA will not say
        return None


def needs_plain_aux_layout(captured: CapturedStep, aux_ranks: Sequence[int]) -> bool:
    """Whether the aux may need the plain step's layout on axes the program leaves to XLA: a
    jit step over model axes (``manual_axes`` set) that returns an aux array of rank >= 1,
    on devices that run here."""
    return (
        captured.kind == "jit"
        and captured.manual_axes is not None
        and any(rank >= 1 for rank in aux_ranks)
        and runs_here(captured.mesh.devices.flat[0])
    )


def plain_returned_shardings(program: Program, step: Callable) -> list | None:
    """The shardings XLA gives the plain ``jax.jit`` step's new params and optimizer state,
    where they may differ from the state's layout: None where they cannot.

    The scheduled state keeps each leaf as it came in (or as ``out_shardings`` or a sharding
    constraint say), and so does the plain step, except that XLA's propagation may return
    a leaf placed replicated split over a data axis (an FSDP step's replicated bias, whose
    gradient XLA reduce-scatters). Compiled once per program (`Program.plain_returned`),
    for ``finalize``, where a state leaf is replicated beside sharded ones on devices that
    run (never for compile-only targets)."""
    captured = program.captured
    if captured.kind != "jit" or captured.mesh.devices.size < 2 or not captured.state_outputs:
        return None
    whole = [all(s is None for s in program.planned.output_spec(k)) for k in range(len(captured.state_outputs))]
    if all(whole) or not any(whole) or not runs_here(captured.mesh.devices.flat[0]):
        return None
    cached = program.plain_returned
    if cached is None:
        outputs = plain_output_shardings(captured, step)
        cached = [] if outputs is None else outputs[: len(whole)]
        program.plain_returned = cached
    return cached or None
