"""Which extra arguments of ``tx.update`` jaxcomm's transforms read.

Optax offers every extra keyword argument of ``tx.update`` to every
transformation of a chain, and each takes the ones it knows: a keyword
that none takes is dropped without a word. A jaxcomm transformation that
reads one declares it at import (:func:`declare`) and notes each read
(:func:`read`); :class:`jaxcomm.parallel.DataParallel` records the reads
of its step's update (:func:`recording`) and refuses a keyword of its
``update_args`` that a jaxcomm transformation reads but none of ``tx``
read (:func:`check`).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

# keyword -> the methods that read it.
_DECLARED: dict[str, list[str]] = {}
_READS: contextvars.ContextVar = contextvars.ContextVar(
  "jaxcomm_extra_reads", default=None)


def declare(keyword: str, reader: str) -> None:
  """Declares that the method ``reader`` reads the extra argument
  ``keyword`` of ``tx.update``."""
  readers = _DECLARED.setdefault(keyword, [])
  if reader not in readers:
    readers.append(reader)


def read(keyword: str) -> None:
  """Notes, inside :func:`recording`, that ``keyword`` was read."""
  reads = _READS.get()
  if reads is not None:
    reads.add(keyword)


@contextlib.contextmanager
def recording():
  """A context whose value is the set of keywords read inside it."""
  reads: set[str] = set()
  token = _READS.set(reads)
  try:
    yield reads
  finally:
    _READS.reset(token)


def check(keywords, reads, where: str = "update_args") -> None:
  """Refuses each of ``keywords`` that a jaxcomm method reads but no
  transformation read (``reads``); warns of one no jaxcomm method reads
  (a transformation of another library may take it).

  Raises:
    ValueError: naming the keyword and the methods that read it.
  """
  for k in sorted(keywords):
    if k in reads:
      continue
    if k in _DECLARED:
      raise ValueError(
        f"{where} gives {k!r}, which no transformation of tx read: only "
        f"{', '.join('jaxcomm.' + r for r in _DECLARED[k])} read it (optax "
        "hands it to every transformation of the chain and the others "
        "drop it); put one in tx or leave the keyword out")
    warnings.warn(
      f"{where} gives {k!r}, which no jaxcomm transformation reads; optax "
      "hands it to every transformation of tx and those that do not take "
      "it drop it", stacklevel=2)
