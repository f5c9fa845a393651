"""Abstract training steps for a cluster you do not have: a zoo model or a config, its
optax optimizer and the reference ``shard_map`` step over a mesh of compile-only devices,
with ``jax.ShapeDtypeStruct`` parameters, optimizer state and batch.

Why abstract: a 170M-parameter Transformer on 64 H100s is compiled here, on a CPU
machine, without materializing a single array (``nnx.eval_shape`` builds the model).

Example (any mesh works; ``target="h100:1x2x4"`` needs the ``aot`` extra):
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> exp = abstract_experiment(ModelSpec("mlp", (8,), 2, {"hidden": (4,)}), mesh=mesh)
    >>> exp.num_params, type(exp.params["head"]["bias"]).__name__, exp.batch[0].shape
    (46, 'ShapeDtypeStruct', (64, 8))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.tools import aot
from jaxsched.zoo import models
from jaxsched.demo import steps
from jaxsched.core._axes import num_slices
from jaxsched.demo.config import Config, OptimizerConfig

__all__ = ["AbstractExperiment", "ModelSpec", "ZOO", "abstract_experiment", "from_config", "mesh_for"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A zoo model at a given size, and the per-device batch it trains on.

    Attributes:
      name: ``mlp``, ``cnn`` or ``transformer`` (`jaxsched.zoo.models.MODELS`).
      input_shape: one example's shape (``(seq_len,)`` for the Transformer).
      num_outputs: classes, or the vocabulary.
      options: the model's own options (``hidden``, ``channels``, ``dim``, ...).
      batch_per_device: examples per device per step.
      optimizer: the optax optimizer the step uses.

    Example:
      >>> from jaxsched.tools import aot
      >>> spec = aot.ModelSpec("mlp", (8,), 2, {"hidden": (4,)})
      >>> spec.batch_per_device, spec.optimizer.name
      (32, 'adamw')
    """

    name: str
    input_shape: tuple[int, ...]
    num_outputs: int
    options: dict = dataclasses.field(default_factory=dict)
    batch_per_device: int = 32
    optimizer: OptimizerConfig = OptimizerConfig(name="adamw", learning_rate=1e-4)


#: Realistic sizes for compiled-overlap studies (benchmarks/compiled_overlap.py).
ZOO: dict[str, ModelSpec] = {
    # 8 x 4096 fully connected: 126M parameters, large matmuls per layer
    "mlp": ModelSpec("mlp", (1024,), 1000, {"hidden": (4096,) * 8}, batch_per_device=256),
    # 8 residual blocks of 3x3 convolutions at 256 channels on 32x32 images: 9.5M parameters
    "cnn": ModelSpec("cnn", (32, 32, 3), 100, {"channels": 256, "blocks": 8}, batch_per_device=32),
    # decoder-only, 12 blocks of width 1024, 32k vocabulary: 218M parameters
    "transformer": ModelSpec(
        "transformer", (512,), 32000, {"dim": 1024, "heads": 16, "layers": 12}, batch_per_device=8
    ),
}


@dataclasses.dataclass(frozen=True)
class AbstractExperiment:
    """What ``schedule(...).inspect`` needs, without data.

    Attributes:
      step: the reference step: a jitted ``shard_map`` (`jaxsched.demo.steps.make_step`) or
        ``jax.jit`` on global arrays (`jaxsched.demo.steps.make_jit_step`).
      params, opt_state, batch: ``jax.ShapeDtypeStruct`` trees with shardings on ``mesh``.
      mesh: the mesh over compile-only (or real) devices, axis ``"data"``.
      description: model, size and batch, for reports.

    Example:
      >>> import jax
      >>> from jaxsched.tools import aot
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> exp = aot.abstract_experiment(aot.ModelSpec("mlp", (8,), 2, {"hidden": (4,)}), mesh=mesh)
      >>> exp.description
      'mlp 0.0M params, 32 examples per device, adamw'
    """

    step: steps.Step
    params: Any  # a model's pytree of ``jax.ShapeDtypeStruct``
    opt_state: Any  # the optimizer's pytree of ``jax.ShapeDtypeStruct``
    batch: tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]  # inputs, labels
    mesh: Mesh
    description: str

    @property
    def axis(self) -> str | tuple[str, ...]:
        """The data-parallel axis the step reduces over: every axis of ``mesh``."""
        return _mesh_axis(self.mesh)

    @property
    def num_params(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.params))


def _mesh_axis(mesh: Mesh) -> str | tuple[str, ...]:
    """The mesh's one axis name, or the tuple of its names: what the step reduces over."""
    return mesh.axis_names[0] if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)


