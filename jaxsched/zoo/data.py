"""Data that needs no download: scikit-learn's bundled digits, and seeded synthetic batches.

Example:
    >>> from jaxsched.zoo.data import load_digits
    >>> split = load_digits()
    >>> split.train_x.shape, split.test_x.shape
    ((1438, 8, 8, 1), (359, 8, 8, 1))
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import numpy as np

from jaxsched._errors import JaxschedValueError

__all__ = [
    "batch_indices",
    "batches",
    "DATASETS",
    "load",
    "load_digits",
    "Split",
    "synthetic_cifar",
    "synthetic_images",
    "synthetic_tokens",
]


class Split(NamedTuple):
    """A fixed train/test split.

    Attributes:
      train_x, train_y: training inputs and integer labels.
      test_x, test_y: held-out inputs and labels (never shuffled into training).
      num_classes: number of label values (the vocabulary for token data).

    Example:
      >>> from jaxsched.zoo import data
      >>> split = data.synthetic_images(n=100)
      >>> len(split.train_x), len(split.test_x), split.num_classes  # a fifth held out
      (80, 20, 10)
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """The 1797 8x8 digit images as NHWC float32 in [0, 1], split by a fixed permutation.

    Args:
      test_fraction: the share held out.
      seed: the permutation's seed.

    Returns:
      The `Split` (10 classes).

    Example:
      >>> from jaxsched.zoo import data
      >>> split = data.load_digits()
      >>> split.train_x.shape, float(split.train_x.max())
      ((1438, 8, 8, 1), 1.0)
    """
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train], x[test], y[test], 10)


