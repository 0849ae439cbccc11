"""A character-level LSTM language model (Flax NNX).

Next-character prediction with a stacked LSTM, the recurrent workload of the
gradient-compression literature's experiments (e.g. PowerSGD's and
Deep Gradient Compression's language models, here at character level so the
data ships with Python).

References:
  Hochreiter and Schmidhuber, `Long Short-Term Memory
  <https://doi.org/10.1162/neco.1997.9.8.1735>`_, 1997.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def _typed_like(zeros: jax.Array, x: jax.Array) -> jax.Array:
  """``zeros`` marked varying over the mapped axes ``x`` varies over.

  Inside ``shard_map`` with ``check_vma`` the LSTM scan needs its initial
  carry typed like the per-device inputs; a fresh zero array is typed as
  replicated, which the scan rejects. Outside shard_map this is a no-op.
  """
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  axes = tuple(sorted(mat.varying)) if mat is not None else tuple(
    sorted(getattr(jax.typeof(x), "vma", ())))
  return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


class CharLM(nnx.Module):
  """Embedding, ``num_layers`` LSTM layers, and next-character logits.

  The LSTM state starts at zero for every sequence (no state is carried
  between batches), so the model holds parameters only and is a pure
  function of them.

  Args:
    vocab_size: number of distinct characters (``len(vocab)`` from
      :func:`models.data.text_corpus`).
    embed_dim: width of the character embedding.
    hidden_size: LSTM state width of every layer.
    num_layers: number of stacked LSTM layers.
    rngs: parameter initialisation RNGs.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = CharLM(vocab_size=50, hidden_size=32, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 50)
  """

  def __init__(
      self,
      vocab_size: int = 128,
      embed_dim: int = 64,
      hidden_size: int = 256,
      num_layers: int = 2,
      *,
      rngs: nnx.Rngs,
  ):
    if num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    self.hidden_size = hidden_size
    self.num_layers = num_layers
    self.embed = nnx.Embed(vocab_size, embed_dim, rngs=rngs)
    fan_in = embed_dim
    for i in range(num_layers):
      cell = nnx.OptimizedLSTMCell(fan_in, hidden_size, rngs=rngs)
      # rngs=False: no RNG state in the module; the carry is given below.
      setattr(self, f"lstm_{i}", nnx.RNN(cell, rngs=False))
      fan_in = hidden_size
    self.head = nnx.Linear(hidden_size, vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps int tokens ``(batch, time)`` to logits ``(batch, time, vocab)``."""
    x = self.embed(tokens)
    zeros = _typed_like(
      jnp.zeros((tokens.shape[0], self.hidden_size), x.dtype), x)
    for i in range(self.num_layers):
      x = getattr(self, f"lstm_{i}")(x, initial_carry=(zeros, zeros))
    return self.head(x)
