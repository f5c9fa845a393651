"""``jaxsched.schedule``: capture -> analyze -> plan -> rewrite -> engine.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched import models, steps
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.adam(1e-3)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> state, aux = sched(state, batch)
    >>> new_params, new_opt_state = sched.finalize(state)
    >>> jax.tree.structure(new_params) == jax.tree.structure(params)
    True
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched import layout
from jaxsched.analyze import Analysis, analyze
from jaxsched.bucketing import Bucket, param_paths, plan_buckets
from jaxsched.capture import CapturedStep, UnsupportedStepError, capture
from jaxsched.engine import compile_body
from jaxsched.rewrite import rewrite_dear, rewrite_wfbp

STRATEGIES = ("allreduce", "wfbp", "dear")


class SchedState(NamedTuple):
    """The state a scheduled step carries between calls.

    Attributes:
      params: the user's params tree. Under ``dear`` each leaf becomes, after the first
        step, a flat ``(P * chunk,)`` array sharded over the data axis: this device's
        chunk of the updated parameter, whose all-gather is deferred into the next step.
      opt_state: the user's optimizer state tree; under ``dear`` every non-scalar leaf is
        stored flat and sharded like the params (ZeRO-1), scalars (step counts) stay whole.
    """

    params: Any
    opt_state: Any


class Scheduled:
    """A scheduled training step: ``init``, ``__call__``, ``finalize`` (see :func:`schedule`)."""

    def __init__(self, step: Callable, strategy: str = "dear", buckets: Any = None,
                 compiler_options: dict[str, Any] | None = None, **plan_options: Any):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}")
        if not callable(step):
            raise TypeError(f"schedule() needs the user's train step, got {type(step).__name__}")
        self.step = step
        self.strategy = strategy
        self.buckets_option = buckets
        self.compiler_options = compiler_options
        unknown = set(plan_options) - {"layer_profile", "network_profile", "planner"}
        if unknown:
            raise TypeError(f"schedule() got unknown options {sorted(unknown)}; known: buckets, "
                            "compiler_options, and with buckets='auto': layer_profile, "
                            "network_profile, planner")
        self.plan_options = plan_options
        self._template: tuple[Any, Any] | None = None
        self._program: _Program | None = None
        functools.update_wrapper(self, step, updated=())

    # -- public API -----------------------------------------------------------------------
    def init(self, params: Any, opt_state: Any, batch: Any = None) -> SchedState:
        """Ordinary trees in, scheduled state out.

        Without ``batch`` the leaves keep the user's layout until the first step converts
        them (the step can only be traced once a batch is known). With an example
        ``batch`` the state comes back in its scheduled layout at once, which is what a
        checkpoint restore needs as its target.
        """
        self._template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype(a)),
                                      (params, opt_state))
        state = SchedState(params, opt_state)
        if batch is None or self.strategy == "allreduce":
            return state
        return self._program_for(state, batch).convert(state)

    def __call__(self, state: SchedState, batch: Any) -> tuple[SchedState, Any]:
        """One training step; returns the new state and the step's aux, as the plain step would."""
        if self.strategy == "allreduce":
            params, opt_state, aux = self.step(state.params, state.opt_state, batch)
            return SchedState(params, opt_state), aux
        program = self._program_for(state, batch)
        return program.run(state, batch)

    def finalize(self, state: SchedState) -> tuple[Any, Any]:
        """Back to ordinary ``(params, opt_state)``: performs the pending all-gathers."""
        if self.strategy == "allreduce" or self._program is None:
            return state.params, state.opt_state
        return self._program.finalize(state)

    def lower(self, state: SchedState, batch: Any):
        """The lowered scheduled program (StableHLO), e.g. to inspect where collectives sit."""
        if self.strategy == "allreduce":
            return self.step.lower(state.params, state.opt_state, batch)
        program = self._program_for(state, batch)
        return program.core.lower(*program.inputs(state, batch))

    @property
    def program(self) -> "_Program":
        if self._program is None:
            raise RuntimeError("the step has not been traced yet: call it once (or lower()) first")
        return self._program

    # -- internals -------------------------------------------------------------------------
    def _program_for(self, state: SchedState, batch: Any) -> "_Program":
        if self._program is None:
            template = self._template or (state.params, state.opt_state)
            captured = capture(self.step, template[0], template[1], batch)
            self._program = _Program(captured, self.strategy, self.buckets_option, self.compiler_options,
                                     self.plan_options)
        return self._program


def _dtype(a):
    return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype


