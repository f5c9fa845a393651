"""Layer profiles of published models, built from their parameter shapes and FLOPs.

Why: users want to see where a ResNet-50 or BERT step's time goes on a cluster they do
not have. Each architecture is written down compactly (layer by layer, tracking shapes
arithmetically), giving per-layer parameter counts and forward multiply-accumulates;
times come from a device roofline (`jaxsched.sim._costmodel.roofline_seconds`), with
backward at twice the forward FLOPs (weight and input gradients). A "layer" is one
parameterised operator with its normalisation (conv+BN, a linear, an attention block).
Parameter counts match the published ones within 0.5% (see ``PUBLISHED_PARAMS``).

Example:
    >>> from jaxsched.sim._zoo_profiles import zoo_profile
    >>> prof = zoo_profile("resnet50", "v100")
    >>> prof.total_params
    25557032
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsched._errors import JaxschedValueError
from jaxsched.sim._costmodel import DevicePreset, Layer, LayerProfile, device_preset, roofline_seconds

# Published parameter counts, with where they come from.
PUBLISHED_PARAMS = {
    "resnet50": (25_557_032, "torchvision resnet50 (He et al., 2016)"),
    "vgg16": (138_357_544, "torchvision vgg16 (Simonyan & Zisserman, 2015)"),
    "densenet201": (20_013_928, "torchvision densenet201 (Huang et al., 2017)"),
    "inception_v4": (42_679_816, "timm inception_v4, 1000 classes (Szegedy et al., 2017)"),
    "bert-base": (109_482_240, "HF bert-base-uncased incl. pooler (Devlin et al., 2019: '110M')"),
    "bert-large": (335_141_888, "HF bert-large-uncased incl. pooler (Devlin et al., 2019: '340M')"),
    "gpt2": (124_439_808, "HF gpt2, tied embeddings (Radford et al., 2019: '117M'/'124M')"),
}
ZOO_MODELS = tuple(PUBLISHED_PARAMS)
# Per-device batch (and sequence length) used unless the caller overrides them.
DEFAULT_BATCH = {
    "resnet50": 64,
    "vgg16": 32,
    "densenet201": 32,
    "inception_v4": 64,
    "bert-base": 32,
    "bert-large": 8,
    "gpt2": 8,
}
DEFAULT_SEQ_LEN = {"bert-base": 128, "bert-large": 512, "gpt2": 1024}
BYTES_PER_VALUE = 4  # fp32 gradients and activations


@dataclasses.dataclass(frozen=True)
class ArchLayer:
    """Shape-derived facts for one layer, per sample.

    Attributes:
      name: the layer's name, as the published model names its parameters.
      params: its parameter count.
      macs: forward multiply-accumulates per sample.
      activations: input and output values per sample (memory traffic).
      factor_dims: K-FAC's (input factor, output factor) sizes of a convolution or linear
        layer; ``()`` for others.

    Example:
        >>> architecture("resnet50")[0]
        ArchLayer(name='conv1', params=9536, macs=118013952, activations=953344, factor_dims=(147, 64))
    """

    name: str
    params: int
    macs: float  # forward multiply-accumulates per sample
    activations: float  # input + output values per sample (memory traffic)
    factor_dims: tuple[int, ...] = ()  # K-FAC: (input factor, output factor) of convs and linears


def _conv(
    layers: list[ArchLayer],
    name: str,
    cin: int,
    cout: int,
    kernel: tuple[int, int],
    h: int,
    w: int,
    stride: int = 1,
    pad: tuple[int, int] = (0, 0),
    bias: bool = False,
    bn: bool = True,
    pre_bn: int = 0,
) -> tuple[int, int, int]:
    """Append a conv (+BN after it, or ``pre_bn`` channels of BN before it); returns C, H, W."""
    kh, kw = kernel
    ho = (h + 2 * pad[0] - kh) // stride + 1
    wo = (w + 2 * pad[1] - kw) // stride + 1
    params = kh * kw * cin * cout + (cout if bias else 0) + (2 * cout if bn else 0) + 2 * pre_bn
    layers.append(
        ArchLayer(
            name,
            params,
            kh * kw * cin * cout * ho * wo,
            cin * h * w + cout * ho * wo,
            (kh * kw * cin + (1 if bias else 0), cout),
        )
    )
    return cout, ho, wo


def _linear(layers: list[ArchLayer], name: str, fin: int, fout: int, tokens: int = 1, extra_params: int = 0) -> None:
    layers.append(
        ArchLayer(name, fin * fout + fout + extra_params, fin * fout * tokens, (fin + fout) * tokens, (fin + 1, fout))
    )


def resnet50() -> list[ArchLayer]:
    layers: list[ArchLayer] = []
    c, h, w = _conv(layers, "conv1", 3, 64, (7, 7), 224, 224, 2, (3, 3))
    h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1  # maxpool 3x3 s2 p1
    for stage, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]):
        for b in range(blocks):
            s = stride if b == 0 else 1
            prefix = f"layer{stage + 1}/{b}"
            cin = c
            _, h1, w1 = _conv(layers, f"{prefix}/conv1", cin, width, (1, 1), h, w)
            _, h2, w2 = _conv(layers, f"{prefix}/conv2", width, width, (3, 3), h1, w1, s, (1, 1))
            c, _, _ = _conv(layers, f"{prefix}/conv3", width, 4 * width, (1, 1), h2, w2)
            if b == 0:
                _conv(layers, f"{prefix}/downsample", cin, 4 * width, (1, 1), h, w, s)
            h, w = h2, w2
    _linear(layers, "fc", 2048, 1000)
    return layers


def vgg16() -> list[ArchLayer]:
    layers: list[ArchLayer] = []
    c, h, w = 3, 224, 224
    plan: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    for i, v in enumerate(plan):
        if isinstance(v, str):  # "M": max pooling
            h, w = h // 2, w // 2
        else:
            c, h, w = _conv(layers, f"features/{i}", c, v, (3, 3), h, w, 1, (1, 1), bias=True, bn=False)
    _linear(layers, "classifier.0", 512 * 7 * 7, 4096)
    _linear(layers, "classifier.3", 4096, 4096)
    _linear(layers, "classifier.6", 4096, 1000)
    return layers


def densenet201(growth: int = 32, blocks: tuple[int, ...] = (6, 12, 48, 32)) -> list[ArchLayer]:
    layers: list[ArchLayer] = []
    c, h, w = _conv(layers, "conv0", 3, 64, (7, 7), 224, 224, 2, (3, 3))
    h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
    for b, count in enumerate(blocks):
        for i in range(count):
            prefix = f"denseblock{b + 1}/denselayer{i + 1}"
            _conv(layers, f"{prefix}/conv1", c, 4 * growth, (1, 1), h, w, bn=False, pre_bn=c)
            _conv(layers, f"{prefix}/conv2", 4 * growth, growth, (3, 3), h, w, 1, (1, 1), bn=False, pre_bn=4 * growth)
            c += growth
        if b < len(blocks) - 1:
            c, h, w = _conv(layers, f"transition{b + 1}", c, c // 2, (1, 1), h, w, bn=False, pre_bn=c)
            h, w = h // 2, w // 2
    _linear(layers, "classifier", c, 1000, extra_params=2 * c)  # with norm5
    return layers


def inception_v4(num_classes: int = 1000) -> list[ArchLayer]:
    layers: list[ArchLayer] = []

    def conv(name, cin, cout, k, h, w, stride=1, pad=(0, 0)):
        return _conv(layers, name, cin, cout, k, h, w, stride, pad)

    _, h, w = conv("stem.0", 3, 32, (3, 3), 299, 299, 2)
    _, h, w = conv("stem.1", 32, 32, (3, 3), h, w)
    _, h, w = conv("stem.2", 32, 64, (3, 3), h, w, 1, (1, 1))
    _, h, w = conv("mixed3a", 64, 96, (3, 3), h, w, 2)  # || maxpool: 64 + 96 = 160
    conv("mixed4a.b0.0", 160, 64, (1, 1), h, w)
    _, h4, w4 = conv("mixed4a.b0.1", 64, 96, (3, 3), h, w)
    conv("mixed4a.b1.0", 160, 64, (1, 1), h, w)
    conv("mixed4a.b1.1", 64, 64, (1, 7), h, w, 1, (0, 3))
    conv("mixed4a.b1.2", 64, 64, (7, 1), h, w, 1, (3, 0))
    conv("mixed4a.b1.3", 64, 96, (3, 3), h, w)
    h, w = h4, w4
    _, h, w = conv("mixed5a", 192, 192, (3, 3), h, w, 2)  # || maxpool: 384
    for i in range(4):
        p = f"inception_a{i}"
        conv(f"{p}/b0", 384, 96, (1, 1), h, w)
        conv(f"{p}/b1/0", 384, 64, (1, 1), h, w)
        conv(f"{p}/b1/1", 64, 96, (3, 3), h, w, 1, (1, 1))
        conv(f"{p}/b2/0", 384, 64, (1, 1), h, w)
        conv(f"{p}/b2/1", 64, 96, (3, 3), h, w, 1, (1, 1))
        conv(f"{p}/b2/2", 96, 96, (3, 3), h, w, 1, (1, 1))
        conv(f"{p}/b3", 384, 96, (1, 1), h, w)
    conv("reduction_a.b0", 384, 384, (3, 3), h, w, 2)
    conv("reduction_a.b1.0", 384, 192, (1, 1), h, w)
    conv("reduction_a.b1.1", 192, 224, (3, 3), h, w, 1, (1, 1))
    _, h, w = conv("reduction_a.b1.2", 224, 256, (3, 3), h, w, 2)
    for i in range(7):
        p = f"inception_b{i}"
        conv(f"{p}/b0", 1024, 384, (1, 1), h, w)
        conv(f"{p}/b1/0", 1024, 192, (1, 1), h, w)
        conv(f"{p}/b1/1", 192, 224, (1, 7), h, w, 1, (0, 3))
        conv(f"{p}/b1/2", 224, 256, (7, 1), h, w, 1, (3, 0))
        conv(f"{p}/b2/0", 1024, 192, (1, 1), h, w)
        conv(f"{p}/b2/1", 192, 192, (7, 1), h, w, 1, (3, 0))
        conv(f"{p}/b2/2", 192, 224, (1, 7), h, w, 1, (0, 3))
        conv(f"{p}/b2/3", 224, 224, (7, 1), h, w, 1, (3, 0))
        conv(f"{p}/b2/4", 224, 256, (1, 7), h, w, 1, (0, 3))
        conv(f"{p}/b3", 1024, 128, (1, 1), h, w)
    conv("reduction_b.b0.0", 1024, 192, (1, 1), h, w)
    conv("reduction_b.b0.1", 192, 192, (3, 3), h, w, 2)
    conv("reduction_b.b1.0", 1024, 256, (1, 1), h, w)
    conv("reduction_b.b1.1", 256, 256, (1, 7), h, w, 1, (0, 3))
    conv("reduction_b.b1.2", 256, 320, (7, 1), h, w, 1, (3, 0))
    _, h, w = conv("reduction_b.b1.3", 320, 320, (3, 3), h, w, 2)
    for i in range(3):
        p = f"inception_c{i}"
        conv(f"{p}/b0", 1536, 256, (1, 1), h, w)
        conv(f"{p}/b1/0", 1536, 384, (1, 1), h, w)
        conv(f"{p}/b1/1a", 384, 256, (1, 3), h, w, 1, (0, 1))
        conv(f"{p}/b1/1b", 384, 256, (3, 1), h, w, 1, (1, 0))
        conv(f"{p}/b2/0", 1536, 384, (1, 1), h, w)
        conv(f"{p}/b2/1", 384, 448, (3, 1), h, w, 1, (1, 0))
        conv(f"{p}/b2/2", 448, 512, (1, 3), h, w, 1, (0, 1))
        conv(f"{p}/b2/3a", 512, 256, (1, 3), h, w, 1, (0, 1))
        conv(f"{p}/b2/3b", 512, 256, (3, 1), h, w, 1, (1, 0))
        conv(f"{p}/b3", 1536, 256, (1, 1), h, w)
    _linear(layers, "last_linear", 1536, num_classes)
    return layers


def _transformer(
    prefix: str, dim: int, depth: int, seq: int, vocab: int, positions: int, token_types: int, pooler: bool
) -> list[ArchLayer]:
    """Encoder/decoder stack: embeddings, then per block an attention and an MLP layer."""
    layers = [
        ArchLayer(
            "embeddings", (vocab + positions + token_types) * dim + (2 * dim if token_types else 0), 0.0, 2 * dim * seq
        )
    ]
    for i in range(depth):
        attention_macs = 4 * dim * dim * seq + 2 * seq * seq * dim  # projections + QK^T, AV
        layers.append(
            ArchLayer(f"{prefix}{i}/attention", 4 * dim * dim + 4 * dim + 2 * dim, attention_macs, 6 * dim * seq)
        )
        layers.append(
            ArchLayer(f"{prefix}{i}/mlp", 8 * dim * dim + 5 * dim + 2 * dim, 8 * dim * dim * seq, 10 * dim * seq)
        )
    if pooler:
        layers.append(ArchLayer("pooler", dim * dim + dim, dim * dim, 2 * dim))
    else:  # GPT-2: final LayerNorm; the tied LM head adds FLOPs, its parameters are wte's
        layers.append(ArchLayer("ln_f+lm_head", 2 * dim, dim * vocab * seq, (dim + vocab) * seq))
    return layers


def architecture(name: str, seq_len: int | None = None) -> list[ArchLayer]:
    """Per-layer shapes of a zoo model (per sample; transformers per sequence).

    Args:
      name: one of ``ZOO_MODELS`` (``resnet50``, ``vgg16``, ``bert-base``, ``gpt2``, ...).
      seq_len: a transformer's sequence length (default: the model's, ``DEFAULT_SEQ_LEN``).

    Returns:
      Its `ArchLayer` list, in forward order.

    Example:
        >>> len(architecture("vgg16")), sum(layer.params for layer in architecture("vgg16"))
        (16, 138357544)
    """
    seq = seq_len or DEFAULT_SEQ_LEN.get(name, 0)
    if name == "resnet50":
        return resnet50()
    if name == "vgg16":
        return vgg16()
    if name == "densenet201":
        return densenet201()
    if name == "inception_v4":
        return inception_v4()
    if name == "bert-base":
        return _transformer("encoder.layer", 768, 12, seq, 30522, 512, 2, pooler=True)
    if name == "bert-large":
        return _transformer("encoder.layer", 1024, 24, seq, 30522, 512, 2, pooler=True)
    if name == "gpt2":
        return _transformer("h", 768, 12, seq, 50257, 1024, 0, pooler=False)
    raise JaxschedValueError(
        f"unknown model {name!r}; choose one of {', '.join(ZOO_MODELS)} or pass a measured --profile"
    )


#: Symmetric eigendecomposition with eigenvectors: about 9 n^3 flops (Golub & Van Loan).
EIGH_FLOPS_PER_CUBE = 9.0


def zoo_profile(
    name: str,
    device: str | DevicePreset = "v100",
    batch: int | None = None,
    seq_len: int | None = None,
    efficiency: float = 0.5,
    kfac: bool = False,
    inverse_efficiency: float = 0.1,
) -> LayerProfile:
    """Layer profile of a published model on a device roofline (``efficiency`` of peak).

    Forward: ``2 * MACs * batch`` FLOPs and ``4 * (params + batch * activations)`` bytes;
    backward: twice both; update (SGD with momentum): 5 values moved per parameter.

    ``kfac=True`` adds K-FAC's second-order costs to every convolution and linear layer:
    factor bytes (fp32), factor computation (``2 * rows * sum(n^2)`` FLOPs, rows = batch
    times output positions, on the roofline) and one eigendecomposition per factor
    (``9 n^3`` FLOPs at ``inverse_efficiency`` of peak: factorizations run far below a
    matmul's rate; an assumption, not a measurement).

    Args:
      name: one of ``ZOO_MODELS``.
      device: a device preset's name (``"v100"``, ``"a100"``, ...) or a `DevicePreset`.
      batch: the per-device batch (default: the model's, ``DEFAULT_BATCH``).
      seq_len: a transformer's sequence length.
      efficiency: the fraction of the roofline's peak the compute reaches.
      kfac: add K-FAC's factor and inverse costs.
      inverse_efficiency: the fraction of peak an eigendecomposition reaches.

    Returns:
      The model's [`LayerProfile`][jaxsched.sim._costmodel.LayerProfile], its meta naming the assumptions.

    Example:
        >>> profile = zoo_profile("bert-base", "a100", batch=8)
        >>> len(profile.layers), profile.meta["seq_len"]
        (26, 128)
    """
    dev = device_preset(device) if isinstance(device, str) else device
    batch = batch or DEFAULT_BATCH.get(name, 32)
    if batch < 1:
        raise JaxschedValueError(f"batch={batch} must be >= 1")
    layers = []
    for arch in architecture(name, seq_len):
        memory = BYTES_PER_VALUE * (arch.params + batch * arch.activations)
        forward = roofline_seconds(2 * arch.macs * batch, memory, dev, efficiency)
        backward = roofline_seconds(4 * arch.macs * batch, 2 * memory, dev, efficiency)
        update = roofline_seconds(2 * arch.params, 5 * BYTES_PER_VALUE * arch.params, dev, efficiency)
        second: dict[str, Any] = {}
        if kfac and arch.factor_dims:
            d_a, d_g = arch.factor_dims
            rows = batch * arch.macs / max(1, d_a * d_g)
            squares = sum(n * n for n in arch.factor_dims)
            second = dict(
                factor_bytes=BYTES_PER_VALUE * squares,
                factor_s=roofline_seconds(
                    2 * rows * squares, BYTES_PER_VALUE * (rows * (d_a + d_g) + squares), dev, efficiency
                ),
                factor_dims=arch.factor_dims,
                inverse_s=tuple(
                    roofline_seconds(EIGH_FLOPS_PER_CUBE * n**3, BYTES_PER_VALUE * n * n, dev, inverse_efficiency)
                    for n in arch.factor_dims
                ),
            )
        layers.append(Layer(arch.name, arch.params, BYTES_PER_VALUE * arch.params, forward, backward, update, **second))
    meta = {
        "model": name,
        "device": dev.name,
        "precision": dev.precision,
        "batch": batch,
        "efficiency": efficiency,
        "source": "jaxsched.sim._zoo_profiles (roofline, not measured)",
    }
    if kfac:
        meta["kfac"] = {"inverse": f"{EIGH_FLOPS_PER_CUBE:g} n^3 flops", "inverse_efficiency": inverse_efficiency}
    if name in DEFAULT_SEQ_LEN:
        meta["seq_len"] = seq_len or DEFAULT_SEQ_LEN[name]
    return LayerProfile(layers, meta)


def forward_gflops(name: str, seq_len: int | None = None) -> float:
    """Forward GFLOPs per sample (2 x MACs), for checking against published figures.

    Args:
      name: one of ``ZOO_MODELS``.
      seq_len: a transformer's sequence length.

    Returns:
      GFLOPs of one sample's forward pass.

    Example:
        >>> round(forward_gflops("resnet50"), 1)
        8.2
    """
    return 2 * sum(a.macs for a in architecture(name, seq_len)) / 1e9


def relative_param_error(name: str) -> float:
    published, _ = PUBLISHED_PARAMS[name]
    return abs(sum(a.params for a in architecture(name)) - published) / published


__all__ = [
    "EIGH_FLOPS_PER_CUBE",
    "PUBLISHED_PARAMS",
    "ZOO_MODELS",
    "architecture",
    "forward_gflops",
    "relative_param_error",
    "zoo_profile",
]
