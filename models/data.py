"""Offline datasets as numpy arrays, and deterministic, resumable batching.

Datasets (no downloads; everything is on disk already):

* :func:`digits`: scikit-learn's bundled 8x8 handwritten digits.
* :func:`text_corpus`: English text shipped with Python (``pydoc_data``) or a
  UTF-8 file, as int32 character ids and a vocabulary.
* :func:`cifar10`: the CIFAR-10 "python version" pickles from a directory the
  user supplies, read with an unpickler that refuses every global but the few
  numpy constructors the files need.

Each dataset split is a dict of equal-length numpy arrays (``image`` and
``label``, or ``inputs`` and ``targets``), the form :func:`batches` takes.

Batching: the batch at step ``s`` is a pure function of ``(seed, s)``. Epoch
``e`` visits the examples in the order of a permutation seeded by
``(seed, e)``, so a run resumed at ``start_step=s`` sees exactly the batches
the uninterrupted run would have: the data position is the step number.
"""

import os
import pickle
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]

# ------------------------------------------------------------------- digits


def digits(*, test_fraction: float = 0.2, seed: int = 0) -> tuple[Arrays,
                                                                 Arrays]:
  """scikit-learn's 1797 handwritten digits, split into train and test.

  The split is stratified by class and fixed by ``seed``. Pixels (0..16 in
  the source) are scaled to [0, 1].

  Args:
    test_fraction: fraction of examples held out for testing.
    seed: seed of the split.

  Returns:
    ``(train, test)``, each ``{"image": float32 (N, 8, 8, 1), "label": int32
    (N,)}`` with labels in 0..9; 1437 train and 360 test examples by default.
  """
  from sklearn import datasets
  from sklearn import model_selection

  bunch = datasets.load_digits()
  images = (bunch.images / 16.0).astype(np.float32)[..., None]
  labels = bunch.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
      images, labels, test_size=test_fraction, random_state=seed,
      stratify=labels)
  return {"image": x_tr, "label": y_tr}, {"image": x_te, "label": y_te}


# --------------------------------------------------------------------- text


def _default_text() -> str:
  from pydoc_data import topics

  return "".join(topics.topics[key] for key in sorted(topics.topics))


def text_corpus(path: str | os.PathLike | None = None) -> tuple[np.ndarray,
                                                                str]:
  """A character-level corpus: int32 ids and their vocabulary.

  Args:
    path: a UTF-8 text file. ``None`` uses the help texts that ship with
      Python (``pydoc_data.topics.topics``, joined in sorted key order: about
      465k characters of English on Python 3.11; the exact text follows the
      Python version).

  Returns:
    ``(ids, vocab)``: ``vocab`` is a ``str`` of the sorted unique characters
    and ``ids`` an int32 array with ``vocab[ids[i]] == text[i]``.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the text is empty.
  """
  if path is None:
    text = _default_text()
  else:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  if not text:
    raise ValueError(f"empty text corpus: {path}")
  vocab = "".join(sorted(set(text)))
  return encode(text, vocab), vocab


def _code_points(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def encode(text: str, vocab: str) -> np.ndarray:
  """Maps each character of ``text`` to its index in ``vocab`` (int32).

  Raises:
    ValueError: ``text`` has characters that are not in ``vocab``.
  """
  if not vocab:
    raise ValueError("vocab is empty")
  vocab_codes = _code_points(vocab)
  order = np.argsort(vocab_codes, kind="stable")
  sorted_codes = vocab_codes[order]
  codes = _code_points(text)
  pos = np.minimum(np.searchsorted(sorted_codes, codes), len(vocab) - 1)
  unknown = sorted_codes[pos] != codes
  if unknown.any():
    missing = "".join(sorted(set(np.asarray(list(text))[unknown][:1000])))
    raise ValueError(f"characters not in vocab: {missing!r}")
  return order[pos].astype(np.int32)


def decode(ids: np.ndarray, vocab: str) -> str:
  """Inverse of :func:`encode`: the string of characters ``vocab[ids]``."""
  ids = np.asarray(ids)
  return _code_points(vocab)[ids.reshape(-1)].tobytes().decode("utf-32-le")


def char_sequences(ids: np.ndarray, seq_len: int) -> Arrays:
  """Cuts ``ids`` into non-overlapping next-character training sequences.

  Args:
    ids: int token ids, shape ``(L,)``.
    seq_len: length T of each sequence.

  Returns:
    ``{"inputs": (M, T), "targets": (M, T)}`` int32, ``M = (L - 1) // T``,
    with ``targets[m, t] == inputs[m, t + 1]`` inside a row (the target is the
    next character). Feed it to :func:`batches`.

  Raises:
    ValueError: ``ids`` is too short for one sequence.
  """
  ids = np.asarray(ids, dtype=np.int32).reshape(-1)
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  count = (len(ids) - 1) // seq_len
  if count < 1:
    raise ValueError(
        f"{len(ids)} ids are too few for one sequence of length {seq_len}")
  n = count * seq_len
  return {"inputs": ids[:n].reshape(count, seq_len),
          "targets": ids[1:n + 1].reshape(count, seq_len)}


def char_batches(ids: np.ndarray, seq_len: int, batch_size: int, *,
                 seed: int, num_shards: int,
                 start_step: int = 0) -> Iterator[Arrays]:
  """Batches of ``{"inputs", "targets"}``, each ``(batch_size, seq_len)``.

  ``batches(char_sequences(ids, seq_len), batch_size, ...)``: see both.
  """
  return batches(char_sequences(ids, seq_len), batch_size, seed=seed,
                 num_shards=num_shards, start_step=start_step)


# ------------------------------------------------------------------ CIFAR-10

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog",
                   "frog", "horse", "ship", "truck")
