"""Tests for models.data: datasets, the safe CIFAR loader and batching."""

import os
import pickle
import shlex
import struct

import chex
import numpy as np
import pytest

from models import data

# ------------------------------------------------------------------- digits


def test_digits_shapes_classes_and_determinism():
  train, test = data.digits()
  assert set(train) == set(test) == {"image", "label"}
  chex.assert_shape(train["image"], (1437, 8, 8, 1))
  chex.assert_shape(test["image"], (360, 8, 8, 1))
  assert train["image"].dtype == np.float32
  assert train["label"].dtype == np.int32
  assert 0.0 <= train["image"].min() and train["image"].max() <= 1.0
  assert set(np.unique(train["label"])) == set(range(10))
  assert set(np.unique(test["label"])) == set(range(10))
  again, _ = data.digits()
  chex.assert_trees_all_equal(train, again)
  other, _ = data.digits(seed=1)
  assert not np.array_equal(train["label"], other["label"])


# --------------------------------------------------------------------- text


def test_text_corpus_default_round_trip():
  from pydoc_data import topics

  ids, vocab = data.text_corpus()
  text = "".join(topics.topics[k] for k in sorted(topics.topics))
  assert len(ids) == len(text) > 400_000
  assert ids.dtype == np.int32
  assert vocab == "".join(sorted(set(text)))
  assert 0 <= ids.min() and ids.max() == len(vocab) - 1
  assert data.decode(ids, vocab) == text
  np.testing.assert_array_equal(data.encode(text[:1000], vocab), ids[:1000])


def test_text_corpus_from_file_with_unicode(tmp_path):
  path = tmp_path / "corpus.txt"
  text = "naïve café — 東京\nabc\n"
  path.write_text(text, encoding="utf-8")
  ids, vocab = data.text_corpus(path)
  assert vocab == "".join(sorted(set(text)))
  assert [vocab[i] for i in ids] == list(text)
  assert data.decode(ids, vocab) == text
  with pytest.raises(ValueError, match="not in vocab"):
    data.encode("xyz", vocab)
  with pytest.raises(FileNotFoundError):
    data.text_corpus(tmp_path / "missing.txt")
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError, match="empty"):
    data.text_corpus(tmp_path / "empty.txt")


def test_char_sequences_and_batches():
  ids = np.arange(23, dtype=np.int32)
  seqs = data.char_sequences(ids, 5)
  chex.assert_shape(seqs["inputs"], (4, 5))
  np.testing.assert_array_equal(seqs["inputs"].ravel(), ids[:20])
  np.testing.assert_array_equal(seqs["targets"].ravel(), ids[1:21])
  batch = next(data.char_batches(ids, 5, 2, seed=0, num_shards=2))
  chex.assert_shape([batch["inputs"], batch["targets"]], [(2, 5)] * 2)
  np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
  with pytest.raises(ValueError, match="too few"):
    data.char_sequences(ids[:3], 5)


# ------------------------------------------------------------------ CIFAR-10


def _py2_pickle(images: np.ndarray, labels: list[int]) -> bytes:
  """A protocol-2 pickle as Python 2's cPickle wrote the CIFAR-10 batches.

  Hand-assembled opcodes: py2 ``str`` objects (SHORT_BINSTRING/BINSTRING),
  ``numpy.core.multiarray._reconstruct`` and an ndarray ``__setstate__``.
  """
  def s(b: bytes) -> bytes:  # a py2 str
    if len(b) < 256:
      return b"U" + bytes([len(b)]) + b
    return b"T" + struct.pack("<i", len(b)) + b

  n = images.shape[0]
  arr = (b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n"
         + b"K\x00\x85" + s(b"b") + b"\x87R"
         + b"(K\x01" + b"M" + struct.pack("<H", n) + b"M"
         + struct.pack("<H", 3072) + b"\x86"
         + b"cnumpy\ndtype\n" + s(b"u1") + b"K\x00K\x01\x87R"
         + b"(K\x03" + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
         + b"\x89" + s(images.tobytes()) + b"tb")
  lab = b"](" + b"".join(b"K" + bytes([v]) for v in labels) + b"e"
  return (b"\x80\x02}(" + s(b"batch_label") + s(b"testing batch 1 of 1")
          + s(b"data") + arr + s(b"labels") + lab + s(b"filenames")
          + b"](" + s(b"a.png") + b"e" + b"u.")


