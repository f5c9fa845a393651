"""Experiment configs: one TOML file per experiment, validated before anything runs.

A config has four tables; every key is optional except ``model.name`` and ``data.name``::

    [model]      name = "mlp"            # plus the model's own options, e.g. hidden = [64]
    [data]       name = "digits"         # digits | synthetic_images | synthetic_tokens | synthetic_cifar
                 batch_size = 128        # global batch, split over the devices
    [optimizer]  name = "adam"           # sgd | momentum | adam | adamw
                 learning_rate = 1e-3    # clip_norm = 1.0 chains clip_by_global_norm first
    [train]      steps = 300, devices = 8, api = "jit", strategies = ["allreduce"]

Example:
    >>> from jaxsched.demo.config import parse
    >>> parse({"model": {"name": "mlp"}, "data": {"name": "digits"}}).train.devices
    8
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path
from typing import Any, Mapping

from jaxsched._errors import JaxschedError
from jaxsched.zoo import data as data_lib
from jaxsched.zoo import models as models_lib

__all__ = [
    "APIS",
    "check_strategies",
    "Config",
    "ConfigError",
    "data_options",
    "DataConfig",
    "known_strategies",
    "load",
    "model_options",
    "ModelConfig",
    "OptimizerConfig",
    "OPTIMIZERS",
    "parse",
    "TrainConfig",
]


class ConfigError(JaxschedError, ValueError):
    """A config value is missing or wrong; the message names the field.

    Example:
        >>> try:
        ...     parse({"model": {"name": "mlp"}, "data": {"name": "digits", "batch_size": 0}})
        ... except ConfigError as error:
        ...     print(error)
        <dict>: data.batch_size must be positive, got 0
    """


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
APIS = ("jit", "shard_map", "pmap")


def known_strategies() -> tuple[str, ...]:
    """Strategy names a training run accepts: the scheduler's registry (one place to rewire)."""
    from jaxsched._schedule import STRATEGIES

    return tuple(STRATEGIES)


