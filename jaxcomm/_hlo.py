"""Compiled HLO text, read an instruction at a time: its name, result
shape (bytes included) and opcode.

``jax.stages.Compiled`` gives its optimized program as text
(``as_text()``). Its ``runtime_executable().hlo_modules()`` reaches
jaxlib's private HLO classes, which are not an API: their instructions
have no shape on jaxlib 0.10 and one on 0.12. So :mod:`jaxcomm.wire` and
:mod:`jaxcomm.aot` read the text with this module, which tokenizes an
instruction's result shape by the grammar XLA prints rather than by a
pattern of one compiler's output:

* an array ``dtype[dims]``, with an optional layout in braces: minor to
  major dimensions, then after ``:`` any of tiles ``T(8,128)(2,1)``, an
  element size in bits ``E(4)``, a memory space ``S(1)`` and whatever
  else a compiler adds (skipped, braces and parentheses balanced);
* bounded dynamic dimensions ``<=8`` (counted at their bound);
* tuples ``(shape, ...)``, nested, with ``/*index=5*/`` comments;
* ``token[]`` (no bytes).

An instruction whose line cannot be read raises :class:`Unreadable`, which
names it and the jax, jaxlib and libtpu versions that printed it: a
collective is never counted as zero bytes because its text changed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re
from typing import NamedTuple
from typing import Union

__all__ = ["Array", "Instruction", "Tuple", "Unreadable", "dtype_bits",
           "instruction", "parse_shape", "versions"]


class Unreadable(ValueError):
  """An HLO instruction this module cannot read (a ``ValueError``)."""


def versions() -> str:
  """The versions of the packages whose compilers print the HLO read here
  (jax, jaxlib, libtpu), for error messages."""
  def version(pkg):
    try:
      return f"{pkg} {importlib.metadata.version(pkg)}"
    except importlib.metadata.PackageNotFoundError:
      return None
  tpu = version("libtpu") or version("libtpu-nightly")
  return ", ".join([version("jax") or "jax ?", version("jaxlib") or
                    "jaxlib ?", tpu or "libtpu not installed"])


# Element widths in bits of XLA's primitive types by name; the floating
# point formats with exponent and mantissa in the name (f8e4m3fn, f4e2m1fn,
# f8e8m0fnu, ...) by their leading width.
_NAMED_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0}
_WIDTH = re.compile(
  r"^(?:[su](1|2|4|8|16|32|64)|f(16|32|64)|f(4|6|8)e\d+m\d+[a-z]*)$")


def dtype_bits(dtype: str) -> int | None:
  """Bits of one element of the HLO primitive type ``dtype`` (``f32``: 32,
  ``pred``: 8, ``s4``: 4, ``token``: 0), or None for a name XLA does not
  use for an array type."""
  if dtype in _NAMED_BITS:
    return _NAMED_BITS[dtype]
  m = _WIDTH.match(dtype)
  return int(next(g for g in m.groups() if g)) if m else None


@dataclasses.dataclass(frozen=True)
class Array:
  """An array shape as HLO prints it.

  Attributes:
    dtype: the primitive type's name (``f32``, ``u32``, ``bf16``...).
    dims: the dimensions (a bounded dynamic one at its bound).
    element_bits: bits an element takes in memory: the layout's ``E(n)``
      where it gives one, else the type's width rounded up to whole bytes
      (XLA stores a 4-bit type unpacked unless its layout packs it).
    memory_space: the layout's ``S(n)`` (0: device memory, the default).
    minor_to_major: the layout's dimension order (``()`` when none).
    tile: the layout's first tile ``T(...)`` (``()`` when none): the
      most minor dimensions are stored padded to whole tiles of it.
  """
  dtype: str
  dims: tuple
  element_bits: int
  memory_space: int = 0
  minor_to_major: tuple = ()
  tile: tuple = ()

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def nbytes(self) -> int:
    return -(-self.elements * self.element_bits // 8)

  @property
  def tiled_elements(self) -> int:
    """Elements stored, the tile's padding included: each of the ``len(
    tile)`` most minor dimensions (in layout order) rounded up to its
    extent in the tile (a rank below the tile's counts as leading 1s)."""
    if not self.tile:
      return self.elements
    order = self.minor_to_major or tuple(range(len(self.dims) - 1, -1, -1))
    dims = list(self.dims)
    total = 1
    for i, t in enumerate(reversed(self.tile)):
      d = dims[order[i]] if i < len(order) else 1
      total *= -(-d // t) * t
    for j in order[len(self.tile):]:
      total *= dims[j]
    return total

  @property
  def tiled_nbytes(self) -> int:
    """Bytes stored, the tile's padding included."""
    return -(-self.tiled_elements * self.element_bits // 8)

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Tuple:
  """A tuple shape: ``elements``, each an :class:`Array` or a Tuple."""
  elements: tuple

  @property
  def nbytes(self) -> int:
    return sum(e.nbytes for e in self.elements)

  def __str__(self) -> str:
    return "(" + ", ".join(map(str, self.elements)) + ")"


Shape = Union[Array, Tuple]


class _Bad(Exception):
  """A shape the tokenizer cannot read (turned into :class:`Unreadable`)."""


_COMMENT = re.compile(r"/\*.*?\*/")
_NAME = re.compile(r"[a-z][a-z0-9]*")
_DIM = re.compile(r"\s*(<=)?\s*(\d+)\s*")
_LAYOUT_ATTR = re.compile(r"(?<![A-Za-z])([ES])\((\d+)\)")
_TILE = re.compile(r"(?<![A-Za-z])T\((\d+(?:,\d+)*)\)")


def _skip_ws(text: str, i: int) -> int:
  """The index of the next character that is not a blank or a comment."""
  while i < len(text):
    if text[i] in " \t":
      i += 1
    elif text.startswith("/*", i):
      end = text.find("*/", i + 2)
      if end < 0:
        raise _Bad(f"unclosed comment at column {i}")
      i = end + 2
    else:
      break
  return i


def _balanced(text: str, i: int) -> int:
  """The index just past the bracket group opening at ``text[i]``."""
  pairs = {"{": "}", "(": ")", "[": "]"}
  stack = []
  j = i
  while j < len(text):
    c = text[j]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j + 1
    elif c in ")}]":
      raise _Bad(f"unbalanced {c!r} at column {j}")
    j += 1
  raise _Bad(f"unclosed {text[i]!r} at column {i}")


def _array(text: str, i: int) -> tuple[Array, int]:
  m = _NAME.match(text, i)
  if not m or m.end() >= len(text) or text[m.end()] != "[":
    raise _Bad(f"no array type at column {i}: {text[i:i + 40]!r}")
  dtype = m.group(0)
  bits = dtype_bits(dtype)
  if bits is None:
    raise _Bad(f"unknown element type {dtype!r}")
  close = text.find("]", m.end())
  if close < 0:
    raise _Bad(f"unclosed dimensions of {dtype}")
  body = _COMMENT.sub("", text[m.end() + 1:close])
  dims = []
  if body.strip():
    for part in body.split(","):
      d = _DIM.fullmatch(part)
      if not d:
        raise _Bad(f"dimension {part.strip()!r} of {dtype} has no size")
      dims.append(int(d.group(2)))
  j = close + 1
  element_bits = -(-bits // 8) * 8
  space, order, tile = 0, (), ()
  if j < len(text) and text[j] == "{":
    end = _balanced(text, j)
    layout = text[j + 1:end - 1]
    head, _, attrs = layout.partition(":")
    order = tuple(int(d) for d in _COMMENT.sub("", head).split(",")
                  if d.strip().isdigit())
    if len(order) != len(dims):
      order = ()
    for key, value in _LAYOUT_ATTR.findall(attrs):
      if key == "E":
        element_bits = int(value)
      else:
        space = int(value)
    t = _TILE.search(attrs)
    if t:
      tile = tuple(int(v) for v in t.group(1).split(","))
    j = end
  return Array(dtype, tuple(dims), element_bits, space, order, tile), j


def parse_shape(text: str, i: int = 0) -> tuple[Shape, int]:
  """``(shape, end)``: the shape printed at ``text[i:]`` and the index
  just past it.

  Raises:
    Unreadable: the text there is not a shape this module reads.
  """
  try:
    return _shape(text, i)
  except _Bad as e:
    raise Unreadable(f"cannot read the shape {text[i:i + 80]!r}: {e}"
                     ) from None


def _shape(text: str, i: int) -> tuple[Shape, int]:
  i = _skip_ws(text, i)
  if i < len(text) and text[i] == "(":
    elements = []
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == ")":
      return Tuple(()), i + 1
    while True:
      element, i = _shape(text, i)
      elements.append(element)
      i = _skip_ws(text, i)
      if i < len(text) and text[i] == ",":
        i += 1
        continue
      if i < len(text) and text[i] == ")":
        return Tuple(tuple(elements)), i + 1
      raise _Bad(f"expected ',' or ')' in a tuple at column {i}")
  return _array(text, i)


class Instruction(NamedTuple):
  """One instruction line of an HLO module.

  Attributes:
    name: its name, without ``%``.
    shape: its result shape (:class:`Array` or :class:`Tuple`).
    opcode: its opcode (``all-reduce``, ``send``, ``fusion``...).
    rest: the text after the opcode's ``(``: operands, then attributes.
    root: whether it is its computation's ROOT.
  """
  name: str
  shape: Shape
  opcode: str
  rest: str
  root: bool = False


_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([a-z][a-z0-9\-_]*)\(")


def instruction(line: str, *, where: str = "") -> Instruction | None:
  """The instruction ``line`` defines, or None when it defines none (a
  module or computation header, a closing brace, a blank line).

  Args:
    line: one line of HLO text.
    where: what was reading it, for the error (e.g. ``"wire.collectives"``).

  Raises:
    Unreadable: the line defines an instruction whose shape or opcode
      cannot be read; the message names the instruction and the versions
      of jax, jaxlib and libtpu.
  """
  head = _HEAD.match(line)
  if not head:
    return None
  try:
    shape, end = _shape(line, head.end())
    op = _OPCODE.match(line, _skip_ws(line, end))
    if not op:
      raise _Bad(f"no opcode after the shape: {line[end:end + 40]!r}")
  except _Bad as e:
    raise Unreadable(
      f"{where + ': ' if where else ''}cannot read HLO instruction "
      f"%{head.group(2)} ({e}); printed by {versions()}: "
      f"{line.strip()[:240]}") from None
  return Instruction(head.group(2), shape, op.group(1), line[op.end():],
                     bool(head.group(1)))