def _fake_batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 256, (n, 3072), dtype=np.uint8),
          [int(v) for v in rng.integers(0, 10, n)])


def _write_cifar_dir(root, sizes=(3, 2, 2, 2, 1, 4), protocol=None):
  """Writes data_batch_1..5 and test_batch; returns {name: (data, labels)}."""
  os.makedirs(root, exist_ok=True)
  names = list(data.CIFAR10_TRAIN_FILES) + [data.CIFAR10_TEST_FILE]
  written = {}
  for i, (name, n) in enumerate(zip(names, sizes, strict=True)):
    pixels, labels = _fake_batch(n, i)
    with open(os.path.join(root, name), "wb") as f:
      if protocol == "py2":
        f.write(_py2_pickle(pixels, labels))
      else:
        pickle.dump({b"batch_label": b"x", b"data": pixels, b"labels": labels,
                     b"filenames": [b"f.png"] * n}, f, protocol=protocol)
    written[name] = (pixels, labels)
  return written


def _expected_hwc(pixels: np.ndarray) -> np.ndarray:
  """Pixel (n, h, w, c) is byte c * 1024 + h * 32 + w of row n."""
  n, h, w, c = np.indices((len(pixels), 32, 32, 3))
  return pixels[n, c * 1024 + h * 32 + w]


def test_py2_pickle_helper_is_a_valid_pickle():
  pixels, labels = _fake_batch(2, 0)
  loaded = pickle.loads(_py2_pickle(pixels, labels), encoding="bytes")
  np.testing.assert_array_equal(loaded[b"data"], pixels)
  assert loaded[b"labels"] == labels
  assert loaded[b"filenames"] == [b"a.png"]


@pytest.mark.parametrize("protocol", ["py2", 4, 5])
def test_cifar10_layout_and_labels(tmp_path, protocol):
  written = _write_cifar_dir(tmp_path, protocol=protocol)
  train, test = data.cifar10(tmp_path)
  train_pixels = np.concatenate(
      [written[n][0] for n in data.CIFAR10_TRAIN_FILES])
  train_labels = sum((written[n][1] for n in data.CIFAR10_TRAIN_FILES), [])
  chex.assert_shape(train["image"], (10, 32, 32, 3))
  chex.assert_shape(test["image"], (4, 32, 32, 3))
  assert train["image"].dtype == np.float32
  assert train["label"].dtype == np.int32
  np.testing.assert_allclose(train["image"],
                             _expected_hwc(train_pixels) / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(train["label"], train_labels)
  np.testing.assert_allclose(
      test["image"], _expected_hwc(written["test_batch"][0]) / 255.0,
      rtol=1e-6)
  # The red plane is the first 1024 bytes, row-major.
  np.testing.assert_allclose(train["image"][0, 0, :, 0] * 255.0,
                             train_pixels[0, :32], rtol=1e-6)
  np.testing.assert_allclose(train["image"][0, 1, 0, 2] * 255.0,
                             train_pixels[0, 2048 + 32], rtol=1e-6)


def test_cifar10_normalize_and_nested_dir(tmp_path):
  _write_cifar_dir(tmp_path / "cifar-10-batches-py")
  raw, _ = data.cifar10(tmp_path)
  train, test = data.cifar10(tmp_path, normalize=True)
  np.testing.assert_allclose(train["image"].mean(axis=(0, 1, 2)), 0.0,
                             atol=1e-5)
  np.testing.assert_allclose(train["image"].std(axis=(0, 1, 2)), 1.0,
                             atol=1e-4)
  mean = raw["image"].mean(axis=(0, 1, 2))
  std = raw["image"].std(axis=(0, 1, 2))
  np.testing.assert_allclose(train["image"], (raw["image"] - mean) / std,
                             rtol=1e-4, atol=1e-5)
  assert test["image"].dtype == np.float32


def test_cifar10_missing_directory_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="data_batch_1"):
    data.cifar10(tmp_path / "nowhere")
  _write_cifar_dir(tmp_path)
  os.remove(tmp_path / "data_batch_4")
  with pytest.raises(FileNotFoundError, match="data_batch_4"):
    data.cifar10(tmp_path)
  _write_cifar_dir(tmp_path)
  os.remove(tmp_path / "test_batch")
  with pytest.raises(FileNotFoundError, match="test_batch"):
    data.cifar10(tmp_path)