def mesh_for(target: str, axis: str | tuple[str, str] = "data") -> Mesh:
    """A mesh over the compile-only devices of ``target`` (``"h100:1x2x4"``,
    ``"v5p:2x2x2:slices=2"``; see `jaxsched.tools.aot.parse_target`): one axis, or with two
    names (``("dcn", "ici")``, ``("hosts", "local")``) the slices (else the hosts) by the
    devices within one.

    Args:
      target: the chip and topology (`jaxsched.tools.aot.parse_target`).
      axis: one axis name, or two: (across slices or hosts, within one).

    Returns:
      The ``Mesh`` over compile-only devices (the ``aot`` extra's toolchains).

    Example:
      >>> from jaxsched.tools import aot
      >>> aot.mesh_for("h100:1x2x4", ("hosts", "local")).shape  # doctest: +SKIP
      OrderedDict([('hosts', 1), ('local', 8)])
    """
    name, topology, slices = aot.parse_target(target)
    devices = np.array(aot.devices(name, topology, slices=slices))
    if isinstance(axis, str):
        return Mesh(devices, (axis,))
    outer = num_slices(devices.flat) if slices > 1 else len({d.process_index for d in devices})
    return Mesh(devices.reshape(outer, -1), tuple(axis))


def abstract_experiment(
    spec: ModelSpec, *, target: str | None = None, mesh: Mesh | None = None, form: str = "shard_map"
) -> AbstractExperiment:
    """The step of ``spec`` on ``mesh`` (or the compile-only mesh of ``target``), abstract;
    ``form="jit"`` writes it as ``jax.jit`` on global arrays (`jaxsched.demo.steps.make_jit_step`)
    rather than as a ``shard_map``.

    Args:
      spec: the model, its size and per-device batch.
      target: a compile-only target (``"h100:1x2x4"``); or
      mesh: a mesh of real or compile-only devices (exactly one of the two).
      form: ``"shard_map"`` or ``"jit"``.

    Returns:
      The `AbstractExperiment`: nothing allocated.

    Raises:
      JaxschedValueError: both or neither of ``target`` and ``mesh``, or an unknown form.

    Example:
      >>> import jax
      >>> from jaxsched.tools import aot
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> spec = aot.ModelSpec("mlp", (8,), 2, {"hidden": (4,)})
      >>> exp = aot.abstract_experiment(spec, mesh=mesh, form="jit")
      >>> exp.num_params, exp.batch[0].shape  # the global batch: 32 examples on each of 2 devices
      (46, (64, 8))
    """
    if (target is None) == (mesh is None):
        raise JaxschedValueError("pass target= (e.g. 'h100:1x2x4') or mesh=, exactly one")
    if form not in ("shard_map", "jit"):
        raise JaxschedValueError(f"form={form!r}; choose 'shard_map' or 'jit'")
    if mesh is None:
        assert target is not None  # exactly one was passed, checked above
        mesh = mesh_for(target)
    axis = _mesh_axis(mesh)
    model = nnx.eval_shape(lambda: models.build(spec.name, spec.input_shape, spec.num_outputs, **spec.options))
    params, apply_fn = models.pure(model)
    tx = steps.make_optimizer(spec.optimizer)
    replicated = NamedSharding(mesh, P())
    as_abstract = lambda tree, sharding: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
    )
    params = as_abstract(params, replicated)
    opt_state = as_abstract(jax.eval_shape(tx.init, params), replicated)
    n = mesh.devices.size
    rows = spec.batch_per_device * n
    sharded = NamedSharding(mesh, P(axis))
    x_dtype = jnp.int32 if spec.name == "transformer" else jnp.float32
    y_shape = (rows,) + ((spec.input_shape[0],) if spec.name == "transformer" else ())
    batch = (
        jax.ShapeDtypeStruct((rows,) + tuple(spec.input_shape), x_dtype, sharding=sharded),
        jax.ShapeDtypeStruct(y_shape, jnp.int32, sharding=sharded),
    )
    size = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    description = (
        f"{spec.name} {size / 1e6:.1f}M params, {spec.batch_per_device} examples per device, {spec.optimizer.name}"
    )
    step = steps.make_jit_step(apply_fn, tx) if form == "jit" else steps.make_step(apply_fn, tx, mesh, axis)
    return AbstractExperiment(step, params, opt_state, batch, mesh, description)


def from_config(cfg: Config, *, target: str) -> AbstractExperiment:
    """A config's model, optimizer and global batch on the compile-only mesh of ``target``
    (the global batch is split over its devices; it must divide evenly).

    Args:
      cfg: a demo config (`jaxsched.demo.config.load`).
      target: the compile-only target, e.g. ``"h100:1x2x4"``.

    Returns:
      The `AbstractExperiment`.

    Raises:
      ConfigError: the global batch does not split over the target's devices.

    Example:
      >>> from jaxsched.demo import config
      >>> from jaxsched.tools import aot
      >>> exp = aot.from_config(config.load("configs/mlp_digits.toml"), target="h100:1x2x4")  # doctest: +SKIP
    """
    from jaxsched.zoo import data as data_lib
    from jaxsched.demo.config import ConfigError

    mesh = mesh_for(target)
    n = mesh.devices.size
    split = data_lib.load(cfg.data.name, seed=cfg.train.seed, **cfg.data.options)
    if cfg.data.batch_size % n:
        raise ConfigError(
            f"{cfg.source}: data.batch_size={cfg.data.batch_size} does not split "
            f"over the {n} devices of {target}; choose a multiple of {n}"
        )
    spec = ModelSpec(
        cfg.model.name,
        tuple(split.train_x.shape[1:]),
        split.num_classes,
        dict(cfg.model.options),
        cfg.data.batch_size // n,
        cfg.optimizer,
    )
    return abstract_experiment(spec, mesh=mesh)
