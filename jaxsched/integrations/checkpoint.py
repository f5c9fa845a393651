"""Orbax checkpoints of a scheduled state, for training that stops and resumes exactly.

Why this module: a scheduled state (``SchedState(params, opt_state, collective_state)``)
may be in its strategy's own layout (``dear`` keeps each parameter as a flat shard per
device) and carries a compressor's residuals. Restoring it needs a target in that same
layout, with its shardings: ``sched.init(params, opt_state, example_batch)`` gives one.
Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
save that is interrupted (Ctrl-C, a killed process) never replaces the last complete one.

- `save` / `restore`: one checkpoint in one folder, synchronously.
- `Checkpoints`: numbered checkpoints in a folder (``save(step, state)`` in the
  background, ``latest_step()``, ``restore(target)``, ``wait()``), keeping the last few.

Every process of a multi-process run must make the same calls (orbax coordinates them).

Example:
    >>> import tempfile, jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.integrations import checkpoint
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.adam(1e-3)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> state, _ = sched(sched.init(params, tx.init(params), batch), batch)
    >>> target = sched.init(params, tx.init(params), batch)   # the scheduled layout
    >>> with Checkpoints(tempfile.mkdtemp()) as ckpts:
    ...     ckpts.save(1, state)
    ...     ckpts.wait()
    ...     restored = ckpts.restore(target)
    ...     ckpts.latest_step()
    1
    >>> same = lambda x, y: all(bool((a == b).all())
    ...                         for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
    >>> same(restored, state)
    True
    >>> folder = tempfile.mkdtemp() + "/one"
    >>> save(folder, state)
    >>> same(restore(folder, target), state)
    True
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax

from jaxsched._errors import JaxschedValueError

__all__ = ["Checkpoints", "restore", "save"]


def _read(where: Any, read: Any, target: Any) -> Any:
    """``read(abstract target)``; a saved state of another structure than ``target``'s is
    refused saying how to build the target, where orbax's own message suggests a partial
    restore, which would silently leave leaves out."""
    try:
        return read(None if target is None else _abstract(target))
    except ValueError as e:
        message = str(e)
        if target is None or not ("tree structures do not match" in message or "Unsupported type" in message):
            raise
        if "Unsupported type" in message:  # a leaf no step has traced yet (approx's pending count)
            differs = f"the target holds a leaf that is no array yet ({message.splitlines()[0]})"
        else:  # orbax calls the target "Source" and the checkpoint "Target"
            differs = " ".join(line.strip() for line in message.splitlines()[1:4])
            differs = differs.replace("Source:", "target:").replace("Target:", "checkpoint:")
        raise JaxschedValueError(
            f"the checkpoint at {where} holds a state of another structure than the target's: "
            f"{differs}. A scheduled state takes its structure from the step's "
            "program (dear's collective state, approx's pending gradients), so build the target "
            "as the saved state was built: sched.init(params, opt_state, example_batch), with "
            "the batch; or restore with target=None to see what was saved"
        ) from e


def _abstract(target: Any) -> Any:
    """Shapes, dtypes and shardings of ``target`` (arrays or ShapeDtypeStructs)."""
    import orbax.checkpoint as ocp

    return jax.tree.map(ocp.utils.to_shape_dtype_struct, _without_empty(target))


def _is_empty(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and math.prod(leaf.shape) == 0


def _without_empty(tree: Any) -> Any:
    """``tree`` with zero-size leaves as None: orbax refuses to write them, and they hold
    nothing (a compressor without error feedback keeps a ``(0,)`` residual)."""
    return jax.tree.map(lambda leaf: None if _is_empty(leaf) else leaf, tree)


def _with_empty(target: Any, restored: Any) -> Any:
    """``restored`` with ``target``'s zero-size leaves put back."""

    def fill(want: Any, got: Any) -> Any:
        if got is None and _is_empty(want):
            sharding = getattr(want, "sharding", None)
            empty = jax.numpy.zeros(want.shape, want.dtype)
            return jax.device_put(empty, sharding) if sharding is not None else empty
        return got

    return jax.tree.map(fill, target, restored)