@pytest.mark.parametrize("content,message", [
    ({b"labels": [1]}, "missing key b'data'"),
    ({b"data": np.zeros((1, 3072), np.uint8)}, "missing key b'labels'"),
    ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [1, 2]},
     r"shape \(N, 3072\)"),
    ({b"data": np.zeros((1, 3072), np.float32), b"labels": [1]}, "uint8"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]},
     "1 labels for 2 images"),
    ({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}, "0..9"),
    ({b"data": np.zeros((1, 3072), np.uint8), b"labels": ["a"]},
     "flat list of ints"),
    ([1, 2, 3], "expected a pickled dict"),
])
def test_cifar10_malformed_content(tmp_path, content, message):
  path = tmp_path / "data_batch_1"
  with open(path, "wb") as f:
    pickle.dump(content, f)
  with pytest.raises(ValueError, match=message):
    data.load_cifar10_batch(path)


def test_cifar10_truncated_file(tmp_path):
  pixels, labels = _fake_batch(2, 0)
  path = tmp_path / "data_batch_1"
  path.write_bytes(pickle.dumps({b"data": pixels, b"labels": labels})[:100])
  with pytest.raises((ValueError, pickle.UnpicklingError)):
    data.load_cifar10_batch(path)


class _Exploit:
  """Unpickling this would run ``touch <evidence>`` through os.system."""

  def __init__(self, evidence):
    self.evidence = evidence

  def __reduce__(self):
    return (os.system, (f"touch {shlex.quote(str(self.evidence))}",))


def test_malicious_pickle_is_refused_without_running(tmp_path):
  evidence = tmp_path / "pwned"
  pixels, labels = _fake_batch(1, 0)
  payload = pickle.dumps({b"data": pixels, b"labels": labels,
                          b"filenames": _Exploit(evidence)})
  _write_cifar_dir(tmp_path)
  (tmp_path / "data_batch_2").write_bytes(payload)

  with pytest.raises(pickle.UnpicklingError, match=r"refused global \S*system"):
    data.load_cifar10_batch(tmp_path / "data_batch_2")
  with pytest.raises(pickle.UnpicklingError, match="refused global"):
    data.cifar10(tmp_path)
  assert not evidence.exists()

  # The payload is real: an unrestricted load runs it.
  pickle.loads(payload)
  assert evidence.exists()


@pytest.mark.parametrize("global_name", [
    b"builtins\neval\n", b"numpy\nload\n", b"numpy.core.multiarray\nscalar\n",
    b"subprocess\nPopen\n", b"numpy.testing\nrun_module_suite\n"])
def test_restricted_unpickler_refuses_other_globals(tmp_path, global_name):
  path = tmp_path / "data_batch_1"
  path.write_bytes(b"\x80\x02c" + global_name + b".")
  module, name = global_name.decode().split()
  with pytest.raises(pickle.UnpicklingError,
                     match=rf"refused global {module}\.{name}"):
    data.restricted_load(path)