def synthetic_images(n: int = 4096, shape: tuple[int, ...] = (8, 8, 1), num_classes: int = 10, seed: int = 0) -> Split:
    """Gaussian images labelled by a random linear teacher, so they are learnable.

    Args:
      n: examples, train and test together (a fifth is the test set).
      shape: one image's shape.
      num_classes: label values.
      seed: the data's seed.

    Returns:
      The `Split`.

    Example:
      >>> from jaxsched.zoo import data
      >>> split = data.synthetic_images(n=100, shape=(4, 4, 1), num_classes=3)
      >>> split.train_x.shape, sorted(set(split.train_y.tolist()))
      ((80, 4, 4, 1), [0, 1, 2])
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), num_classes)).astype(np.float32)
    y = np.argmax(x.reshape(n, -1) @ teacher, axis=1).astype(np.int32)
    cut = n - n // 5
    return Split(x[:cut], y[:cut], x[cut:], y[cut:], num_classes)


def synthetic_tokens(n: int = 2048, seq_len: int = 32, vocab_size: int = 64, seed: int = 0) -> Split:
    """Token sequences from a random sparse Markov chain; x is a sequence, y it shifted by one.

    Each token has two possible successors, so a language model can learn the chain down
    to a loss of about ``log 2``.

    Args:
      n: sequences, train and test together (a fifth is the test set).
      seq_len: tokens per sequence.
      vocab_size: the vocabulary.
      seed: the chain's and the data's seed.

    Returns:
      The `Split` (``num_classes`` is the vocabulary).

    Example:
      >>> from jaxsched.zoo import data
      >>> split = data.synthetic_tokens(n=10, seq_len=6, vocab_size=16)
      >>> split.train_x.shape, bool((split.train_x[:, 1:] == split.train_y[:, :-1]).all())
      ((8, 6), True)
    """
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 2))
    tokens = np.empty((n, seq_len + 1), dtype=np.int32)
    tokens[:, 0] = rng.integers(0, vocab_size, size=n)
    for t in range(seq_len):
        choice = rng.integers(0, 2, size=n)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    x, y = tokens[:, :-1], tokens[:, 1:]
    cut = n - n // 5
    return Split(x[:cut], y[:cut], x[cut:], y[cut:], vocab_size)


def synthetic_cifar(n: int = 4096, num_classes: int = 10, size: int = 32, noise: float = 0.5, seed: int = 0) -> Split:
    """CIFAR-shaped images (``size x size x 3``): each class a coloured grating of its own
    orientation and frequency, at a random phase, under Gaussian noise.

    Why gratings: the structure is translation invariant, so a convolutional model with
    global pooling can learn it (a random linear teacher, as in `synthetic_images`,
    is not), and nothing needs a download.

    Args:
      n: examples, train and test together (a fifth is the test set).
      num_classes: label values.
      size: the images' height and width.
      noise: the standard deviation of the Gaussian noise.
      seed: the data's seed.

    Returns:
      The `Split`.

    Example:
      >>> from jaxsched.zoo import data
      >>> data.synthetic_cifar(n=10, size=8).train_x.shape
      (8, 8, 8, 3)
    """
    rng = np.random.default_rng(seed)
    angle = rng.uniform(0, np.pi, num_classes)
    freq = rng.uniform(0.2, 0.8, num_classes)  # radians per pixel
    colour = rng.uniform(-1, 1, (num_classes, 3))
    y = rng.integers(0, num_classes, n).astype(np.int32)
    phase = rng.uniform(0, 2 * np.pi, n)
    rows, cols = np.mgrid[:size, :size].astype(np.float32)
    along = np.cos(angle[y])[:, None, None] * cols + np.sin(angle[y])[:, None, None] * rows
    wave = np.sin(freq[y][:, None, None] * along + phase[:, None, None]).astype(np.float32)
    x = wave[..., None] * colour[y][:, None, None, :].astype(np.float32)
    x += noise * rng.standard_normal(x.shape, dtype=np.float32)
    cut = n - n // 5
    return Split(x[:cut], y[:cut], x[cut:], y[cut:], num_classes)


DATASETS = ("digits", "synthetic_images", "synthetic_tokens", "synthetic_cifar")


def load(name: str, seed: int = 0, **options) -> Split:
    """Load a data set by name (what a demo config's ``data.name`` gives).

    Args:
      name: one of `DATASETS`.
      seed: the data's seed.
      **options: the loader's own options (``n=``, ``seq_len=`` ...).

    Returns:
      The `Split`.

    Raises:
      JaxschedValueError: an unknown name.

    Example:
      >>> from jaxsched.zoo import data
      >>> data.load("synthetic_tokens", n=10, seq_len=4).train_x.shape
      (8, 4)
    """
    loaders: dict[str, Callable[..., Split]] = {
        "digits": load_digits,
        "synthetic_images": synthetic_images,
        "synthetic_tokens": synthetic_tokens,
        "synthetic_cifar": synthetic_cifar,
    }
    if name not in loaders:
        raise JaxschedValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    return loaders[name](seed=seed, **options)


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless shuffled minibatches of exactly ``batch_size`` (epochs reshuffled, tail dropped).

    One shape for every batch, so a jitted step compiles once.

    Args:
      x: inputs.
      y: labels.
      batch_size: examples per batch (at most ``len(x)``).
      seed: the shuffling's seed.

    Returns:
      An endless iterator of ``(x, y)`` batches.

    Raises:
      JaxschedValueError: ``batch_size`` larger than the data.

    Example:
      >>> import itertools
      >>> from jaxsched.zoo import data
      >>> split = data.synthetic_images(n=100)
      >>> [xb.shape[0] for xb, _ in itertools.islice(data.batches(split.train_x, split.train_y, 32), 4)]
      [32, 32, 32, 32]
    """
    if batch_size > len(x):
        raise JaxschedValueError(f"batch_size={batch_size} exceeds the {len(x)} training examples")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield x[idx], y[idx]


def batch_indices(n: int, batch_size: int, step: int, seed: int = 0) -> np.ndarray:
    """Which of ``n`` examples make up step ``step``'s batch: epoch ``step // (n // batch_size)``
    is a permutation seeded by ``(seed, epoch)``, cut into batches (tail dropped).

    Why: a function of ``(seed, step)`` alone, so a run resumed from a checkpoint at any
    step sees exactly the batches an uninterrupted run would.

    Example:
        >>> batch_indices(10, 4, step=0).tolist() == batch_indices(10, 4, step=0).tolist()
        True
        >>> sorted(batch_indices(10, 5, step=0).tolist() + batch_indices(10, 5, step=1).tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    if not 0 < batch_size <= n:
        raise JaxschedValueError(f"batch_size={batch_size} must be in 1..{n} (the training examples)")
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[k * batch_size : (k + 1) * batch_size]