def save(path: str | Path, state: Any) -> None:
    """Write ``state`` to the folder ``path`` and wait until it is complete on disk.

    Args:
      path: a folder that does not exist yet.
      state: a scheduled state (or any tree of arrays).

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> folder = tempfile.mkdtemp() + "/ckpt"
        >>> save(folder, {"w": jnp.arange(3.0)})
        >>> restore(folder)["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(path).absolute(), _without_empty(state))
    checkpointer.wait_until_finished()


def restore(path: str | Path, target: Any | None = None) -> Any:
    """Read the checkpoint at ``path`` into ``target``'s structure, layout and shardings.

    Args:
      path: the folder `save` wrote.
      target: a state of the same kind, e.g. ``sched.init(params, opt_state, batch)`` (or
        its ``ShapeDtypeStruct`` tree). Without one, orbax returns the tree as it was saved.

    Returns:
      The restored state, in ``target``'s structure, layout and shardings.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> folder = tempfile.mkdtemp() + "/ckpt"
        >>> save(folder, {"w": jnp.ones(2)})
        >>> restore(folder, target={"w": jnp.zeros(2)})["w"].tolist()
        [1.0, 1.0]
    """
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    restored = _read(path, lambda abstract: checkpointer.restore(Path(path).absolute(), abstract), target)
    return restored if target is None else _with_empty(target, restored)


class Checkpoints:
    """Numbered checkpoints ``directory/<step>``, saved in the background, the last
    ``max_to_keep`` kept.

    Why a class: the background save must be waited for before the process exits
    (`wait`, `close`, or use it as a context manager); until a save completes,
    the previous checkpoint is the latest one on disk.

    Args:
      directory: the folder of the numbered checkpoints (created if missing).
      max_to_keep: how many of the newest checkpoints to keep (None: all).

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> with Checkpoints(tempfile.mkdtemp(), max_to_keep=2) as ckpts:
        ...     for step in (1, 2, 3):
        ...         ckpts.save(step, {"w": jnp.full(2, float(step))})
        ...     ckpts.wait()
        ...     ckpts.all_steps(), ckpts.restore(None)["w"].tolist()
        ([2, 3], [3.0, 3.0])
    """

    def __init__(self, directory: str | Path, max_to_keep: int | None = 3):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint.

        Returns:
          Its step, or None if there is none.

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> with checkpoint.Checkpoints(tempfile.mkdtemp()) as ckpts:
          ...     empty = ckpts.latest_step()
          ...     ckpts.save(7, {"w": jnp.ones(2)})
          ...     ckpts.wait()
          ...     empty, ckpts.latest_step()  # a resumed run starts after it
          (None, 7)
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint kept.

        Returns:
          Their steps, oldest first.

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> with checkpoint.Checkpoints(tempfile.mkdtemp(), max_to_keep=2) as ckpts:
          ...     for step in (1, 2, 3):
          ...         ckpts.save(step, {"w": jnp.ones(2)})
          ...     ckpts.wait()
          ...     ckpts.all_steps()  # the oldest is gone
          [2, 3]
        """
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Start saving ``state`` as checkpoint ``step``; returns once the arrays are copied.

        Args:
          step: the checkpoint's number (its folder's name).
          state: a scheduled state (or any tree of arrays).

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> with checkpoint.Checkpoints(tempfile.mkdtemp()) as ckpts:
          ...     ckpts.save(1, {"w": jnp.arange(3.0)})  # training goes on while it is written
          ...     ckpts.wait()
          ...     ckpts.restore(None)["w"].tolist()
          [0.0, 1.0, 2.0]
        """
        import orbax.checkpoint as ocp

        self._manager.save(step, args=ocp.args.StandardSave(_without_empty(state)))

    def restore(self, target: Any | None, step: int | None = None) -> Any:
        """Read one checkpoint.

        Args:
          target: a state whose layout and shardings the checkpoint is read into
            (``None``: as saved, e.g. to compare two runs' states).
          step: the checkpoint (default: the latest).

        Returns:
          The restored state.

        Raises:
          FileNotFoundError: the folder holds no checkpoint.

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> with checkpoint.Checkpoints(tempfile.mkdtemp()) as ckpts:
          ...     for step in (1, 2):
          ...         ckpts.save(step, {"w": jnp.full(2, float(step))})
          ...     ckpts.wait()
          ...     ckpts.restore({"w": jnp.zeros(2)}, step=1)["w"].tolist()
          [1.0, 1.0]
        """
        import orbax.checkpoint as ocp

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        where = f"{self.directory}/{step}"
        restored = _read(
            where, lambda abstract: self._manager.restore(step, args=ocp.args.StandardRestore(abstract)), target
        )
        return restored if target is None else _with_empty(target, restored)

    def wait(self) -> None:
        """Block until every save started so far is complete on disk.

        Call it before reading a checkpoint back or ending the process: `save` returns as
        soon as the arrays are copied.

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> ckpts = checkpoint.Checkpoints(tempfile.mkdtemp())
          >>> ckpts.save(1, {"w": jnp.ones(2)})
          >>> ckpts.wait()
          >>> ckpts.all_steps()
          [1]
          >>> ckpts.close()
        """
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then release orbax's resources.

        ``with Checkpoints(...)`` calls it on exit, also on an exception.

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> from jaxsched.integrations import checkpoint
          >>> folder = tempfile.mkdtemp()
          >>> ckpts = checkpoint.Checkpoints(folder)
          >>> ckpts.save(1, {"w": jnp.ones(2)})
          >>> ckpts.close()  # the pending save completes first
          >>> checkpoint.Checkpoints(folder).latest_step()
          1
        """
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
