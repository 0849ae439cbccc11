"""The training loop's progress report: a tqdm bar on a terminal, plain
lines elsewhere.

Redirected to a file (``make train > log 2>&1``) a bar's carriage-return
redraws land in the log as one line per redraw (about 1,500 in a run);
there the report is one plain line every ``every`` steps and at the last.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

# Plain lines in a run when the stream is not a terminal (plus the last).
LINES = 20


def _is_terminal(stream) -> bool:
  isatty = getattr(stream, "isatty", None)
  try:
    return bool(isatty and isatty())
  except ValueError:   # a closed stream
    return False


class Progress:
  """Steps ``initial + 1 .. total`` of a run, reported on ``stream``.

  Args:
    total: the run's last step.
    initial: steps already done (a resumed run).
    desc: the label in front of each report.
    stream: where to write (default ``sys.stderr``).
    every: steps between plain lines off a terminal (default: the run in
      about :data:`LINES` lines).
  """

  def __init__(self, total: int, initial: int, desc: str,
               stream: TextIO | None = None, every: int | None = None):
    self.total, self.done, self.desc = total, initial, desc
    self.stream = sys.stderr if stream is None else stream
    self.every = every or max(1, math.ceil((total - initial) / LINES))
    self.postfix = ""
    self.bar = None
    if _is_terminal(self.stream):
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self.bar = tqdm(total=total, initial=initial, desc=desc,
                      dynamic_ncols=True, file=self.stream)

  def set_postfix(self, text: str) -> None:
    """What the next report shows after the step count."""
    self.postfix = text
    if self.bar is not None:
      self.bar.set_postfix_str(text, refresh=False)

  def update(self, n: int = 1) -> None:
    """``n`` more steps done."""
    self.done += n
    if self.bar is not None:
      self.bar.update(n)
    elif self.done % self.every == 0 or self.done == self.total:
      tail = f" {self.postfix}" if self.postfix else ""
      self.stream.write(f"{self.desc}: step {self.done}/{self.total}"
                        f"{tail}\n")
      self.stream.flush()

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