class _Program:
    """What one capture produces: the analysis, buckets, compiled core and layout conversions."""

    def __init__(self, captured: CapturedStep, strategy: str, buckets_option: Any,
                 compiler_options: dict[str, Any] | None, plan_options: dict[str, Any] | None = None):
        self.captured = cap = captured
        self.analysis: Analysis = analyze(captured)
        self.paths = _param_paths(cap)
        self.layer_profile = self.network_profile = None
        if isinstance(buckets_option, str):
            if buckets_option != "auto":
                raise ValueError(f"buckets={buckets_option!r} is not understood; the only named plan "
                                 "is 'auto' (cost-model planning)")
            from jaxsched.plan.from_step import auto_bucket_paths

            buckets_option, self.layer_profile, self.network_profile = auto_bucket_paths(
                self.analysis, self.paths, strategy, **(plan_options or {}))
        self.buckets: list[Bucket] = plan_buckets(self.analysis, self.paths, buckets_option)
        self.strategy = strategy
        body_aval = lambda role, i: cap.body.invars[cap.body_input(role, i)].aval
        for role, n in (("params", cap.num_params), ("opt_state", cap.num_opt)):
            for i in range(n):
                if cap.body_input(role, i) < 0:
                    raise UnsupportedStepError(f"{role} leaf {i} never reaches the shard_map body")
        self.param_blocks = [body_aval("params", i) for i in range(cap.num_params)]
        self.opt_blocks = [body_aval("opt_state", j) for j in range(cap.num_opt)]
        if strategy == "dear":
            self.opt_sharded = [math.prod(a.shape) > 1 for a in self.opt_blocks]
            rewritten = rewrite_dear(self.analysis, self.buckets, self.opt_sharded)
        else:
            self.opt_sharded = [False] * cap.num_opt
            rewritten = rewrite_wfbp(self.analysis, self.buckets)
        self.rewritten = rewritten
        self.core = compile_body(rewritten.body, cap.mesh, rewritten.in_specs, rewritten.out_specs,
                                 compiler_options)
        self.shard_sharding = NamedSharding(cap.mesh, P(cap.axis_name))
        self.mesh_devices = set(cap.mesh.devices.flat)

    @property
    def fallbacks(self) -> list:
        return self.rewritten.fallbacks

    # layout conversions ------------------------------------------------------------------
    def _user_to_block(self, leaf: Any, block) -> np.ndarray:
        leaf = np.asarray(leaf)
        if self.captured.kind == "pmap":
            leaf = leaf[:1]
        return leaf.reshape(block.shape)

    def _sharded(self, leaf: Any, block, name: str) -> jax.Array:
        size = self.captured.axis_size
        flat_len = layout.chunk_size(block.shape, size) * size
        if isinstance(leaf, jax.Array) and leaf.shape == (flat_len,) and leaf.sharding == self.shard_sharding:
            return leaf
        expected = (len(self.captured.mesh.devices.flat),) + tuple(block.shape[1:]) \
            if self.captured.kind == "pmap" else tuple(block.shape)
        if tuple(np.shape(leaf)) != expected and tuple(np.shape(leaf)) != (flat_len,):
            raise ValueError(f"state leaf {name} has shape {np.shape(leaf)}; expected the user's "
                             f"{expected} or the scheduled ({flat_len},)")
        flat = layout.host_chunks(self._user_to_block(leaf, block), size) \
            if tuple(np.shape(leaf)) == expected else np.asarray(leaf)
        return jax.device_put(flat, self.shard_sharding)

    def _unsharded(self, leaf: Any, block) -> Any:
        cap = self.captured
        flat_len = layout.chunk_size(block.shape, cap.axis_size) * cap.axis_size
        is_sharded = (isinstance(leaf, jax.Array) and leaf.shape == (flat_len,)
                      and leaf.sharding == self.shard_sharding)
        if not is_sharded:
            return leaf  # still in the user's layout (no step has run yet)
        full = _host_value(leaf)[: math.prod(block.shape)].reshape(block.shape)
        if cap.kind == "pmap":
            full = np.repeat(full, len(cap.mesh.devices.flat), axis=0)
        return full

    def _placed(self, value: Any, spec: P) -> Any:
        if all(dim is None for dim in spec) and not (
                isinstance(value, jax.Array) and value.sharding.device_set != self.mesh_devices):
            return value  # replicated and on the mesh (or on the host): jit places it
        sharding = NamedSharding(self.captured.mesh, spec)
        if isinstance(value, jax.Array) and value.sharding == sharding:
            return value
        return jax.device_put(value, sharding)

    def _state_leaves(self, state: SchedState) -> tuple[list, list]:
        """Params and opt_state leaves as the compiled core takes them."""
        cap = self.captured
        params, opts = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)
        if len(params) != cap.num_params or len(opts) != cap.num_opt:
            raise ValueError("the state does not match the step it was traced with: "
                             f"{len(params)} params / {len(opts)} opt_state leaves, expected "
                             f"{cap.num_params} / {cap.num_opt}")
        spec = lambda role, i: cap.in_specs[cap.body_input(role, i)]
        if self.strategy == "wfbp":
            return ([self._placed(leaf, spec("params", i)) for i, leaf in enumerate(params)],
                    [self._placed(leaf, spec("opt_state", j)) for j, leaf in enumerate(opts)])
        return ([self._sharded(leaf, block, f"params/{self.paths[i]}")
                 for i, (leaf, block) in enumerate(zip(params, self.param_blocks))],
                [self._sharded(leaf, block, f"opt_state[{j}]") if self.opt_sharded[j]
                 else self._placed(leaf, spec("opt_state", j))
                 for j, (leaf, block) in enumerate(zip(opts, self.opt_blocks))])

    def inputs(self, state: SchedState, batch: Any) -> list:
        """The compiled core's arguments for one step."""
        cap = self.captured
        batch_leaves = jax.tree.leaves(batch)
        if len(batch_leaves) != cap.num_batch:
            raise ValueError(f"the batch has {len(batch_leaves)} leaves; the step was traced with "
                             f"{cap.num_batch}")
        params, opts = self._state_leaves(state)
        value = {("params", i): leaf for i, leaf in enumerate(params)}
        value.update({("opt_state", j): leaf for j, leaf in enumerate(opts)})
        for k, src in enumerate(cap.sources):
            if src.role == "batch":
                value[("batch", src.index)] = self._placed(batch_leaves[src.index], cap.in_specs[k])
            elif src.role == "const":
                value[("const", src.index)] = self._placed(cap.consts[src.index], cap.in_specs[k])
        if self.strategy == "wfbp":  # the user's body signature
            return [value[(src.role, src.index)] for src in cap.sources]
        return params + opts + [value[(src.role, src.index)] for src in cap.sources
                                if src.role in ("batch", "const")]

    def convert(self, state: SchedState) -> SchedState:
        """The state in this program's layout (sharded leaves for dear); idempotent."""
        params, opts = self._state_leaves(state)
        return SchedState(jax.tree.unflatten(self.captured.params_tree, params),
                          jax.tree.unflatten(self.captured.opt_tree, opts))

    def run(self, state: SchedState, batch: Any) -> tuple[SchedState, Any]:
        cap = self.captured
        outs = self.core(*self.inputs(state, batch))
        n_p, n_o = cap.num_params, cap.num_opt
        if self.strategy == "wfbp":
            outs = [outs[k] for k in cap.outputs]
        params = jax.tree.unflatten(cap.params_tree, outs[:n_p])
        opt_state = jax.tree.unflatten(cap.opt_tree, outs[n_p:n_p + n_o])
        aux = jax.tree.unflatten(cap.aux_tree, outs[n_p + n_o:])
        return SchedState(params, opt_state), aux

    def finalize(self, state: SchedState) -> tuple[Any, Any]:
        cap = self.captured
        if self.strategy == "wfbp":
            return state.params, state.opt_state
        params = [self._unsharded(leaf, block) for leaf, block in
                  zip(jax.tree.leaves(state.params), self.param_blocks)]
        opts = [self._unsharded(leaf, block) if sharded else leaf for leaf, block, sharded in
                zip(jax.tree.leaves(state.opt_state), self.opt_blocks, self.opt_sharded)]
        return jax.tree.unflatten(cap.params_tree, params), jax.tree.unflatten(cap.opt_tree, opts)


