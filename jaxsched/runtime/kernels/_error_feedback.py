"""Top-k style gradient sparsification with error feedback: the fused kernel and its helpers.

Error feedback keeps what a step did not send and adds it to the next step's gradient:

    acc          = residual + grad
    mask         = |acc| >= threshold
    sent         = where(mask, acc, 0)
    new_residual = where(mask, 0, acc)

so ``sent + new_residual == residual + grad`` exactly (each element is ``acc + 0`` or
``0 + acc``). This module gives:

* `error_feedback_reference`: the jnp definition above (also the CPU/TPU path).
* `error_feedback_pallas`: a Pallas kernel that does all of it in one pass over
  the gradient (two reads, two writes, plus one int32 count per block), written for
  **Mosaic GPU**, the Pallas GPU backend of jax 0.10 that is not deprecated, with
  ``plgpu.kernel`` + ``emit_pipeline`` (``pallas_call`` for Mosaic GPU is deprecated in
  0.10 and has no lowering in 0.11; the interpreter path still uses ``pallas_call``,
  on the same block function, because the interpreter cannot run Mosaic GPU's copies). Blocks are
  ``(block_rows, 256)`` tiles of the flattened gradient: Mosaic GPU's async copies move
  at most 256 elements along each dimension (docs/benchmarks.md), so a 1-D 4096-element block
  does not lower, a 2-D ``(16, 256)`` one does. A gradient whose size 256 does not
  divide is padded to the next multiple of 256 (one copy; give buffers a size that
  256 divides to avoid it); a partial last row block is left to the copy engine's
  bounds handling, and the per-block count masks every element past ``n`` by its
  flat index, so it is exact whatever the padding holds.
* `fused_error_feedback`: picks one of the two by the platform the computation
  is lowered for (``lax.platform_dependent``): the kernel for CUDA on a Hopper-class
  GPU (or when lowering for CUDA on a machine without one) when 256 divides the size,
  jnp everywhere else.

The op is memory-bound: XLA fuses the jnp path into one pass too, so the kernel matches it
rather than beats it (the benchmarks page has the throughput figures).
* `estimate_threshold`: the magnitude quantile of a random sample, so that the
  number selected lands near ``k = density * n`` without sorting the whole gradient.
* `compact`: dense masked output to fixed-capacity ``(values, indices)``.
* `threshold_error_feedback`: the whole threshold path (estimate, fused error
  feedback, compaction); `exact_topk_error_feedback`: the ``lax.top_k``
  baseline with the same result type.

Index compaction (design)
-------------------------
Mosaic GPU lowering has no cumsum, sort or top-k, and the Triton backend (which has a
cumsum) is deprecated from jax 0.11, so the kernel does not compact. It writes the
dense masked ``sent`` (which error feedback needs anyway) and compaction runs outside
the kernel as ordinary XLA ops, with a fixed ``capacity`` so shapes stay static:

1. pack ``sent != 0`` into one uint32 word per 32 elements (one read of ``sent``,
   1/32 of it written);
2. an inclusive prefix sum of the words' population counts (``n/32`` elements);
3. for each output slot ``j < capacity``, a binary search over that prefix sum finds
   the word holding the ``j``-th selected element, and a 5-step binary search on
   popcounts of the word's low bits finds the bit.

This is ``jnp.nonzero(size=capacity)`` by another route, which avoids a prefix sum and a
scatter over all ``n`` elements: work after the packing pass is proportional to ``n/32 +
capacity * log n``.

Entries with ``sent == 0`` are not transmitted; with ``threshold > 0`` these are exactly
the unselected ones (a selected value has ``|acc| >= threshold > 0``); a selected
exact zero (only possible when ``threshold <= 0``) carries no mass, so dropping it
changes nothing. When more than ``capacity`` elements are selected, the first
``capacity`` in index order are kept and the rest go back into the residual, so mass
is conserved exactly in every case: ``densify(values, indices) + new_residual ==
residual + grad``. The result reports ``count`` (entries sent) and ``overflow``
(entries returned to the residual for lack of capacity).

The sampled threshold statistics have no kernel of their own: the estimator reads only
``sample_size`` gathered elements, far less than one pass over the gradient.

NaN handling: ``|NaN| >= t`` is false, so a NaN stays in the residual (as in jnp).

Example:
    >>> import jax.numpy as jnp
    >>> grad = jnp.array([0.5, -2.0, 0.1, 3.0])
    >>> residual = jnp.array([0.6, 0.0, -0.05, 0.0])
    >>> sent, new_residual, count = fused_error_feedback(grad, residual, 1.0)
    >>> sent.tolist(), new_residual.tolist(), int(count)
    ([1.100000023841858, -2.0, 0.0, 3.0], [0.0, 0.0, 0.05000000074505806, 0.0], 3)
    >>> bool(jnp.array_equal(sent + new_residual, residual + grad))
    True
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched._errors import JaxschedTypeError, JaxschedValueError

__all__ = [
    "BLOCK_COLS",
    "ErrorFeedback",
    "SparseGradient",
    "compact",
    "default_capacity",
    "default_sample_size",
    "densify",
    "error_feedback_pallas",
    "error_feedback_reference",
    "estimate_threshold",
    "exact_topk_error_feedback",
    "fused_error_feedback",
    "selection_size",
    "threshold_error_feedback",
]

#: Columns of a kernel block: Mosaic GPU copies at most 256 elements per dimension.
BLOCK_COLS = 256
#: Default rows of a kernel block: (16, 256) float32 is 16 KiB per operand.
DEFAULT_BLOCK_ROWS = 16
#: The estimator's default sample holds about this many elements above the threshold
#: (relative spread of the selected count about 1/sqrt(400) = 5 %).
SAMPLE_HITS = 400

Implementation = Literal["pallas", "jnp", "interpret"]


class ErrorFeedback(NamedTuple):
    """Dense result of one error-feedback step.

    Attributes:
      sent: ``where(mask, residual + grad, 0)``, the shape and dtype of ``grad``.
      new_residual: ``where(mask, 0, residual + grad)``.
      count: int32 scalar, the number of elements with ``|residual + grad| >= threshold``.
    """

    sent: jax.Array
    new_residual: jax.Array
    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count, kept for the API


class SparseGradient(NamedTuple):
    """Compacted result of one sparsified error-feedback step.

    Attributes:
      values: ``(capacity,)`` values sent; slots past ``count`` hold 0.
      indices: ``(capacity,)`` int32 positions in the flattened gradient; slots past
        ``count`` hold 0 (so a scatter-add of all slots is correct without ``count``).
      count: int32 scalar, entries sent (at most ``capacity``); bytes on the wire
        follow from it.
      overflow: int32 scalar, selected entries that did not fit and went back into
        ``new_residual``.
      new_residual: the residual for the next step, the shape of ``grad``.
      threshold: the magnitude threshold used (``None`` for exact top-k).
    """

    values: jax.Array
    indices: jax.Array
    count: jax.Array  # type: ignore[assignment]  # a field named like tuple.count, kept for the API
    overflow: jax.Array
    new_residual: jax.Array
    threshold: jax.Array | None = None


# ----------------------------------------------------------------------------- checks


def _check_float(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise JaxschedTypeError(f"{name} must have a floating dtype (float32, bfloat16, ...), got {x.dtype}")
    return x


def _check_pair(grad, residual) -> tuple[jax.Array, jax.Array]:
    grad = _check_float(grad, "grad")
    residual = _check_float(residual, "residual")
    if grad.shape != residual.shape:
        raise JaxschedValueError(
            f"grad and residual must have the same shape, got grad {grad.shape} and residual {residual.shape}"
        )
    if grad.dtype != residual.dtype:
        raise JaxschedTypeError(
            f"grad and residual must have the same dtype, got grad {grad.dtype} and residual {residual.dtype}"
        )
    return grad, residual


def _check_density(density) -> float:
    try:
        density = float(density)
    except (TypeError, ValueError):
        raise JaxschedTypeError(f"density must be a number in (0, 1], got {density!r}") from None
    if not 0.0 < density <= 1.0:
        raise JaxschedValueError(f"density must be in (0, 1], got {density}")
    return density


def _threshold_scalar(threshold, dtype) -> jax.Array:
    t = jnp.asarray(threshold)
    if t.ndim != 0:
        raise JaxschedValueError(f"threshold must be a scalar, got shape {t.shape}")
    if not (jnp.issubdtype(t.dtype, jnp.floating) or jnp.issubdtype(t.dtype, jnp.integer)):
        raise JaxschedTypeError(f"threshold must be a real number, got dtype {t.dtype}")
    return t.astype(dtype)


def selection_size(n: int, density: float) -> int:
    """``k`` for ``n`` elements at ``density``: ``round(density * n)``, at least 1.

    >>> selection_size(10_000_000, 0.01), selection_size(10, 0.01)
    (100000, 1)
    """
    density = _check_density(density)
    return max(1, min(n, int(round(density * n))))


def default_sample_size(n: int, density: float) -> int:
    """Sample size of `estimate_threshold`: about ``400 / density`` elements
    (so about 400 sampled elements lie above the threshold), at least 4096, at most ``n``.

    >>> default_sample_size(10_000_000, 0.01), default_sample_size(10_000_000, 0.001)
    (40000, 400000)
    """
    density = _check_density(density)
    return int(min(n, max(4096, math.ceil(SAMPLE_HITS / density))))


def default_capacity(n: int, density: float) -> int:
    """Default compaction capacity: ``1.25 k + 64`` slots (at most ``n``); the
    estimator's default spread is about 5 % of ``k``.

    >>> default_capacity(10_000_000, 0.01)
    125064
    """
    k = selection_size(n, density)
    return int(min(n, math.ceil(1.25 * k) + 64))


# -------------------------------------------------------------------------- reference


@jax.jit
def error_feedback_reference(grad, residual, threshold) -> ErrorFeedback:
    """Error feedback in plain jnp (the definition, and the path used off GPU).

    Args:
      grad: floating array.
      residual: the same shape and dtype as ``grad``.
      threshold: scalar magnitude threshold (cast to ``grad``'s dtype).

    Returns:
      ``ErrorFeedback(sent, new_residual, count)``.

    >>> import jax.numpy as jnp
    >>> r = error_feedback_reference(jnp.array([1.0, -3.0]), jnp.array([0.5, 0.0]), 2.0)
    >>> r.sent.tolist(), r.new_residual.tolist(), int(r.count)
    ([0.0, -3.0], [1.5, 0.0], 1)
    """
    grad, residual = _check_pair(grad, residual)
    t = _threshold_scalar(threshold, grad.dtype)
    acc = residual + grad
    mask = jnp.abs(acc) >= t
    zero = jnp.zeros_like(acc)
    return ErrorFeedback(jnp.where(mask, acc, zero), jnp.where(mask, zero, acc), jnp.sum(mask, dtype=jnp.int32))


# ----------------------------------------------------------------------------- kernel


def _ef_block(thr, g_ref, r_ref, sent_ref, res_ref, cnt_ref, *, block_index, n: int, block_rows: int, mosaic: bool):
    """One ``(block_rows, 256)`` block: accumulate, test, select, update, count."""
    acc = r_ref[...] + g_ref[...]
    mask = jnp.abs(acc) >= thr
    zero = jnp.zeros_like(acc)
    sent_ref[...] = jnp.where(mask, acc, zero)
    res_ref[...] = jnp.where(mask, zero, acc)
    shape = (block_rows, BLOCK_COLS)
    if mosaic:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        # The layout a plain load of the block has (8-byte vectors per thread).
        layout = plgpu.Layout.WG_STRIDED(shape, vec_size=8 // acc.dtype.itemsize)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    else:
        row = lax.broadcasted_iota(jnp.int32, shape, 0)
        col = lax.broadcasted_iota(jnp.int32, shape, 1)
    flat = (block_index * block_rows + row) * BLOCK_COLS + col
    hit = jnp.logical_and(mask, flat < n)
    cnt_ref[...] = jnp.full(cnt_ref.shape, jnp.sum(hit.astype(jnp.int32)), jnp.int32)


def _call_mosaic(t, g2, r2, *, n: int, block_rows: int):
    """``plgpu.kernel``: one thread block per ``(block_rows, 256)`` block; the block is
    copied to shared memory and back by ``emit_pipeline`` (TMA)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, dtype = g2.shape[0], g2.dtype
    nblocks = -(-rows // block_rows)

    def body(thr_ref, g_ref, r_ref, sent_ref, res_ref, cnt_ref):
        b = lax.axis_index("block")
        thr = thr_ref[0]

        def step(_, g_s, r_s, sent_s, res_s, cnt_s):
            _ef_block(thr, g_s, r_s, sent_s, res_s, cnt_s, block_index=b, n=n, block_rows=block_rows, mosaic=True)

        spec = plgpu.BlockSpec((block_rows, BLOCK_COLS), lambda _: (b, 0))
        count_spec = plgpu.BlockSpec((1, 128), lambda _: (b, 0))
        plgpu.emit_pipeline(step, grid=(1,), in_specs=[spec, spec], out_specs=[spec, spec, count_spec])(
            g_ref, r_ref, sent_ref, res_ref, cnt_ref
        )

    out_shape = [jax.ShapeDtypeStruct((rows, BLOCK_COLS), dtype)] * 2 + [
        jax.ShapeDtypeStruct((nblocks, 128), jnp.int32)
    ]
    # out_type (out_shape was removed from plgpu.kernel in jax 0.11)
    return plgpu.kernel(body, out_type=out_shape, grid=(nblocks,), grid_names=("block",))(t, g2, r2)


def _call_interpret(t, g2, r2, *, n: int, block_rows: int):
    """The same block function under the Pallas interpreter (``pallas_call``; the
    interpreter has no rule for Mosaic GPU's shared-memory copies)."""
    from jax.experimental import pallas as pl

    rows, dtype = g2.shape[0], g2.dtype
    nblocks = -(-rows // block_rows)

    def kernel(thr_ref, g_ref, r_ref, sent_ref, res_ref, cnt_ref):
        _ef_block(
            thr_ref[0],
            g_ref,
            r_ref,
            sent_ref,
            res_ref,
            cnt_ref,
            block_index=pl.program_id(0),
            n=n,
            block_rows=block_rows,
            mosaic=False,
        )

    spec = pl.BlockSpec((block_rows, BLOCK_COLS), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(nblocks,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), spec, spec],
        out_specs=[spec, spec, pl.BlockSpec((1, 128), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((rows, BLOCK_COLS), dtype)] * 2
        + [jax.ShapeDtypeStruct((nblocks, 128), jnp.int32)],
        interpret=True,
        name="error_feedback",
    )(t, g2, r2)


def _check_block_rows(block_rows: int, dtype) -> None:
    if not isinstance(block_rows, (int, np.integer)) or not 1 <= block_rows <= 256:
        raise JaxschedValueError(
            f"block_rows must be an int in [1, 256] (Mosaic GPU copies at "
            f"most 256 elements per dimension), got {block_rows!r}"
        )
    # A warpgroup (128 threads) loads 8 bytes per thread per step.
    per_step = 128 * (8 // jnp.dtype(dtype).itemsize)
    if (block_rows * BLOCK_COLS) % per_step:
        raise JaxschedValueError(
            f"block_rows={block_rows} gives a block of "
            f"{block_rows * BLOCK_COLS} elements, not a multiple of "
            f"{per_step} for dtype {jnp.dtype(dtype).name}"
        )


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def error_feedback_pallas(
    grad, residual, threshold, *, block_rows: int = DEFAULT_BLOCK_ROWS, interpret: bool = False
) -> ErrorFeedback:
    """Error feedback as one Pallas (Mosaic GPU) kernel pass.

    The flattened gradient is viewed as ``(rows, 256)`` (padded when 256 does not divide
    its size) and processed in ``(block_rows, 256)`` blocks, one thread block each; each
    block writes ``sent``, ``new_residual`` and its selected count.

    Args:
      grad, residual, threshold: as in `error_feedback_reference`.
      block_rows: rows per block, 1..256 (Mosaic GPU's per-dimension copy limit).
      interpret: run the kernel with the Pallas interpreter (any backend, slow).

    Returns:
      ``ErrorFeedback(sent, new_residual, count)``, equal to the reference.

    >>> import jax.numpy as jnp
    >>> g = jnp.arange(-3.0, 4.0)
    >>> out = error_feedback_pallas(g, jnp.zeros_like(g), 2.0, interpret=True)
    >>> out.sent.tolist(), int(out.count)
    ([-3.0, -2.0, 0.0, 0.0, 0.0, 2.0, 3.0], 4)
    """
    grad, residual = _check_pair(grad, residual)
    _check_block_rows(block_rows, grad.dtype)
    shape, dtype, n = grad.shape, grad.dtype, grad.size
    if n == 0:
        return error_feedback_reference(grad, residual, threshold)
    if n >= 2**31 - BLOCK_COLS * block_rows:
        raise JaxschedValueError(f"gradient of {n} elements is too large for int32 indexing; split it into buckets")
    t = _threshold_scalar(threshold, dtype).reshape(1)
    rows = -(-n // BLOCK_COLS)
    pad = rows * BLOCK_COLS - n

    def tile(x):
        x = x.reshape(-1)
        if pad:
            x = jnp.pad(x, (0, pad))
        return x.reshape(rows, BLOCK_COLS)

    call = _call_interpret if interpret else _call_mosaic
    sent, res, counts = call(t, tile(grad), tile(residual), n=n, block_rows=block_rows)

    def untile(x):
        x = x.reshape(-1)
        return (x[:n] if pad else x).reshape(shape)

    return ErrorFeedback(untile(sent), untile(res), jnp.sum(counts[:, 0]))


# --------------------------------------------------------------------------- dispatch


def _mosaic_gpu_usable() -> bool:
    """Whether a CUDA lowering should use the Mosaic GPU kernel: yes when every local
    CUDA device is Hopper or newer (sm_90+), and when there is no local CUDA device
    (lowering for export from another machine); no on older GPUs."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return True
    for d in devices:
        cc = getattr(d, "compute_capability", None)
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            return False
        if major < 9:
            return False
    return True


@functools.partial(jax.jit, static_argnames=("implementation", "block_rows"))
def fused_error_feedback(
    grad, residual, threshold, *, implementation: Implementation | None = None, block_rows: int = DEFAULT_BLOCK_ROWS
) -> ErrorFeedback:
    """Error feedback through the fastest implementation for the platform.

    With ``implementation=None`` the choice is made when the computation is lowered
    (``lax.platform_dependent``), so it follows the device the inputs live on and works
    inside ``jit``: the Pallas kernel for CUDA (Hopper or newer) when 256 divides the
    gradient's size, the jnp reference otherwise and on CPU, TPU and ROCm. ``"pallas"``,
    ``"jnp"`` or ``"interpret"`` (the kernel under the Pallas interpreter) force one.

    >>> import jax.numpy as jnp
    >>> out = fused_error_feedback(jnp.array([3.0, 0.5]), jnp.zeros(2), 1.0)
    >>> out.sent.tolist(), out.new_residual.tolist(), int(out.count)
    ([3.0, 0.0], [0.0, 0.5], 1)
    """
    grad, residual = _check_pair(grad, residual)
    if implementation == "jnp":
        return error_feedback_reference(grad, residual, threshold)
    if implementation == "pallas":
        return error_feedback_pallas(grad, residual, threshold, block_rows=block_rows)
    if implementation == "interpret":
        return error_feedback_pallas(grad, residual, threshold, block_rows=block_rows, interpret=True)
    if implementation is not None:
        raise JaxschedValueError(f"implementation must be None, 'pallas', 'jnp' or 'interpret', got {implementation!r}")
    t = _threshold_scalar(threshold, grad.dtype)
    ref = lambda g, r, t: tuple(error_feedback_reference(g, r, t))  # noqa: E731
    if grad.size % BLOCK_COLS or not _mosaic_gpu_usable():
        # Padding to a multiple of 256 and slicing back cost more than the kernel saves
        # (H100: 10M float32 took 0.19 ms with the pad, XLA's fusion 0.08 ms).
        return ErrorFeedback(*ref(grad, residual, t))
    kern = lambda g, r, t: tuple(  # noqa: E731
        error_feedback_pallas(g, r, t, block_rows=block_rows)
    )
    return ErrorFeedback(*lax.platform_dependent(grad, residual, t, cuda=kern, default=ref))


# -------------------------------------------------------------------------- threshold


@functools.partial(jax.jit, static_argnames=("density", "sample_size"))
def estimate_threshold(
    x, density: float, key: jax.Array, *, sample_size: int | None = None, residual=None
) -> jax.Array:
    """A magnitude threshold that about ``density * x.size`` elements of ``x`` reach.

    Draws ``sample_size`` positions uniformly (with replacement) and returns the
    ``1 - density`` quantile of the sampled magnitudes, taken from the maxima of rows
    of ``1 / density`` samples (only those are sorted; nothing of size ``n`` is sorted
    or written). When ``sample_size >= x.size`` the exact ``k``-th largest magnitude is
    returned. ``density == 1`` gives 0 (select all).

    Args:
      x: floating array (any shape).
      density: fraction to select, in (0, 1].
      key: a ``jax.random`` key.
      sample_size: default `default_sample_size` (about ``400 / density``).
      residual: if given (same shape and dtype as ``x``), the threshold is for
        ``residual + x``, computed only at the sampled positions.

    Returns:
      a scalar of ``x``'s dtype.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (100_000,))
    >>> t = estimate_threshold(x, 0.01, jax.random.key(1))
    >>> 800 < int(jnp.sum(jnp.abs(x) >= t)) < 1200
    True
    """
    density = _check_density(density)
    if residual is None:
        x = _check_float(x, "x")
    else:
        x, residual = _check_pair(x, residual)
    n = x.size
    if n == 0:
        raise JaxschedValueError("cannot estimate a threshold for an empty array")
    if density >= 1.0:
        return jnp.zeros((), x.dtype)
    m = default_sample_size(n, density) if sample_size is None else int(sample_size)
    if m < 1:
        raise JaxschedValueError(f"sample_size must be at least 1, got {sample_size}")
    flat = x.reshape(-1)
    flat_r = None if residual is None else residual.reshape(-1)
    if m >= n:
        mags = jnp.abs(flat if flat_r is None else flat_r + flat)
        k = selection_size(n, density)
    else:
        idx = jax.random.randint(key, (m,), 0, n, dtype=jnp.int32)
        s = flat[idx] if flat_r is None else flat_r[idx] + flat[idx]
        return _quantile_of_row_maxima(jnp.abs(s), density)
    return lax.top_k(mags, k)[0][k - 1]


def _quantile_of_row_maxima(mags: jax.Array, density: float) -> jax.Array:
    """The ``1 - density`` quantile of i.i.d. samples ``mags`` without sorting them.

    Rows of ``R = round(1 / density)`` samples: a row's maximum stays below ``t`` with
    probability ``F(t) ** R``, so the ``(1 - density) ** R`` quantile of the row maxima
    (about the 37th percentile) is a ``t`` with ``F(t) = 1 - density``, whatever the
    distribution. Only the few hundred row maxima are sorted: XLA's ``top_k`` sorts its
    whole operand, which on CPU cost 0.12 s for a 400k sample at 0.1 % density.
    """
    row = max(1, round(1.0 / density))
    rows = max(1, mags.size // row)
    maxima = jnp.sort(jnp.max(mags[: rows * row].reshape(rows, row), axis=1))
    position = min(rows - 1, int((1.0 - density) ** row * rows))
    return maxima[position]


# ------------------------------------------------------------------------- compaction


def _pack_bits(mask: jax.Array) -> jax.Array:
    n = mask.shape[0]
    words = -(-n // 32)
    m = jnp.pad(mask, (0, words * 32 - n)).reshape(words, 32).astype(jnp.uint32)
    return jnp.sum(m << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
    """Position of the ``rank``-th (0-based) set bit of each uint32 ``word``."""
    pos = jnp.zeros_like(rank)
    for step in (16, 8, 4, 2, 1):
        low = (word >> pos.astype(jnp.uint32)) & jnp.uint32((1 << step) - 1)
        c = lax.population_count(low).astype(jnp.int32)
        go = rank >= c
        pos = jnp.where(go, pos + step, pos)
        rank = jnp.where(go, rank - c, rank)
    return pos


@functools.partial(jax.jit, static_argnames=("capacity",))
def compact(sent, new_residual, capacity: int) -> SparseGradient:
    """Fixed-capacity ``(values, indices)`` of the nonzero entries of ``sent``.

    Keeps the first ``capacity`` nonzero entries in index order; any further ones are
    added back into the residual (``overflow`` counts them), so
    ``densify(values, indices, n) + new_residual == sent + new_residual_in`` exactly.
    See the module docstring for the algorithm and why.

    Args:
      sent, new_residual: the dense outputs of `fused_error_feedback`.
      capacity: number of output slots, ``>= 1``.

    >>> import jax.numpy as jnp
    >>> out = compact(jnp.array([0.0, 2.0, 0.0, -1.0, 4.0]), jnp.array([0.1, 0, 0.2, 0, 0]), 2)
    >>> out.values.tolist(), out.indices.tolist(), int(out.count), int(out.overflow)
    ([2.0, -1.0], [1, 3], 2, 1)
    >>> out.new_residual.tolist()
    [0.10000000149011612, 0.0, 0.20000000298023224, 0.0, 4.0]
    """
    sent, new_residual = _check_pair(sent, new_residual)
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise JaxschedValueError(f"capacity must be a positive int, got {capacity!r}")
    capacity = int(capacity)
    shape, n = sent.shape, sent.size
    flat = sent.reshape(-1)
    mask = flat != 0
    words = _pack_bits(mask)
    pc = lax.population_count(words).astype(jnp.int32)
    incl = jnp.cumsum(pc, dtype=jnp.int32)
    selected = incl[-1]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    valid = slot < selected
    word = jnp.searchsorted(incl, slot, side="right").astype(jnp.int32)
    word = jnp.where(valid, word, 0)
    rank = slot - (incl[word] - pc[word])
    idx = jnp.where(valid, word * 32 + _select_bit(words[word], rank), 0)
    values = jnp.where(valid, flat[idx], jnp.zeros((), flat.dtype))
    count = jnp.minimum(selected, capacity).astype(jnp.int32)
    overflow = (selected - count).astype(jnp.int32)

    def give_back(res):
        last = idx[capacity - 1]
        late = jnp.logical_and(mask, jnp.arange(n, dtype=jnp.int32) > last)
        # new_residual is 0 where sent is nonzero: 0 + acc is acc, bit for bit.
        return (res.reshape(-1) + jnp.where(late, flat, jnp.zeros((), flat.dtype))).reshape(shape)

    if capacity >= n:
        res = new_residual
    else:
        res = lax.cond(overflow > 0, give_back, lambda r: r, new_residual)
    return SparseGradient(values, idx, count, overflow, res)


@functools.partial(jax.jit, static_argnames=("shape",))
def densify(values, indices, shape) -> jax.Array:
    """Scatter-add ``values`` at flat ``indices`` into zeros of ``shape`` (the receiver's
    side of a compacted message; unused slots hold value 0 at index 0).

    >>> import jax.numpy as jnp
    >>> densify(jnp.array([2.0, -1.0, 0.0]), jnp.array([1, 3, 0]), (2, 2)).tolist()
    [[0.0, 2.0], [0.0, -1.0]]
    """
    values = jnp.asarray(values)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    out = jnp.zeros((math.prod(shape),), values.dtype).at[indices].add(values)
    return out.reshape(shape)


# ----------------------------------------------------------------------- whole paths


@functools.partial(jax.jit, static_argnames=("density", "capacity", "sample_size", "implementation"))
def threshold_error_feedback(
    grad,
    residual,
    density: float,
    key: jax.Array,
    *,
    capacity: int | None = None,
    sample_size: int | None = None,
    implementation: Implementation | None = None,
) -> SparseGradient:
    """Sparsify ``residual + grad`` to about ``density`` of its entries, with error feedback.

    Sampled threshold (`estimate_threshold`), fused error feedback
    (`fused_error_feedback`), then compaction (`compact`). No sort of size
    ``n``. The count actually selected is reported (it lands near ``k`` but is not
    exactly ``k``).

    Args:
      grad, residual: same shape and floating dtype.
      density: in (0, 1].
      key: ``jax.random`` key for the sample.
      capacity: output slots; default `default_capacity`.
      sample_size: default `default_sample_size`.
      implementation: as in `fused_error_feedback`.

    >>> import jax, jax.numpy as jnp
    >>> g = jax.random.normal(jax.random.key(0), (50_000,))
    >>> out = threshold_error_feedback(g, jnp.zeros_like(g), 0.01, jax.random.key(1))
    >>> 400 < int(out.count) < 600, int(out.overflow)
    (True, 0)
    >>> bool(jnp.array_equal(densify(out.values, out.indices, g.shape) + out.new_residual, g))
    True
    """
    grad, residual = _check_pair(grad, residual)
    density = _check_density(density)
    n = grad.size
    capacity = default_capacity(n, density) if capacity is None else capacity
    t = estimate_threshold(grad, density, key, sample_size=sample_size, residual=residual)
    sent, new_residual, _ = fused_error_feedback(grad, residual, t, implementation=implementation)
    return compact(sent, new_residual, capacity)._replace(threshold=t)


@functools.partial(jax.jit, static_argnames=("k",))
def exact_topk_error_feedback(grad, residual, k: int) -> SparseGradient:
    """The baseline: exactly the ``k`` largest magnitudes of ``residual + grad`` (``lax.top_k``).

    >>> import jax.numpy as jnp
    >>> out = exact_topk_error_feedback(jnp.array([0.5, -3.0, 1.0, 2.0]), jnp.zeros(4), 2)
    >>> out.values.tolist(), out.indices.tolist(), out.new_residual.tolist()
    ([-3.0, 2.0], [1, 3], [0.5, 0.0, 1.0, 0.0])
    """
    grad, residual = _check_pair(grad, residual)
    n = grad.size
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise JaxschedValueError(f"k must be an int in [1, {n}] (the gradient's size), got {k!r}")
    acc = (residual + grad).reshape(-1)
    _, idx = lax.top_k(jnp.abs(acc), int(k))
    idx = idx.astype(jnp.int32)
    values = acc[idx]
    new_residual = acc.at[idx].set(jnp.zeros((), acc.dtype)).reshape(grad.shape)
    return SparseGradient(values, idx, jnp.asarray(k, jnp.int32), jnp.zeros((), jnp.int32), new_residual)
