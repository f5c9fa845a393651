"""Cost model inputs: per-layer compute profiles and alpha-beta collective costs.

Scheduling decisions need numbers. A [`LayerProfile`][jaxsched.sim._costmodel.LayerProfile] says how long each layer's
forward and backward take and how many gradient bytes it produces; a
[`NetworkProfile`][jaxsched.sim._costmodel.NetworkProfile] says how long one collective of ``B`` bytes takes on a given
number of workers, as ``alpha_s + beta_s_per_byte * B`` (``B`` is the full, unsharded
tensor size). Both load from and save to JSON so users can simulate their own
measurements. This module imports nothing else from jaxsched (lowest layer).

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> layers = LayerProfile([Layer("fc", params=1000, bytes=4000, forward_s=1e-3,
    ...                              backward_s=2e-3)])
    >>> net = network_preset("10gbe", workers=8)
    >>> round(net.time("all_reduce", 4000) * 1e6, 1)  # microseconds
    355.6
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxsched._errors import JaxschedError, JaxschedTypeError, JaxschedValueError

__all__ = [
    "ALLREDUCE_PATTERN",
    "BUILTIN_PATTERNS",
    "DILOCO_PATTERN",
    "APPROX_PATTERN",
    "CollectiveCost",
    "COLLECTIVES",
    "comm_pattern",
    "comm_pattern_names",
    "CommPattern",
    "DEAR_PATTERN",
    "device_preset",
    "DEVICE_PRESETS",
    "DevicePreset",
    "FSDP_PATTERN",
    "fsdp_pattern",
    "KFAC_PATTERN",
    "Layer",
    "LayerProfile",
    "LINK_PRESETS",
    "LinkPreset",
    "network_preset",
    "NetworkProfile",
    "ProfileError",
    "register_comm_pattern",
    "REQUIRED_COLLECTIVES",
    "ring_costs",
    "roofline_seconds",
    "SELECTION_PASSES",
    "topk_selection_s_per_byte",
    "two_level_network",
    "unregister_comm_pattern",
    "WFBP_PATTERN",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "ppermute", "all_to_all")
REQUIRED_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


class ProfileError(JaxschedError, ValueError):
    """A profile (file or dict) is malformed; the message names the file and field.

    Example:
        >>> LayerProfile.from_dict({"layers": []}, "layers.json")
        Traceback (most recent call last):
        ...
        jaxsched.sim._costmodel.ProfileError: layers.json: 'layers' must be a non-empty list
    """


@dataclasses.dataclass(frozen=True)
class Layer:
    """One parameter group, in forward order, as the simulator and the planners see it.

    The second-order fields are zero for first-order strategies and read by patterns with
    ``factors`` (K-FAC).

    Args:
      name: the group's name (a parameter path).
      params: its number of parameters.
      bytes: its gradient's bytes.
      forward_s: its forward time, seconds.
      backward_s: its backward time; its gradient is ready when this ends.
      update_s: its optimizer-update time.
      factor_bytes: the bytes of its Kronecker factors.
      factor_s: the time to compute them after its backward.
      factor_dims: each factor's size ``n``.
      inverse_s: the time to invert each factor on one worker (one entry per factor).

    Example:
        >>> layer = Layer("dense", params=1024, bytes=4096, forward_s=1e-4, backward_s=2e-4)
        >>> layer.bytes, layer.update_s
        (4096, 0.0)
    """

    name: str
    params: int
    bytes: int
    forward_s: float
    backward_s: float
    update_s: float = 0.0
    factor_bytes: int = 0
    factor_s: float = 0.0
    factor_dims: tuple[int, ...] = ()
    inverse_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor_dims", tuple(self.factor_dims))
        object.__setattr__(self, "inverse_s", tuple(self.inverse_s))
        if len(self.factor_dims) != len(self.inverse_s):
            raise ProfileError(
                f"layer {self.name!r}: factor_dims {list(self.factor_dims)} and inverse_s "
                f"{list(self.inverse_s)} must have one entry per factor"
            )


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Layers in forward order; the gradient of layer ``i`` is ready when its backward ends.

    Measure one with [`profile_zoo_model`][jaxsched.plan._profiling.profile_zoo_model], build
    one from `jaxsched.sim._zoo_profiles`, or write it as JSON (`load`, `from_dict`).

    Args:
      layers: the layers, in forward order (at least one).
      meta: free-form notes (how it was measured) kept in its JSON.

    Example:
        >>> profile = LayerProfile([Layer("a", 10, 40, 1e-4, 2e-4), Layer("b", 20, 80, 1e-4, 2e-4)])
        >>> len(profile), profile.total_bytes, profile.backward_s
        (2, 120, 0.0004)
        >>> LayerProfile.from_dict(profile.to_dict()) == profile
        True
    """

    layers: Sequence[Layer]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ProfileError("layer profile has no layers; give at least one")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def update_s(self) -> float:
        return sum(layer.update_s for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def total_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        second_order = ("factor_bytes", "factor_s", "factor_dims", "inverse_s")
        return {
            "layers": [
                {k: v for k, v in dataclasses.asdict(layer).items() if k not in second_order or v}
                for layer in self.layers
            ],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "LayerProfile":
        """Validate and build a profile from its JSON form (`to_dict`).

        Args:
          data: the parsed JSON: ``{"layers": [...], "meta": {...}}``.
          source: where ``data`` came from, named in errors.

        Returns:
          The profile.

        Raises:
          ProfileError: a field is missing or of the wrong type; the message names
            ``source`` and the field.

        Example:
            >>> LayerProfile.from_dict({"layers": [{"name": "a", "params": 1, "bytes": 4,
            ...                                     "forward_s": 1e-4, "backward_s": 2e-4}]}).total_params
            1
        """
        if not isinstance(data, Mapping) or "layers" not in data:
            raise ProfileError(f"{source}: layer profile needs a top-level 'layers' list")
        raw_layers = data["layers"]
        if not isinstance(raw_layers, list) or not raw_layers:
            raise ProfileError(f"{source}: 'layers' must be a non-empty list")
        layers = []
        for i, raw in enumerate(raw_layers):
            where = f"{source}: layers[{i}]"
            if not isinstance(raw, Mapping):
                raise ProfileError(f"{where} must be an object with name, params, bytes, forward_s, backward_s")
            layers.append(
                Layer(
                    name=_field(raw, "name", str, where),
                    params=_field(raw, "params", int, where),
                    bytes=_field(raw, "bytes", int, where),
                    forward_s=_field(raw, "forward_s", float, where),
                    backward_s=_field(raw, "backward_s", float, where),
                    update_s=_field(raw, "update_s", float, where, default=0.0),
                    factor_bytes=_field(raw, "factor_bytes", int, where, default=0),
                    factor_s=_field(raw, "factor_s", float, where, default=0.0),
                    factor_dims=tuple(int(n) for n in raw.get("factor_dims", ())),
                    inverse_s=tuple(float(t) for t in raw.get("inverse_s", ())),
                )
            )
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise ProfileError(f"{source}: 'meta' must be an object")
        return cls(layers, dict(meta))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "LayerProfile":
        return cls.from_dict(_read_json(path), str(path))


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """``time(B) = alpha_s + beta_s_per_byte * B`` for a collective of ``B`` full-tensor bytes.

    Args:
      alpha_s: the fixed cost of one collective, seconds.
      beta_s_per_byte: the cost of each full-tensor byte.

    Example:
        >>> cost = CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9)
        >>> round(cost.time(1e6), 6), cost.time(0)  # an empty bucket sends nothing
        (0.00101, 0)
    """

    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: float) -> float:
        # An empty bucket issues no collective at all, so it costs nothing.
        return 0 if nbytes <= 0 else self.alpha_s + self.beta_s_per_byte * nbytes


@dataclasses.dataclass(frozen=True)
class NetworkProfile:
    """Alpha-beta cost per collective type, for a fixed number of workers.

    Two optional fixed costs of running a step on these workers (both default 0, and
    JSON files without them load unchanged):

    * ``dispatch_s``: launching one step program on every worker and waiting for it
      (Python/jit dispatch, start-up of the program on each device). The simulator adds it
      once per iteration. A measured layer profile takes it out of the whole-model forward
      (timed as its own program), so it is counted once.
    * ``copy_s_per_byte``: packing one byte of gradient into a bucket buffer (flatten,
      pad, concatenate), and the same again to unpack it. The simulator charges it on the
      compute stream before and after every bucketed collective of ``wfbp``, ``mgwfbp`` and
      ``dear`` (the strategies whose rewrite builds bucket buffers).

    Measure one with [`profile_network`][jaxsched.plan._profiling.profile_network], take a
    preset ([`network_preset`][jaxsched.sim._costmodel.network_preset]) or write it as JSON.

    Args:
      workers: the number of workers the costs are for.
      collectives: per collective name (`COLLECTIVES`; ``all_reduce``, ``reduce_scatter``
        and ``all_gather`` are required by the simulator), its `CollectiveCost`.
      meta: free-form notes kept in its JSON.
      dispatch_s: see above.
      copy_s_per_byte: see above.

    Example:
        >>> cost = CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9)
        >>> network = NetworkProfile(4, {"all_reduce": cost, "reduce_scatter": cost, "all_gather": cost})
        >>> round(network.time("all_reduce", 1e6), 6)
        0.00101
    """

    workers: int
    collectives: Mapping[str, CollectiveCost]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dispatch_s: float = 0.0
    copy_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ProfileError(f"network profile 'workers'={self.workers!r} must be an int >= 1")

    def cost(self, collective: str) -> CollectiveCost:
        try:
            return self.collectives[collective]
        except KeyError:
            raise ProfileError(
                f"network profile has no {collective!r} cost (it has "
                f"{', '.join(sorted(self.collectives))}); add it to the JSON "
                f"'collectives' object or use a preset"
            ) from None

    def time(self, collective: str, nbytes: float) -> float:
        return self.cost(collective).time(nbytes)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "workers": self.workers,
            "collectives": {k: dataclasses.asdict(v) for k, v in self.collectives.items()},
            "meta": dict(self.meta),
        }
        if self.dispatch_s:
            data["dispatch_s"] = self.dispatch_s
        if self.copy_s_per_byte:
            data["copy_s_per_byte"] = self.copy_s_per_byte
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "NetworkProfile":
        if not isinstance(data, Mapping):
            raise ProfileError(f"{source}: network profile must be a JSON object")
        workers = _field(data, "workers", int, source)
        raw = data.get("collectives")
        if not isinstance(raw, Mapping):
            raise ProfileError(f"{source}: network profile needs a 'collectives' object")
        collectives = {}
        for name, cost in raw.items():
            where = f"{source}: collectives.{name}"
            if name not in COLLECTIVES:
                raise ProfileError(f"{where}: unknown collective; use one of {', '.join(COLLECTIVES)}")
            if not isinstance(cost, Mapping):
                raise ProfileError(f"{where} must be an object with alpha_s and beta_s_per_byte")
            collectives[name] = CollectiveCost(
                _field(cost, "alpha_s", float, where), _field(cost, "beta_s_per_byte", float, where)
            )
        for name in REQUIRED_COLLECTIVES:
            if name not in collectives:
                raise ProfileError(
                    f"{source}: collectives.{name} is missing; the simulator needs {', '.join(REQUIRED_COLLECTIVES)}"
                )
        meta = data.get("meta", {})
        return cls(
            workers,
            collectives,
            dict(meta) if isinstance(meta, Mapping) else {},
            dispatch_s=_field(data, "dispatch_s", float, source, default=0.0),
            copy_s_per_byte=_field(data, "copy_s_per_byte", float, source, default=0.0),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "NetworkProfile":
        return cls.from_dict(_read_json(path), str(path))


def _read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path}: not valid JSON ({err})") from None