def _host_value(leaf: Any) -> np.ndarray:
    """The whole array on this host, also when other processes hold some of its shards."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def _param_paths(cap: CapturedStep) -> list[str]:
    dummy = jax.tree.unflatten(cap.params_tree, [0] * cap.num_params)
    return param_paths(dummy)


def schedule(train_step: Callable | None = None, strategy: str = "dear", buckets: Any = None,
             compiler_options: dict[str, Any] | None = None, **options: Any) -> Any:
    """Schedule the gradient communication of a data-parallel ``train_step``.

    Args:
      train_step: ``(params, opt_state, batch) -> (params, opt_state, aux)`` whose body is a
        ``jax.shard_map`` over a mesh axis (jitted or not) or a ``jax.pmap``, reducing the
        gradients with ``lax.pmean``/``lax.psum`` (or implicitly via ``check_vma``).
        Omit it to use ``schedule`` as a decorator: ``@jaxsched.schedule(strategy="wfbp")``.
      strategy: ``allreduce`` (the step unchanged), ``wfbp`` (one all-reduce per bucket in
        backward) or ``dear`` (reduce-scatter in backward, sharded update, all-gather
        deferred to the next forward).
      buckets: ``None`` (25 MB threshold in gradient-completion order), a byte threshold,
        an explicit plan (a list of lists of parameter paths such as ``"head/kernel"``), or
        ``"auto"``: planned against the simulator (:mod:`jaxsched.plan.from_step`), with
        options ``layer_profile`` (a measured :class:`~jaxsched.costmodel.LayerProfile`),
        ``network_profile`` (a profile or preset name; default: measured on the mesh) and
        ``planner`` (default ``"optimal"``).
      compiler_options: per-function XLA options; by default the platform's set from
        :mod:`jaxsched.engine.xla` (latency-hiding scheduler on, combiners off, on GPU).
    """
    if train_step is None:
        return lambda step: Scheduled(step, strategy, buckets, compiler_options, **options)
    return Scheduled(train_step, strategy, buckets, compiler_options, **options)