# ---------------------------------------------------------------- batching


def _arrays(n=10):
  return {"x": np.arange(n) * 10, "y": np.arange(n)}


def _take(it, k):
  return [next(it) for _ in range(k)]


def test_batches_deterministic_and_consistent():
  first = _take(data.batches(_arrays(), 4, seed=3, num_shards=2), 7)
  again = _take(data.batches(_arrays(), 4, seed=3, num_shards=2), 7)
  chex.assert_trees_all_equal(first, again)
  other = _take(data.batches(_arrays(), 4, seed=4, num_shards=2), 7)
  assert not all(np.array_equal(a["y"], b["y"])
                 for a, b in zip(first, other, strict=True))
  for step, batch in enumerate(first):
    chex.assert_shape([batch["x"], batch["y"]], [(4,), (4,)])
    np.testing.assert_array_equal(batch["x"], batch["y"] * 10)
    np.testing.assert_array_equal(
        batch["y"], data.batch_indices(10, 4, step, seed=3))


def test_batches_epochs_are_reshuffled_permutations():
  # 10 examples, batch 4: 2 batches per epoch, 2 examples skipped per epoch.
  got = _take(data.batches(_arrays(), 4, seed=0, num_shards=1), 8)
  epochs = [np.concatenate([b["y"] for b in got[i:i + 2]])
            for i in range(0, 8, 2)]
  for e, seen in enumerate(epochs):
    assert len(set(seen.tolist())) == 8  # no repeats within an epoch
    np.testing.assert_array_equal(
        seen, data.epoch_permutation(10, e, seed=0)[:8])
  assert len({tuple(e) for e in epochs}) == 4  # each epoch's order differs


@pytest.mark.parametrize("start_step", [0, 1, 2, 5, 11])
def test_batches_resume_equals_skipping(start_step):
  full = _take(data.batches(_arrays(), 4, seed=7, num_shards=4), 14)
  resumed = _take(data.batches(_arrays(), 4, seed=7, num_shards=4,
                               start_step=start_step), 14 - start_step)
  chex.assert_trees_all_equal(resumed, full[start_step:])


def test_batches_bad_arguments():
  with pytest.raises(ValueError, match="multiple of num_shards=4"):
    data.batches(_arrays(), 6, seed=0, num_shards=4)
  with pytest.raises(ValueError, match="exceeds"):
    data.batches(_arrays(), 12, seed=0, num_shards=1)
  with pytest.raises(ValueError, match="differ in length"):
    data.batches({"x": np.zeros(3), "y": np.zeros(4)}, 2, seed=0,
                 num_shards=1)
  with pytest.raises(ValueError, match="start_step"):
    data.batches(_arrays(), 2, seed=0, num_shards=1, start_step=-1)


def test_local_slice_partitions_the_batch():
  batch = next(data.batches(_arrays(), 8, seed=0, num_shards=4))
  parts = [data.local_slice(batch, p, 4) for p in range(4)]
  for p, part in enumerate(parts):
    np.testing.assert_array_equal(part["y"], batch["y"][2 * p:2 * p + 2])
  chex.assert_trees_all_equal(
      {k: np.concatenate([p[k] for p in parts]) for k in batch}, batch)
  with pytest.raises(ValueError, match="not divisible"):
    data.local_slice(batch, 0, 3)
  with pytest.raises(ValueError, match="process_index"):
    data.local_slice(batch, 4, 4)


def test_eval_batches_cover_everything_once():
  got = list(data.eval_batches(_arrays(), 4, num_shards=2))
  assert len(got) == 3
  for b in got:
    chex.assert_shape([b["x"], b["y"], b["mask"]], [(4,)] * 3)
  mask = np.concatenate([b["mask"] for b in got])
  y = np.concatenate([b["y"] for b in got])
  np.testing.assert_array_equal(y[mask], np.arange(10))
  assert mask.sum() == 10 and not mask[10:].any()