def _field(raw: Mapping, key: str, kind: type, where: str, default: Any = None) -> Any:
    """Read ``raw[key]`` as ``kind``; times and sizes must be finite and non-negative."""
    if key not in raw:
        if default is not None:
            return default
        raise ProfileError(f"{where}: field {key!r} is missing")
    value = raw[key]
    ok = (
        isinstance(value, str)
        if kind is str
        else isinstance(value, int) and not isinstance(value, bool)
        if kind is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok:
        raise ProfileError(f"{where}: field {key!r}={value!r} must be {kind.__name__}")
    if kind is not str and (not math.isfinite(value) or value < 0):
        raise ProfileError(f"{where}: field {key!r}={value!r} must be finite and >= 0")
    return float(value) if kind is float else value


# --------------------------------------------------------------------------- patterns
@dataclasses.dataclass(frozen=True)
class CommPattern:
    """What a strategy sends per bucket, and when: the one description that the
    planners and the simulator read (each strategy owns its own instance).

    Attributes:
      gradient: the collective of a bucket's gradients (``all_reduce`` or
        ``reduce_scatter``).
      parameters: the collective of a bucket's updated parameters, which the next
        forward waits for (``all_gather`` for DeAR), or None. With it, the update runs
        on each worker's 1/P shard of the bucket.
      in_backward: the gradient collective is issued as soon as the bucket's gradients
        exist; False: after the whole backward (the plain step).
      delayed_update: the update applies the previous step's reduced gradients, so the
        next step never waits for communication (approximated parameters).
      packs_buckets: the rewrite copies each bucket into one buffer and back.
      compressible: whether the simulator models compression of the gradient collective.
      factors: the collective of second-order statistics (K-FAC's Kronecker factors), sent
        per layer (``all_reduce``), or None. The simulator reads each layer's
        ``factor_bytes``, ``factor_s`` and ``inverse_s``.
      factors_in_backward: each layer's factor collective is issued in backward as soon as
        its factors exist; False: after the whole backward.
      inverse_placement: how the factor inversions are spread over the workers
        (``balanced``, ``round_robin``, ``naive``; see `jaxsched.sim._kfac_placement`); their
        results are shared by one all-gather (none for ``naive``).
      periodic_sync: the gradient collective crosses only the fast axes, and the slow ones
        are synchronized every few steps (DiLoCo): the per-step simulator does not model
        that, `jaxsched.sim._diloco` does.
      gathers_ahead: FSDP: the parameters are kept as shards, and each layer's are
        all-gathered before its forward and again before its backward, issued this many
        layers ahead (the prefetch distance; at most ``gathers_ahead + 1`` gathered layers
        alive). The gradient collective (``reduce_scatter``) leaves each worker its shard and
        the update runs on it. None: the parameters are replicated.

    Example:
        >>> network = network_preset("10gbe", 4)
        >>> dear = comm_pattern("dear")
        >>> dear.collectives(), round(dear.startup_seconds(network), 6)
        (('reduce_scatter', 'all_gather'), 0.00015)
        >>> CommPattern(gradient="all_reduce", in_backward=False).collectives()
        ('all_reduce',)
    """

    gradient: str = "all_reduce"
    parameters: str | None = None
    in_backward: bool = True
    delayed_update: bool = False
    packs_buckets: bool = True
    compressible: bool = True
    factors: str | None = None
    factors_in_backward: bool = True
    inverse_placement: str | None = None
    periodic_sync: bool = False
    gathers_ahead: int | None = None

    def __post_init__(self) -> None:
        for name in (self.gradient, self.parameters, self.factors):
            if name is not None and name not in COLLECTIVES:
                raise JaxschedValueError(
                    f"CommPattern collective {name!r} is unknown; use one of {', '.join(COLLECTIVES)}"
                )
        if self.gathers_ahead is not None and (not isinstance(self.gathers_ahead, int) or self.gathers_ahead < 0):
            raise JaxschedValueError(f"CommPattern gathers_ahead={self.gathers_ahead!r} must be an int >= 0 (or None)")
        if self.inverse_placement not in (None, "balanced", "round_robin", "naive"):
            raise JaxschedValueError(
                f"CommPattern inverse_placement={self.inverse_placement!r} is unknown; "
                "use balanced, round_robin or naive"
            )

    @property
    def sharded_update(self) -> bool:
        return self.parameters is not None or self.gathers_ahead is not None

    def collectives(self) -> tuple[str, ...]:
        """Every collective one bucket costs, in issue order.

        Returns:
          The gradient collective, then the parameters' collective if any.

        Example:
            >>> comm_pattern("dear").collectives()
            ('reduce_scatter', 'all_gather')
        """
        return (self.gradient,) + ((self.parameters,) if self.parameters else ())

    def bucket_seconds(self, network: "NetworkProfile", nbytes: float) -> float:
        """Communication time of one bucket of ``nbytes`` gradient bytes.

        Args:
          network: the network profile.
          nbytes: the bucket's gradient bytes.

        Returns:
          Seconds, summed over `collectives`.

        Example:
            >>> round(comm_pattern("wfbp").bucket_seconds(network_preset("10gbe", 4), 1e6), 6)
            0.00135
        """
        return sum(network.time(c, nbytes) for c in self.collectives())

    def startup_seconds(self, network: "NetworkProfile") -> float:
        """Per-bucket start-up cost (alpha) that merging two buckets saves.

        Args:
          network: the network profile.

        Returns:
          Seconds, the alphas of `collectives` summed.

        Example:
            >>> round(comm_pattern("wfbp").startup_seconds(network_preset("10gbe", 4)), 6)
            0.00015
        """
        return sum(network.cost(c).alpha_s for c in self.collectives())


def register_comm_pattern(name: str, pattern: CommPattern) -> None:
    """Make ``name`` known to the planners and the simulator.

    Registering the same pattern again is a no-op; a different pattern under a taken
    name is refused, so two strategies cannot silently share a name.
    [`register_strategy`][jaxsched.strategies.register_strategy] calls it with the
    strategy's ``cost``.

    Args:
      name: the strategy name the planners and the simulator will take.
      pattern: its `CommPattern`.

    Raises:
      JaxschedValueError: a different pattern is registered under ``name``.

    Example:
        >>> register_comm_pattern("my-wfbp", CommPattern())
        >>> comm_pattern("my-wfbp") == WFBP_PATTERN
        True
        >>> unregister_comm_pattern("my-wfbp")
    """
    if not isinstance(pattern, CommPattern):
        raise JaxschedTypeError(f"register_comm_pattern({name!r}) needs a CommPattern, got {type(pattern).__name__}")
    if _COMM_PATTERNS.get(name, pattern) != pattern:
        raise JaxschedValueError(f"a different communication pattern is already registered as {name!r}")
    _COMM_PATTERNS[name] = pattern


def unregister_comm_pattern(name: str) -> None:
    """Forget a registered pattern; a built-in strategy's name keeps its built-in pattern.

    Args:
      name: the strategy name (an unknown name is ignored).

    Example:
        >>> register_comm_pattern("tmp", CommPattern(in_backward=False))
        >>> unregister_comm_pattern("tmp")
        >>> "tmp" in comm_pattern_names()
        False
    """
    if name in BUILTIN_PATTERNS:
        _COMM_PATTERNS[name] = BUILTIN_PATTERNS[name]
    else:
        _COMM_PATTERNS.pop(name, None)


def comm_pattern(name: "str | CommPattern") -> CommPattern:
    """The registered pattern of strategy ``name`` (a pattern passes through).

    Args:
      name: a strategy name, or a `CommPattern`.

    Returns:
      The `CommPattern`.

    Raises:
      JaxschedValueError: no pattern is registered under ``name``.

    Example:
        >>> comm_pattern("dear").parameters, comm_pattern("allreduce").in_backward
        ('all_gather', False)
    """
    if isinstance(name, CommPattern):
        return name
    try:
        return _COMM_PATTERNS[name]
    except KeyError:
        raise JaxschedValueError(
            f"no communication pattern is registered for strategy {name!r}; known: {', '.join(_COMM_PATTERNS)}"
        ) from None


def comm_pattern_names() -> tuple[str, ...]:
    return tuple(_COMM_PATTERNS)


# Patterns the planners and the simulator know even where no transform strategy
# implements them (each transform strategy registers its own, identical, pattern).
ALLREDUCE_PATTERN = CommPattern(in_backward=False, packs_buckets=False)
WFBP_PATTERN = CommPattern()
DEAR_PATTERN = CommPattern(gradient="reduce_scatter", parameters="all_gather", compressible=False)
APPROX_PATTERN = CommPattern(delayed_update=True, packs_buckets=False)
KFAC_PATTERN = CommPattern(compressible=False, factors="all_reduce", inverse_placement="balanced")
#: FSDP (ZeRO-3): each layer gathered one layer ahead in forward and in backward, each
#: bucket's gradients reduce-scattered in backward, the update on shards.
FSDP_PATTERN = CommPattern(gradient="reduce_scatter", gathers_ahead=1, packs_buckets=False, compressible=False)
#: DiLoCo: inner steps without communication, an outer all-reduce every few steps.
DILOCO_PATTERN = CommPattern(gradient="all_reduce", in_backward=True, periodic_sync=True)

#: Every built-in strategy's pattern, known without importing the strategies (the command
#: line simulates ``diloco`` without loading JAX); a registered strategy adds its own.
BUILTIN_PATTERNS: Mapping[str, CommPattern] = types.MappingProxyType(
    {
        "allreduce": ALLREDUCE_PATTERN,
        "wfbp": WFBP_PATTERN,
        "mgwfbp": WFBP_PATTERN,
        "dear": DEAR_PATTERN,
        "approx": APPROX_PATTERN,
        "kfac": KFAC_PATTERN,
        "diloco": DILOCO_PATTERN,
        "fsdp": FSDP_PATTERN,
    }
)
_COMM_PATTERNS: dict[str, CommPattern] = dict(BUILTIN_PATTERNS)


def fsdp_pattern(pattern: CommPattern, gathers_ahead: int = 1) -> CommPattern:
    """What ``pattern`` sends on a step whose parameters are sharded over the data axes (FSDP):
    its gradients reduce-scattered into the shards, each layer gathered ``gathers_ahead``
    layers ahead of its forward and its backward.

    Args:
      pattern: the strategy's pattern with replicated parameters.
      gathers_ahead: the prefetch distance, in layers.

    Returns:
      The FSDP variant of ``pattern``.

    Example:
        >>> fsdp = fsdp_pattern(comm_pattern("wfbp"))
        >>> fsdp.collectives(), fsdp.gathers_ahead
        (('reduce_scatter',), 1)
    """
    return dataclasses.replace(
        pattern, gradient="reduce_scatter", parameters=None, gathers_ahead=gathers_ahead, compressible=False
    )


# --------------------------------------------------------------------------- presets
@dataclasses.dataclass(frozen=True)
class LinkPreset:
    """A point-to-point link: per-message latency and per-direction bandwidth.

    Args:
      name: the preset's name (a key of `LINK_PRESETS`).
      latency_s: seconds per message.
      bandwidth_bytes_per_s: bytes per second in each direction.
      source: where the numbers come from.

    Example:
        >>> link = LINK_PRESETS["10gbe"]
        >>> link.bandwidth_bytes_per_s, link.latency_s
        (1250000000.0, 2.5e-05)
    """

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    source: str


# Bandwidths are the line rates of the standards; latencies are typical per-message
# software+wire latencies (order of magnitude, our assumption; measure yours with
# `jaxsched.plan._profiling.profile_network`).
LINK_PRESETS: dict[str, LinkPreset] = {
    # IEEE 802.3ab 1000BASE-T: 1 Gbit/s. TCP latency ~50 us (assumed).
    "1gbe": LinkPreset("1gbe", 50e-6, 1e9 / 8, "IEEE 802.3ab (1 Gbit/s)"),
    # IEEE 802.3ae 10GBASE: 10 Gbit/s. TCP latency ~25 us (assumed).
    "10gbe": LinkPreset("10gbe", 25e-6, 10e9 / 8, "IEEE 802.3ae (10 Gbit/s)"),
    # IEEE 802.3by 25GBASE: 25 Gbit/s. ~10 us (assumed, RoCE/TCP).
    "25gbe": LinkPreset("25gbe", 10e-6, 25e9 / 8, "IEEE 802.3by (25 Gbit/s)"),
    # InfiniBand EDR 4x: 100 Gbit/s (IBTA spec); ~1.5 us MPI-level latency (assumed).
    "100gbib": LinkPreset("100gbib", 1.5e-6, 100e9 / 8, "InfiniBand EDR 4x (IBTA, 100 Gbit/s)"),
    # NVLink 2.0 on V100 SXM2: 6 links x 25 GB/s per direction = 150 GB/s per direction
    # (NVIDIA Tesla V100 datasheet, "300 GB/s" bidirectional); ~5 us per NCCL step (assumed).
    # Only meaningful within one NVLink domain (8-16 GPUs).
    "nvlink": LinkPreset("nvlink", 5e-6, 150e9, "NVIDIA Tesla V100 datasheet (NVLink 300 GB/s bidir)"),
    # NVLink 4 on H100 SXM5: 900 GB/s bidirectional per GPU = 450 GB/s per direction (NVIDIA
    # H100 datasheet); ~5 us per NCCL step (assumed). One node's level of a two-level network.
    "nvlink4": LinkPreset("nvlink4", 5e-6, 450e9, "NVIDIA H100 SXM datasheet (NVLink 900 GB/s bidir)"),
    # InfiniBand NDR 4x: 400 Gbit/s (IBTA spec), one NIC per GPU as in DGX H100 (8 x 400G);
    # ~2 us MPI-level latency (assumed).
    "400gbib": LinkPreset("400gbib", 2e-6, 400e9 / 8, "InfiniBand NDR 4x (IBTA, 400 Gbit/s)"),
    # TPU v5p inter-chip interconnect: 4800 Gbit/s per chip (Google Cloud TPU v5p docs), taken
    # as 300 GB/s per direction; ~2 us per step (assumed).
    "ici": LinkPreset("ici", 2e-6, 4800e9 / 8 / 2, "cloud.google.com/tpu/docs/v5p (ICI 4800 Gbps/chip)"),
    # Data-center network between TPU slices: 100 Gbit/s per chip's share of its host's NICs
    # and ~20 us per message (both assumed: Google publishes no per-chip DCN figure).
    "dcn": LinkPreset("dcn", 20e-6, 100e9 / 8, "assumed (no published per-chip DCN figure)"),
}


def ring_costs(link: LinkPreset, workers: int) -> dict[str, CollectiveCost]:
    """Ring-algorithm alpha-beta costs (Thakur et al., 2005; Patarasuk & Yuan, 2009).

    With ``P`` workers, latency ``a`` and bandwidth ``bw``: all-reduce moves
    ``2(P-1)/P`` of the tensor in ``2(P-1)`` steps; reduce-scatter and all-gather each
    ``(P-1)/P`` in ``P-1`` steps; ppermute is one point-to-point message. One worker
    needs no communication (all costs zero).

    Args:
      link: the link preset.
      workers: the number of workers ``P``.

    Returns:
      A `CollectiveCost` per collective of `COLLECTIVES`.

    Example:
        >>> ring_costs(LINK_PRESETS["10gbe"], 4)["all_reduce"]
        CollectiveCost(alpha_s=0.00015000000000000001, beta_s_per_byte=1.2e-09)
    """
    p, a, inv_bw = workers, link.latency_s, 1.0 / link.bandwidth_bytes_per_s
    if p == 1:
        zero = CollectiveCost(0.0, 0.0)
        return {name: zero for name in COLLECTIVES}
    half = CollectiveCost((p - 1) * a, (p - 1) / p * inv_bw)
    return {
        "all_reduce": CollectiveCost(2 * (p - 1) * a, 2 * (p - 1) / p * inv_bw),
        "reduce_scatter": half,
        "all_gather": half,
        "all_to_all": half,
        "ppermute": CollectiveCost(a, inv_bw),
    }


def _link(name: str) -> LinkPreset:
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise ProfileError(
            f"unknown network preset {name!r}; choose one of "
            f"{', '.join(LINK_PRESETS)}, a two-level 'fast+slow' pair of them "
            "(e.g. nvlink4+400gbib, ici+dcn), or pass a measured "
            "--network-profile"
        ) from None


def network_preset(name: str, workers: int, per_node: int | None = None, hierarchical: bool = True) -> NetworkProfile:
    """A ring-algorithm network profile for a named link preset and worker count.

    Args:
      name: a link preset (a key of `LINK_PRESETS`: ``"10gbe"``, ``"nvlink4"``, ...), or
        ``"fast+slow"`` (``"nvlink4+400gbib"``, ``"ici+dcn"``): a two-level network of
        ``workers // per_node`` nodes of ``per_node`` devices each (`two_level_network`).
      workers: the number of workers.
      per_node: devices per node; required by a two-level name, and must divide ``workers``.
      hierarchical: for a two-level name, whether collectives run hierarchically (within
        nodes, then across) rather than as one flat ring over the slow links.

    Returns:
      The `NetworkProfile`.

    Raises:
      ProfileError: an unknown preset, or a two-level name without a fitting ``per_node``.

    Example:
        >>> network_preset("10gbe", 4).meta["algorithm"]
        'ring'
        >>> network_preset("nvlink4+400gbib", 64, per_node=8).meta["levels"]
        {'fast': 'nvlink4', 'slow': '400gbib', 'nodes': 8, 'per_node': 8}
    """
    if workers < 1:
        raise ProfileError(f"workers={workers} must be >= 1")
    if "+" in name:
        fast, _, slow = name.partition("+")
        if per_node is None or per_node < 1 or workers % per_node:
            raise ProfileError(
                f"the two-level network {name!r} needs per_node (devices per "
                f"node, --per-node) dividing workers={workers}; got {per_node!r}"
            )
        return two_level_network(fast, slow, workers // per_node, per_node, hierarchical)
    link = _link(name)
    return NetworkProfile(
        workers, ring_costs(link, workers), {"preset": name, "source": link.source, "algorithm": "ring"}
    )


def two_level_network(fast: str, slow: str, nodes: int, per_node: int, hierarchical: bool = True) -> NetworkProfile:
    """``nodes`` x ``per_node`` devices: ``fast`` links within a node (NVLink, ICI), ``slow``
    links between nodes (InfiniBand, Ethernet, DCN), one slow link per device (rails).

    With ``hierarchical`` (what `jaxsched.runtime.collectives.Hierarchical` runs), with
    ``F = per_node`` and ``S = nodes``:

    * all-reduce of ``B`` bytes = reduce-scatter over the node (``B``), all-reduce of the
      ``B / F`` shard across nodes, all-gather over the node (``B``);
    * reduce-scatter = over the node, then the shard across nodes; all-gather the reverse.

    Without it, one flat ring over all ``F * S`` devices, every step paced by the slow
    link. Both are alpha-beta costs, so the simulator and the planners take them as any
    other profile.

    Args:
      fast: the link preset within a node.
      slow: the link preset between nodes.
      nodes: the number of nodes ``S``.
      per_node: devices per node ``F``.
      hierarchical: cost the hierarchical collectives; False: one flat ring.

    Returns:
      The `NetworkProfile` of ``nodes * per_node`` workers.

    Example:
        >>> network = two_level_network("nvlink4", "400gbib", nodes=2, per_node=8)
        >>> network.workers, network.meta["algorithm"]
        (16, 'hierarchical ring')
    """
    f, s = _link(fast), _link(slow)
    if nodes < 1 or per_node < 1:
        raise ProfileError(f"nodes={nodes} and per_node={per_node} must be >= 1")
    within, across = ring_costs(f, per_node), ring_costs(s, nodes)
    workers = nodes * per_node
    if hierarchical:

        def chain(*parts: tuple[CollectiveCost, float]) -> CollectiveCost:
            return CollectiveCost(
                sum(c.alpha_s for c, _ in parts), sum(c.beta_s_per_byte * share for c, share in parts)
            )

        shard = 1.0 / per_node
        collectives = {
            "all_reduce": chain(
                (within["reduce_scatter"], 1.0), (across["all_reduce"], shard), (within["all_gather"], 1.0)
            ),
            "reduce_scatter": chain((within["reduce_scatter"], 1.0), (across["reduce_scatter"], shard)),
            "all_gather": chain((across["all_gather"], shard), (within["all_gather"], 1.0)),
            "all_to_all": ring_costs(s, workers)["all_to_all"] if nodes > 1 else within["all_to_all"],
            "ppermute": across["ppermute"] if nodes > 1 else within["ppermute"],
        }
        algorithm = "hierarchical ring"
    else:
        collectives = ring_costs(s if nodes > 1 else f, workers)
        algorithm = "flat ring (paced by the slow link)"
    return NetworkProfile(
        workers,
        collectives,
        {
            "preset": f"{fast}+{slow}",
            "source": f"{f.source}; {s.source}",
            "algorithm": algorithm,
            "levels": {"fast": fast, "slow": slow, "nodes": nodes, "per_node": per_node},
        },
    )


@dataclasses.dataclass(frozen=True)
class DevicePreset:
    """A device roofline: peak dense FLOP/s in the stated precision and memory bandwidth.

    Args:
      name: the preset's name (a key of `DEVICE_PRESETS`).
      peak_flops: peak dense FLOP/s in ``precision``.
      memory_bytes_per_s: memory bandwidth.
      precision: the precision of ``peak_flops`` (``"fp32"``, ``"bf16"``, ...).
      source: where the numbers come from.

    Example:
        >>> DEVICE_PRESETS["h100"].precision
        'bf16'
    """

    name: str
    peak_flops: float
    memory_bytes_per_s: float
    precision: str
    source: str


DEVICE_PRESETS: dict[str, DevicePreset] = {
    # NVIDIA Tesla V100 SXM2 datasheet: 15.7 TFLOPS FP32, 900 GB/s HBM2. FP32, as in the
    # MG-WFBP / DeAR experiments.
    "v100": DevicePreset("v100", 15.7e12, 900e9, "fp32", "NVIDIA Tesla V100 SXM2 datasheet"),
    # NVIDIA A100 SXM4 40GB datasheet: 156 TFLOPS TF32 (dense), 1555 GB/s HBM2.
    "a100": DevicePreset("a100", 156e12, 1555e9, "tf32", "NVIDIA A100 datasheet (SXM4 40GB)"),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense (1979 with sparsity), 3.35 TB/s HBM3.
    "h100": DevicePreset("h100", 989e12, 3.35e12, "bf16", "NVIDIA H100 SXM datasheet"),
    # Google Cloud TPU v5e docs: 197 TFLOPS BF16 per chip, 819 GB/s HBM2.
    "tpu-v5e": DevicePreset("tpu-v5e", 197e12, 819e9, "bf16", "cloud.google.com/tpu/docs/v5e"),
}


def device_preset(name: str) -> DevicePreset:
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise ProfileError(f"unknown device preset {name!r}; choose one of {', '.join(DEVICE_PRESETS)}") from None


def roofline_seconds(flops: float, memory_bytes: float, device: DevicePreset, efficiency: float = 0.5) -> float:
    """Time of a kernel under a roofline, with a sustained fraction ``efficiency`` of peak.

    Args:
      flops: the kernel's floating-point operations.
      memory_bytes: the bytes it moves to and from memory.
      device: the device's roofline.
      efficiency: the sustained fraction of peak, in (0, 1].

    Returns:
      Seconds: the larger of compute and memory time, divided by ``efficiency``.

    Example:
        >>> round(roofline_seconds(1e12, 1e9, DEVICE_PRESETS["h100"]), 5)  # compute bound
        0.00202
    """
    if not 0 < efficiency <= 1:
        raise JaxschedValueError(f"efficiency={efficiency} must be in (0, 1]")
    return max(flops / device.peak_flops, memory_bytes / device.memory_bytes_per_s) / efficiency


# Top-k selection as a threshold test is a few elementwise passes over the gradient, not a
# sort: on CPU, 10M float32 took 34 ms per elementwise pass against 93 ms for a sampled
# threshold + mask (docs/benchmarks.md, "Top-k on CPU").
SELECTION_PASSES = 3


def topk_selection_s_per_byte(device: DevicePreset) -> float:
    """Seconds per gradient byte that top-k selection costs on ``device`` (memory bound).

    Args:
      device: the device's roofline.

    Returns:
      `SELECTION_PASSES` passes over each byte at the device's memory bandwidth.

    Example:
        >>> topk_selection_s_per_byte(DEVICE_PRESETS["h100"]) == 3 / 3.35e12
        True
    """
    return SELECTION_PASSES / device.memory_bytes_per_s