def check_strategies(names: list[str] | tuple[str, ...], field: str) -> tuple[str, ...]:
    """``names`` unchanged if every one is a known strategy; else an error naming ``field``,
    the bad value and the choices."""
    choices = known_strategies()
    if not names:
        raise ConfigError(f"{field} is empty; choose from {', '.join(choices)}")
    for name in names:
        if name not in choices:
            raise ConfigError(f"{field}: {name!r} is unknown; choose from {', '.join(choices)}")
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str
    batch_size: int = 128
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"
    learning_rate: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 1e-4
    clip_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    devices: int = 8
    api: str = "jit"
    strategies: tuple[str, ...] = ("allreduce",)
    seed: int = 0
    log_every: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole experiment, as `parse` or `load` validate it.

    Attributes:
      model: the model's name and options.
      data: the data set's name, global batch size and options.
      optimizer: the optax optimizer's name and hyperparameters.
      train: steps, devices, step API, strategies, seed and logging.
      source: the file it came from, for messages.

    Example:
        >>> cfg = parse({"model": {"name": "mlp", "hidden": [16]}, "data": {"name": "digits"}})
        >>> cfg.model.options, cfg.data.batch_size, cfg.train.strategies
        ({'hidden': [16]}, 128, ('allreduce',))
    """

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    source: str = "<dict>"


def _table(raw: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: [{name}] must be a table, got {type(value).__name__}")
    return dict(value)


def _take(
    table: dict[str, Any], field: str, kind: type | tuple[type, ...], where: str, default: Any = dataclasses.MISSING
) -> Any:
    if field not in table:
        if default is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required field '{field}'")
        return default
    value = table.pop(field)
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{where}: field '{field}' must be {kind}, got {value!r}")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: field '{field}' must be {names}, got {value!r}")
    return value


def _no_leftovers(table: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    if table:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(table))}; known fields: {', '.join(known)}")


def _keyword_options(fn: Any, exclude: tuple[str, ...]) -> tuple[str, ...]:
    """The optional keyword parameters of ``fn``: what a config table may set for it."""
    return tuple(
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in exclude
    )


def model_options(name: str) -> tuple[str, ...]:
    """Fields ``[model]`` accepts besides ``name`` for zoo model ``name``."""
    classes = {"mlp": models_lib.MLP, "cnn": models_lib.CNN, "transformer": models_lib.TransformerLM}
    return _keyword_options(classes[name].__init__, ("rngs",))  # type: ignore[misc]


def data_options(name: str) -> tuple[str, ...]:
    """Fields ``[data]`` accepts besides ``name`` and ``batch_size`` for data set ``name``."""
    loaders = {
        "digits": data_lib.load_digits,
        "synthetic_images": data_lib.synthetic_images,
        "synthetic_tokens": data_lib.synthetic_tokens,
        "synthetic_cifar": data_lib.synthetic_cifar,
    }
    return _keyword_options(loaders[name], ("seed",))


def parse(raw: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Validate a config mapping; every error names the offending field."""
    unknown = set(raw) - {"model", "data", "optimizer", "train"}
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(sorted(unknown))}; expected model, data, optimizer, train"
        )

    model_t = _table(raw, "model", source)
    model_name = _take(model_t, "name", str, f"{source}: model")
    if model_name not in models_lib.MODELS:
        raise ConfigError(
            f"{source}: model.name={model_name!r} is unknown; choose one of {', '.join(models_lib.MODELS)}"
        )
    known = model_options(model_name)
    _no_leftovers({k: v for k, v in model_t.items() if k not in known}, f"{source}: model", ("name", *known))
    model = ModelConfig(model_name, model_t)

    data_t = _table(raw, "data", source)
    data_name = _take(data_t, "name", str, f"{source}: data")
    if data_name not in data_lib.DATASETS:
        raise ConfigError(f"{source}: data.name={data_name!r} is unknown; choose one of {', '.join(data_lib.DATASETS)}")
    batch_size = _take(data_t, "batch_size", int, f"{source}: data", 128)
    if batch_size <= 0:
        raise ConfigError(f"{source}: data.batch_size must be positive, got {batch_size}")
    known = data_options(data_name)
    _no_leftovers(
        {k: v for k, v in data_t.items() if k not in known}, f"{source}: data", ("name", "batch_size", *known)
    )
    data = DataConfig(data_name, batch_size, data_t)

    opt_t = _table(raw, "optimizer", source)
    where = f"{source}: optimizer"
    optimizer = OptimizerConfig(
        name=_take(opt_t, "name", str, where, "adam"),
        learning_rate=float(_take(opt_t, "learning_rate", (int, float), where, 1e-3)),
        momentum=float(_take(opt_t, "momentum", (int, float), where, 0.9)),
        weight_decay=float(_take(opt_t, "weight_decay", (int, float), where, 1e-4)),
        clip_norm=_take(opt_t, "clip_norm", (int, float), where, None),
    )
    _no_leftovers(opt_t, where, tuple(f.name for f in dataclasses.fields(OptimizerConfig)))
    if optimizer.name not in OPTIMIZERS:
        raise ConfigError(
            f"{source}: optimizer.name={optimizer.name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}"
        )

    train_t = _table(raw, "train", source)
    where = f"{source}: train"
    strategies = _take(train_t, "strategies", list, where, ["allreduce"])
    if not strategies or not all(isinstance(s, str) for s in strategies):
        raise ConfigError(f"{source}: train.strategies must be a non-empty list of names")
    check_strategies(strategies, f"{source}: train.strategies")
    train = TrainConfig(
        steps=_take(train_t, "steps", int, where, 300),
        devices=_take(train_t, "devices", int, where, 8),
        api=_take(train_t, "api", str, where, "jit"),
        strategies=tuple(strategies),
        seed=_take(train_t, "seed", int, where, 0),
        log_every=_take(train_t, "log_every", int, where, 1),
    )
    _no_leftovers(train_t, where, tuple(f.name for f in dataclasses.fields(TrainConfig)))
    if train.steps <= 0:
        raise ConfigError(f"{source}: train.steps must be positive, got {train.steps}")
    if train.devices <= 0:
        raise ConfigError(f"{source}: train.devices must be positive, got {train.devices}")
    if train.api not in APIS:
        raise ConfigError(f"{source}: train.api={train.api!r} is unknown; choose one of {', '.join(APIS)}")
    if batch_size % train.devices:
        raise ConfigError(
            f"{source}: data.batch_size={batch_size} is not divisible by "
            f"train.devices={train.devices}; pick a multiple of {train.devices}"
        )
    return Config(model, data, optimizer, train, source)


def load(path: str | Path) -> Config:
    """Read and validate a TOML config. ``configs/mlp`` also finds ``configs/mlp.toml``."""
    path = Path(path)
    if not path.exists() and path.suffix != ".toml" and path.with_suffix(".toml").exists():
        path = path.with_suffix(".toml")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse(raw, source=str(path))