_CIFAR_PIXELS = 32 * 32 * 3


def _numpy_globals() -> dict[tuple[str, str], Any]:
  """The globals a pickled numpy array needs, by (module, name)."""
  try:  # numpy >= 2 (numpy 1.26 also has the _core shim)
    from numpy._core import multiarray
    from numpy._core import numeric
  except ImportError:  # pragma: no cover
    from numpy.core import multiarray
    from numpy.core import numeric

  allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
  # The module is named numpy.core in pickles written by numpy < 2 (and by
  # Python 2, as the CIFAR-10 files were) and numpy._core since numpy 2.
  for core in ("numpy.core", "numpy._core"):
    # Protocols <= 4: _reconstruct(ndarray, shape, dtype) + __setstate__.
    allowed[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct
    # Protocol 5: _frombuffer(buffer, dtype, shape, order).
    allowed[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer
  return allowed


class RestrictedUnpickler(pickle.Unpickler):
  """An unpickler that can rebuild numpy arrays and plain Python data only.

  ``find_class`` admits only the exact globals in :func:`_numpy_globals`
  (``numpy.ndarray``, ``numpy.dtype``, ``numpy[._]core.multiarray.
  _reconstruct`` and ``numpy[._]core.numeric._frombuffer``); any other global,
  which is how a pickle runs code (``os.system``, ``builtins.eval``,
  ``subprocess.Popen`` ...), raises ``pickle.UnpicklingError`` before it is
  imported or called. Built-in containers, numbers, strings and bytes need no
  globals. Persistent ids are refused by ``pickle.Unpickler`` itself.

  See https://docs.python.org/3/library/pickle.html#restricting-globals.
  """

  _ALLOWED = _numpy_globals()

  def find_class(self, module: str, name: str) -> Any:
    try:
      return self._ALLOWED[(module, name)]
    except KeyError:
      raise pickle.UnpicklingError(
          f"refused global {module}.{name}: this loader only admits "
          f"{', '.join(sorted(f'{m}.{n}' for m, n in self._ALLOWED))}"
      ) from None


def restricted_load(path: str | os.PathLike) -> Any:
  """Unpickles ``path`` with :class:`RestrictedUnpickler`.

  Python 2 ``str`` objects (which the CIFAR-10 files are full of) come back
  as ``bytes`` (``encoding="bytes"``), as numpy expects for array data.
  """
  with open(path, "rb") as f:
    return RestrictedUnpickler(f, encoding="bytes").load()


def _get_key(batch: Mapping[Any, Any], key: str, path: str) -> Any:
  for k in (key.encode(), key):
    if k in batch:
      return batch[k]
  raise ValueError(f"{path}: missing key {key.encode()!r} "
                   f"(found keys: {sorted(map(repr, batch))})")


def load_cifar10_batch(path: str | os.PathLike) -> tuple[np.ndarray,
                                                          np.ndarray]:
  """Reads one CIFAR-10 batch file.

  The file is a pickled dict: ``b'data'``, a uint8 array ``(N, 3072)`` whose
  rows hold the red, green and blue 32x32 planes one after the other, each
  row-major, and ``b'labels'``, N ints in 0..9 (other keys are ignored).

  Returns:
    ``(images, labels)``: uint8 ``(N, 32, 32, 3)`` (HWC) and int32 ``(N,)``.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    pickle.UnpicklingError: the pickle names a global other than the numpy
      constructors :class:`RestrictedUnpickler` admits.
    ValueError: the content is not a CIFAR-10 batch (what does not match is
      named in the message).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"CIFAR-10 batch file not found: {path}")
  try:
    batch = restricted_load(path)
  except EOFError as e:
    raise ValueError(f"{path}: truncated or empty pickle") from e
  if not isinstance(batch, dict):
    raise ValueError(
        f"{path}: expected a pickled dict, got {type(batch).__name__}")
  data = _get_key(batch, "data", path)
  labels = _get_key(batch, "labels", path)
  if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
    raise ValueError(f"{path}: b'data' must be a uint8 numpy array, got "
                     f"{getattr(data, 'dtype', type(data).__name__)}")
  if data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
    raise ValueError(f"{path}: b'data' must have shape (N, {_CIFAR_PIXELS}),"
                     f" got {data.shape}")
  try:
    labels = np.asarray(labels)
  except ValueError as e:  # ragged nesting
    raise ValueError(f"{path}: b'labels' is not a flat list of ints") from e
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"{path}: b'labels' must be a flat list of ints, got "
                     f"dtype {labels.dtype} and shape {labels.shape}")
  if len(labels) != len(data):
    raise ValueError(f"{path}: {len(labels)} labels for {len(data)} images")
  if len(labels) and (labels.min() < 0 or labels.max() >= 10):
    raise ValueError(f"{path}: labels must be in 0..9, got "
                     f"{labels.min()}..{labels.max()}")
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images), labels.astype(np.int32)


def cifar10(data_dir: str | os.PathLike, *,
            normalize: bool = False) -> tuple[Arrays, Arrays]:
  """CIFAR-10 from the python-pickle batches in ``data_dir``.

  ``data_dir`` holds ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``
  as extracted from ``cifar-10-python.tar.gz``, or is the directory that
  contains the extracted ``cifar-10-batches-py``. Nothing is downloaded.

  Args:
    data_dir: the directory described above.
    normalize: if True, subtract the training set's per-channel mean and
      divide by its per-channel standard deviation; else pixels are in [0, 1].

  Returns:
    ``(train, test)``, each ``{"image": float32 (N, 32, 32, 3), "label":
    int32 (N,)}``; 50000 and 10000 examples for the real dataset.

  Raises:
    FileNotFoundError: the directory or one of the six files is missing (the
      message names the expected path).
    pickle.UnpicklingError: a file names a global the loader does not admit.
    ValueError: a file's content is not a CIFAR-10 batch.
  """
  root = os.fspath(data_dir)
  if not os.path.isdir(root):
    raise FileNotFoundError(
        f"CIFAR-10 directory not found: {root} (expected it to hold "
        f"{', '.join(CIFAR10_TRAIN_FILES)} and {CIFAR10_TEST_FILE})")
  nested = os.path.join(root, "cifar-10-batches-py")
  if (not os.path.exists(os.path.join(root, CIFAR10_TRAIN_FILES[0]))
      and os.path.isdir(nested)):
    root = nested

  def load(names):
    parts = [load_cifar10_batch(os.path.join(root, n)) for n in names]
    images = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
    return {"image": images,
            "label": np.concatenate([p[1] for p in parts])}

  train = load(CIFAR10_TRAIN_FILES)
  test = load([CIFAR10_TEST_FILE])
  if normalize:
    mean = train["image"].mean(axis=(0, 1, 2), dtype=np.float64)
    std = train["image"].std(axis=(0, 1, 2), dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    for split in (train, test):
      split["image"] = ((split["image"] - mean) / std).astype(np.float32)
  return train, test


# ---------------------------------------------------------------- batching


def _num_examples(arrays: Mapping[str, np.ndarray]) -> int:
  if not arrays:
    raise ValueError("arrays is empty: give a dict of equal-length arrays")
  lengths = {k: len(v) for k, v in arrays.items()}
  if len(set(lengths.values())) != 1:
    raise ValueError(f"arrays differ in length: {lengths}")
  return next(iter(lengths.values()))


def _check_batch_size(batch_size: int, num_shards: int) -> None:
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  if batch_size < 1 or batch_size % num_shards:
    raise ValueError(f"batch_size={batch_size} must be a positive multiple "
                     f"of num_shards={num_shards}")


def epoch_permutation(num_examples: int, epoch: int, *,
                      seed: int) -> np.ndarray:
  """The example order of ``epoch``: a permutation seeded by (seed, epoch)."""
  rng = np.random.default_rng(np.random.SeedSequence([seed, epoch]))
  return rng.permutation(num_examples)


def batch_indices(num_examples: int, batch_size: int, step: int, *,
                  seed: int) -> np.ndarray:
  """Indices of the examples in the global batch of ``step``.

  With ``k = num_examples // batch_size`` batches per epoch, step ``s`` is
  batch ``s % k`` of epoch ``s // k``; the last ``num_examples % batch_size``
  examples of each epoch's permutation are skipped (different ones each
  epoch).
  """
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  per_epoch = num_examples // batch_size
  if per_epoch < 1:
    raise ValueError(
        f"batch_size={batch_size} exceeds the {num_examples} examples")
  epoch, i = divmod(step, per_epoch)
  perm = epoch_permutation(num_examples, epoch, seed=seed)
  return perm[i * batch_size:(i + 1) * batch_size]


def batches(arrays: Mapping[str, np.ndarray], batch_size: int, *, seed: int,
            num_shards: int, start_step: int = 0) -> Iterator[Arrays]:
  """Endless shuffled global batches, a pure function of (seed, step).

  The ``n``-th batch yielded is the batch of step ``start_step + n``, with
  the examples ``batch_indices(N, batch_size, step, seed=seed)``. Resuming
  at ``start_step=k`` therefore gives exactly the batches an uninterrupted
  iterator gives after its first ``k``. Shard ``j`` of ``num_shards`` (a
  device or a process) gets rows ``[j * b, (j + 1) * b)``, ``b = batch_size
  // num_shards``, the layout of a batch sharded on its leading axis.

  Args:
    arrays: dict of arrays with a common leading (example) axis.
    batch_size: global batch size, a multiple of ``num_shards``.
    seed: non-negative int; epochs are shuffled with seeds derived from
      ``(seed, epoch)``.
    num_shards: how many equal parts the batch is split into downstream.
    start_step: the step of the first batch yielded.

  Yields:
    ``{key: array[indices]}`` with leading dimension ``batch_size``.

  Raises:
    ValueError: bad sizes (checked on the call, not on the first ``next``).

  Example:
    >>> import numpy as np
    >>> data = {"x": np.arange(10)}
    >>> it = batches(data, 4, seed=0, num_shards=2, start_step=3)
    >>> next(it)["x"].shape
    (4,)
  """
  n = _num_examples(arrays)
  _check_batch_size(batch_size, num_shards)
  if batch_size > n:
    raise ValueError(f"batch_size={batch_size} exceeds the {n} examples")
  if start_step < 0:
    raise ValueError(f"start_step must be >= 0, got {start_step}")
  arrays = {k: np.asarray(v) for k, v in arrays.items()}

  def generate():
    per_epoch = n // batch_size
    step, perm_epoch, perm = start_step, None, None
    while True:
      epoch, i = divmod(step, per_epoch)
      if epoch != perm_epoch:
        perm_epoch, perm = epoch, epoch_permutation(n, epoch, seed=seed)
      idx = perm[i * batch_size:(i + 1) * batch_size]
      yield {k: v[idx] for k, v in arrays.items()}
      step += 1

  return generate()


def eval_batches(arrays: Mapping[str, np.ndarray], batch_size: int, *,
                 num_shards: int = 1) -> Iterator[Arrays]:
  """One ordered pass over ``arrays`` in full-size batches, plus a ``mask``.

  The last batch is padded with zeros to ``batch_size`` so that every batch
  has one shape (one compilation, even shards); ``mask`` (bool, shape
  ``(batch_size,)``) is False on the padding. The losses of
  :func:`models.make_loss_fn` honour ``batch["mask"]``.

  Raises:
    ValueError: bad sizes, or ``arrays`` already has a ``mask`` key.
  """
  n = _num_examples(arrays)
  _check_batch_size(batch_size, num_shards)
  if "mask" in arrays:
    raise ValueError("arrays already has a 'mask' key")
  arrays = {k: np.asarray(v) for k, v in arrays.items()}

  def generate():
    for start in range(0, n, batch_size):
      stop = min(start + batch_size, n)
      pad = batch_size - (stop - start)
      batch = {}
      for k, v in arrays.items():
        part = v[start:stop]
        if pad:
          part = np.concatenate([part, np.zeros((pad,) + v.shape[1:], v.dtype)])
        batch[k] = part
      batch["mask"] = np.arange(batch_size) < stop - start
      yield batch

  return generate()


def local_slice(batch: Mapping[str, np.ndarray], process_index: int,
                process_count: int) -> Arrays:
  """The rows of a global batch that process ``process_index`` feeds.

  Process ``p`` of ``P`` takes rows ``[p * B / P, (p + 1) * B / P)`` of every
  array, the per-process data that ``jax.make_array_from_process_local_data``
  expects when each process's devices hold consecutive shards of the batch
  axis. Every process builds the same global batch (same seed and step) and
  keeps its slice, so no data moves between processes.

  Raises:
    ValueError: ``process_index`` out of range, or a batch dimension not
      divisible by ``process_count``.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in "
                     f"[0, {process_count})")
  out = {}
  for k, v in batch.items():
    size, rem = divmod(len(v), process_count)
    if rem:
      raise ValueError(f"batch[{k!r}] has {len(v)} rows, not divisible by "
                       f"process_count={process_count}")
    out[k] = v[process_index * size:(process_index + 1) * size]
  return out
