"""Moving the per-device state of a sharded step to other model-axis sizes
(a checkpoint of ``(dcn=2, fsdp=4)`` resumed on ``(dcn=2, fsdp=2)``).

Inside :func:`update_on_shards` every device's state is the state of its
blocks: error-feedback residuals are flat buckets of its shards, a
downstream optimizer's moments are its shards of each leaf, a codec's
state is shaped by the block shapes. Another FSDP size cuts the leaves into
other blocks, so the state is re-cut element by element:

* per-leaf trees shaped like the params' shards (Adam's moments, DiLoCo's
  anchor and outer momentum): each leaf's blocks are put back together and
  cut again;
* a compressor's bucket buffers (``residual``, ``momentum``, EF21's
  ``estimate``): split into its leaves with the compressor's own bucket
  plan for the old blocks, re-cut, and joined with the plan for the new
  ones, so every element keeps what it still owes the averaged update;
* a field owned by chunks of the data axis (onebit's server error): its
  total over the slice's devices is re-cut the same way, then given to the
  device whose chunk now holds it;
* a warm start (PowerSGD's ``Q``, registered ``WARM`` in
  ``jaxcomm._per_device``) owes nothing: it restarts as at init;
* a per-device scalar (a step count, a statistic): the largest (integers)
  or the mean (floats) of the slice's old blocks, on every new block.

Copies of a replicated leaf (one per device of the axes that do not split
it) are averaged, as their updates are. Anything else that varies over a
model axis is refused by name rather than guessed at, as is a compressed
leaf whose new blocks would travel dense (its residual would have nowhere
to go).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _per_device
from jaxcomm import _policy
from jaxcomm.collectives import _signs
from jaxcomm.parallel._resize import _check_rows
from jaxcomm.parallel._resize import _check_state_tree
from jaxcomm.parallel._resize import check_like

_BUFFERS = _codec.BUFFER_FIELDS


class _Geometry:
  """Where each device's block of every params leaf lies, for one set of
  model-axis sizes."""

  def __init__(self, params, specs, data: str, data_size: int,
               model: dict):
    self.data, self.data_size = data, data_size
    self.model = dict(model)
    self.axes_sorted = tuple(sorted(self.model))
    self.shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    self.paths = [jax.tree_util.keystr(p) for p, _ in
                  jax.tree_util.tree_flatten_with_path(params)[0]]
    self.dtypes = [np.dtype(jax.numpy.result_type(x))
                   for x in jax.tree.leaves(params)]
    self.specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    self.treedef = jax.tree.structure(params)
    for shape, sp in zip(self.shapes, self.specs):
      for i, e in enumerate(tuple(sp)):
        if e is None:
          continue
        k = int(np.prod([self.model[a] for a in _names(e)]))
        if shape[i] % k:
          raise ValueError(
            f"a params leaf of shape {shape} splits dimension {i} over "
            f"{e} ({k} devices), which does not divide it")

  def local_shape(self, j: int) -> tuple:
    out = list(self.shapes[j])
    for i, e in enumerate(tuple(self.specs[j])):
      if e is not None:
        out[i] //= int(np.prod([self.model[a] for a in _names(e)]))
    return tuple(out)

  def splits(self) -> tuple:
    """Per params leaf, how a block is cut from it (what
    ``update_on_shards`` tells compressors: ``Layout.splits``)."""
    out = []
    for sp in self.specs:
      out.append(tuple(
        (i, _names(e), int(np.prod([self.model[a] for a in _names(e)])))
        for i, e in enumerate(tuple(sp)) if e is not None))
    return tuple(out)

  def local_params(self):
    return jax.tree.unflatten(self.treedef, [
      jax.ShapeDtypeStruct(self.local_shape(j), self.dtypes[j])
      for j in range(len(self.shapes))])

  def coords(self, axes) -> list[dict]:
    """Per row of a leaf laid out over ``axes`` (data first, then model
    axes sorted): its coordinate on each of them."""
    sizes = [self.data_size if a == self.data else self.model[a]
             for a in axes]
    return [dict(zip(axes, np.unravel_index(r, sizes)))
            for r in range(int(np.prod(sizes)))]

  def index(self, j: int, c: dict) -> tuple:
    """The slices of params leaf ``j`` that the block at model coordinates
    ``c`` holds (the whole leaf along dimensions it does not split)."""
    out = []
    for i, dim in enumerate(self.shapes[j]):
      e = tuple(self.specs[j])[i] if i < len(tuple(self.specs[j])) else None
      if e is None:
        out.append(slice(None))
        continue
      names = _names(e)
      sizes = [self.model[a] for a in names]
      k = int(np.ravel_multi_index([int(c[a]) for a in names], sizes))
      step = dim // int(np.prod(sizes))
      out.append(slice(k * step, (k + 1) * step))
    return tuple(out)


def _names(e) -> tuple:
  return tuple(e) if isinstance(e, tuple) else (e,)


def _assemble(blocks: dict, j: int, geo: _Geometry) -> np.ndarray:
  """Params leaf ``j`` from ``{model coordinates: block}`` (every block of
  one slice); copies of the same elements averaged."""
  shape = geo.shapes[j]
  total = np.zeros(shape, np.float64)
  count = np.zeros(shape, np.int64)
  for key, blk in blocks.items():
    sl = geo.index(j, dict(key))
    total[sl] += blk
    count[sl] += 1
  return total / np.maximum(count, 1)


def _model_key(c: dict, geo: _Geometry) -> tuple:
  return tuple((a, int(c.get(a, 0))) for a in geo.axes_sorted)


def _full_keys(geo: _Geometry) -> list[tuple]:
  sizes = [geo.model[a] for a in geo.axes_sorted]
  return [tuple(zip(geo.axes_sorted, (int(v) for v in np.unravel_index(
    r, sizes)))) for r in range(int(np.prod(sizes)))]


def reshard_state(state, layout, template, template_layout, *, params,
                  specs, axis_name: str, data_size: int, old_axes: dict,
                  new_axes: dict, compressors=()):
  """The per-device state of a sharded step on other model-axis sizes.

  Args:
    state: the state as host arrays in ``layout`` (rows of each per-device
      leaf over the data axis then the model axes sorted), e.g. from a
      checkpoint written on ``old_axes``.
    layout: its :func:`state_layout` (with ``auto_axes``).
    template: a fresh state on ``new_axes`` (host arrays, e.g.
      ``jax.device_get(dp.init(params)[1])``): the rows to fill and the
      values warm starts restart from.
    template_layout: its layout.
    params: the whole (logical) params, arrays or ShapeDtypeStructs.
    specs: their PartitionSpecs over the model axes (the same rules on
      both sizes).
    axis_name: the data axis (one); its size is kept (change it
      afterwards with :func:`resize_state`).
    data_size: the data axis's size, the same before and after.
    old_axes: ``{axis: size}`` of the model axes the state was laid out
      on.
    new_axes: ``{axis: size}`` of the model axes to move it to; the same
      names as ``old_axes``.
    compressors: the jaxcomm compressors whose states the state holds, in
      the order their ``CompressState`` entries appear in it (for their bucket
      plans).

  Returns:
    ``(state, restarted)``: the new state's host rows and the paths of
    the warm starts that restarted.

  Raises:
    ValueError: naming a leaf whose rows cannot be re-cut (a state type
      this does not know, a compressed leaf whose new blocks travel dense,
      a leaf that would come out in another shape than the template's),
      or arguments that do not fit.
  """
  if not isinstance(axis_name, str):
    raise ValueError(f"reshard_state takes one data axis, got "
                     f"axis_name={axis_name!r}")
  if set(old_axes) != set(new_axes):
    raise ValueError(f"old_axes {dict(old_axes)} and new_axes "
                     f"{dict(new_axes)} must name the same model axes")
  _check_state_tree(state, layout, "reshard_state")
  _check_state_tree(template, template_layout, "reshard_state (template)")
  data_size = _checks.integer("data_size", data_size, 1)
  for name, axes in (("old_axes", old_axes), ("new_axes", new_axes)):
    for a, size in dict(axes).items():
      _checks.integer(f"{name}[{a!r}]", size, 1)
  _check_rows(jax.tree.leaves(state), jax.tree.leaves(layout), axis_name,
              dict(old_axes), data_size, "reshard_state (state)",
              "pass the old_axes it was saved with")
  _check_rows(jax.tree.leaves(template), jax.tree.leaves(template_layout),
              axis_name, dict(new_axes), data_size,
              "reshard_state (template)",
              "build the template on new_axes, with data_size slices")
  old = _Geometry(params, specs, axis_name, data_size, old_axes)
  new = _Geometry(params, specs, axis_name, data_size, new_axes)
  specs_of = [_codec.spec_of(c) for c in compressors]
  r = _Resharder(old, new, specs_of)
  out = r.visit(state, layout, template, template_layout, "state")
  if r.used != len(specs_of):
    raise ValueError(
      f"compressors: {len(specs_of)} given, the state holds "
      f"{r.used} compressor states")
  check_like(out, template, "reshard_state")
  return out, r.restarted


class _Resharder:
  def __init__(self, old: _Geometry, new: _Geometry, specs_of: list):
    self.old, self.new = old, new
    self.specs_of = specs_of
    self.used = 0
    self.restarted: list[str] = []

  # ------------------------------------------------------------ walking --

  def visit(self, x, b, t, tb, path):
    if isinstance(x, _codec.CompressState):
      return self.compress_state(x, b, t, tb, path)
    if self.params_shaped(x, b):
      return self.params_tree(x, b, t, tb, path)
    if hasattr(x, "_fields"):
      kinds = _per_device.kinds(type(x))
      return type(x)(*[
        self.restart(tv, f"{path}.{name}")
        if kinds.get(name) == _per_device.WARM
        else self.visit(xv, bv, tv, tbv, f"{path}.{name}")
        for name, xv, bv, tv, tbv in zip(x._fields, x, b, t, tb)])
    if isinstance(x, (tuple, list)):
      if len(x) != len(t):
        raise ValueError(f"{path}: {len(x)} entries on the old sizes, "
                         f"{len(t)} on the new ones; cannot re-cut them")
      return type(x)(self.visit(xv, bv, tv, tbv, f"{path}[{i}]")
                     for i, (xv, bv, tv, tbv) in enumerate(zip(x, b, t, tb)))
    if isinstance(x, dict):
      return {k: self.visit(x[k], b[k], t[k], tb[k], f"{path}[{k!r}]")
              for k in x}
    if x is None:
      return None
    leaves = jax.tree.leaves(x)
    if len(leaves) == 1 and leaves[0] is x:
      return self.leaf(x, b, t, tb, path)
    # Another pytree node (Flax NNX State): its leaves in order.
    xs, tdef = jax.tree.flatten(x)
    return jax.tree.unflatten(tdef, [
      self.visit(xv, bv, tv, tbv, f"{path}<{i}>") for i, (xv, bv, tv, tbv)
      in enumerate(zip(xs, jax.tree.leaves(b), jax.tree.leaves(t),
                       jax.tree.leaves(tb)))])

  def model_axes(self, b) -> tuple:
    if b is True or not b:
      return ()
    return tuple(sorted(a for a in b if a != self.old.data))

  def row_axes(self, b) -> tuple:
    if b is True:
      return (self.old.data,)
    if not b:
      return ()
    return ((self.old.data,) if self.old.data in b else ()) + \
      self.model_axes(b)

  def restart(self, t, path):
    self.restarted.append(path)
    return t

  # --------------------------------------------------------------- leaf --

  def leaf(self, x, b, t, tb, path):
    x = np.asarray(x)
    if not self.model_axes(b):
      return x
    if self.model_axes(tb) != self.model_axes(b):
      raise ValueError(f"{path}: laid out over {sorted(b)} on the old "
                       f"sizes, over {sorted(tb)} on the new ones")
    if x.ndim == 1:
      return self.scalars(x, b, t)
    raise ValueError(
      f"{path} (shape {x.shape}) varies over the model axes "
      f"{list(self.model_axes(b))} and is not a shard of a params leaf, a "
      "compressor's buffer or a registered warm start: it cannot be re-cut "
      "for other model-axis sizes; resume with the checkpoint's sizes")

  def scalars(self, x, b, t):
    """One value per device: the slice's largest (integers) or mean
    (floats) on every new block."""
    axes = self.row_axes(b)
    t = np.asarray(t)
    per_slice = {}
    for row, c in zip(x, self.old.coords(axes)):
      per_slice.setdefault(int(c.get(self.old.data, 0)), []).append(row)
    out = np.empty_like(t)
    for i, c in enumerate(self.new.coords(axes)):
      vals = np.asarray(per_slice[int(c.get(self.new.data, 0))])
      out[i] = (vals.max() if np.issubdtype(vals.dtype, np.integer)
                or vals.dtype == bool else vals.astype(np.float64).mean())
    return out

  # -------------------------------------------------- params-shaped trees --

  def params_shaped(self, x, b) -> bool:
    if isinstance(x, np.ndarray) or x is None or hasattr(x, "shape"):
      return False
    leaves = jax.tree.leaves(x)
    bl = jax.tree.leaves(b)
    if len(leaves) != len(self.old.shapes) or len(bl) != len(leaves):
      return False
    for j, (v, bv) in enumerate(zip(leaves, bl)):
      lead = 1 if self.row_axes(bv) else 0
      if tuple(np.shape(v))[lead:] != self.old.local_shape(j):
        return False
    return any(self.model_axes(bv) for bv in bl)

  def params_tree(self, x, b, t, tb, path):
    xs, tdef = jax.tree.flatten(x)
    bs, ts, tbs = (jax.tree.leaves(b), jax.tree.leaves(t),
                   jax.tree.leaves(tb))
    out = []
    for j, (v, bv, tv, tbv) in enumerate(zip(xs, bs, ts, tbs)):
      v, tv = np.asarray(v), np.asarray(tv)
      if not self.model_axes(bv):
        out.append(v)
        continue
      axes = self.row_axes(bv)
      slices = {}
      for row, c in zip(v, self.old.coords(axes)):
        slices.setdefault(int(c.get(self.old.data, 0)), {})[
          _model_key(c, self.old)] = row
      whole = {d: _assemble(blk, j, self.old) for d, blk in slices.items()}
      rows = np.empty_like(tv)
      for i, c in enumerate(self.new.coords(self.row_axes(tbv))):
        w = whole[int(c.get(self.new.data, 0))]
        rows[i] = w[self.new.index(j, dict(_model_key(c, self.new)))].astype(
          tv.dtype)
      out.append(rows)
    return jax.tree.unflatten(tdef, out)

  # ---------------------------------------------------- compressor state --

  def compress_state(self, x, b, t, tb, path):
    if self.used >= len(self.specs_of):
      raise ValueError(
        f"{path}: a compressor's state, and no compressor is left in "
        "compressors= to read its bucket plan from: pass every compressor "
        "the state holds, in order")
    spec = self.specs_of[self.used]
    self.used += 1
    fields = {}
    for name in _codec.CompressState._fields:
      xv, bv, tv, tbv = (getattr(s, name) for s in (x, b, t, tb))
      if name in _BUFFERS and len(xv):
        fields[name] = self.buffers(spec, xv, bv, tv, tbv, f"{path}.{name}")
      elif name == "codec":
        fields[name] = self.codec_states(spec, xv, bv, tv, tbv,
                                         f"{path}.codec")
      else:
        fields[name] = self.visit(xv, bv, tv, tbv, f"{path}.{name}")
    return _codec.CompressState(**fields)

  def _plans(self, spec, path):
    """Per geometry: the compressed params leaves (indices) and the
    bucket plan of the device's blocks."""
    out = []
    for geo in (self.old, self.new):
      local = geo.local_params()
      paths = spec.paths(local, geo.splits())
      comp = _policy.select(list(range(len(geo.shapes))), paths,
                            _policy.COMPRESS)
      out.append((local, comp))
    (_, c_old), (_, c_new) = out
    lost = [self.old.paths[j] for j in sorted(set(c_old) - set(c_new))]
    if lost:
      raise ValueError(
        f"{path}: params leaves {', '.join(lost)} are compressed on the old "
        f"sizes {self.old.model} and travel dense on {self.new.model} (the "
        "leaf policy sees their smaller blocks): their residuals would be "
        "lost. Lower the compressor's min size, or resume with the "
        "checkpoint's sizes")
    return out

  def _to_leaves(self, spec, buffers, geo, local, comp, axes, owned):
    """Rows of bucket buffers -> ``{slice: whole params leaf}`` per
    compressed leaf (owned: the slice's total over the data axis)."""
    per_leaf = {j: {} for j in comp}
    coords = geo.coords(axes)
    for r, c in enumerate(coords):
      with _codec.block_splits(geo.splits()):
        parts = spec.leaves_of([np.asarray(buf)[r] for buf in buffers],
                               local)
      d = 0 if owned else int(c.get(geo.data, 0))
      key = _model_key(c, geo)
      for j, part in zip(comp, parts):
        blocks = per_leaf[j].setdefault(d, {})
        blocks[key] = blocks.get(key, 0) + np.asarray(part, np.float64)
    return {j: {d: _assemble(blk, j, geo) for d, blk in s.items()}
            for j, s in per_leaf.items()}

  def _from_leaves(self, spec, whole, templates, geo, local, comp, axes,
                   owned):
    layouts = spec.layouts(local, geo.splits())
    out = [np.zeros_like(np.asarray(t)) for t in templates]
    for r, c in enumerate(geo.coords(axes)):
      d = 0 if owned else int(c.get(geo.data, 0))
      for bi, lay in enumerate(layouts):
        flat = []
        for j_local, shape in zip(lay.leaves, lay.shapes):
          j = comp[j_local]
          if j in whole:
            flat.append(whole[j][d][geo.index(
              j, dict(_model_key(c, geo)))].reshape(-1))
          else:
            flat.append(np.zeros(int(np.prod(shape)), np.float64))
        vec = np.concatenate(flat) if flat else np.zeros(0)
        if owned:
          # Chunks of the stored width (as the exchange cuts them).
          n = geo.data_size
          k = int(c.get(geo.data, 0))
          ln = _signs.chunk_length(out[bi].shape[-1], n)
          mine = np.zeros_like(vec)
          mine[k * ln:(k + 1) * ln] = vec[k * ln:(k + 1) * ln]
          vec = mine
        # A compressor's buffers are stored in whole tiles (zero tail).
        out[bi][r][..., :vec.shape[-1]] = vec.astype(out[bi].dtype)
    return tuple(out)

  def _check_widths(self, spec, geo, local, bufs, path, which):
    want = [lay.stored_size for lay in spec.layouts(local, geo.splits())]
    got = [int(np.shape(b)[-1]) for b in bufs]
    if got != want:
      raise ValueError(
        f"{path}: the {which} holds buckets of {got} elements, but "
        f"compressors[{self.used - 1}] ({spec.codec.name}) on these params "
        f"split over {geo.model} plans {want}: it was made with another "
        "leaf policy, bucket size or compressor, or for other params or "
        "model-axis sizes; pass the compressor and sizes it was made with")

  def buffers(self, spec, xv, bv, tv, tbv, path, owned=False):
    (l_old, c_old), (l_new, c_new) = self._plans(spec, path)
    self._check_widths(spec, self.old, l_old, xv, path, "state")
    self._check_widths(spec, self.new, l_new, tv, path, "template")
    axes_old = self.row_axes(bv[0])
    axes_new = self.row_axes(tbv[0])
    if self.model_axes(bv[0]) != self.model_axes(tbv[0]):
      raise ValueError(
        f"{path}: laid out over {list(axes_old)} on the old sizes, over "
        f"{list(axes_new)} in the template: the compressor keeps this "
        "buffer otherwise on the new sizes (int8's server error exists per "
        "device only from 2 slices on); it cannot be re-cut there")
    whole = self._to_leaves(spec, xv, self.old, l_old, c_old, axes_old,
                            owned)
    return self._from_leaves(spec, whole, tv, self.new, l_new, c_new,
                             axes_new, owned)

  def codec_states(self, spec, xv, bv, tv, tbv, path):
    if not any(jax.tree.leaves(self._per_model(bv))):
      if not jax.tree.leaves(xv):
        return tv
      same = [np.shape(a) == np.shape(c) for a, c in
              zip(jax.tree.leaves(xv), jax.tree.leaves(tv))]
      if not all(same) and not any(np.any(np.asarray(a)) for a in
                                   jax.tree.leaves(xv)):
        # Codec buffers on the data axis alone, sized by the block, that
        # hold nothing (int8's server error on one slice, where the exact
        # exchange leaves it unused): they owe nothing; as at init.
        return tv
      return xv
    first = tv[0] if tv else None
    if first is None or not hasattr(first, "_fields"):
      raise ValueError(f"{path}: a codec state that is not a NamedTuple "
                       "varies over the model axes; cannot re-cut it")
    kinds = _per_device.kinds(type(first))
    fields = {}
    for name in first._fields:
      kind = kinds.get(name)
      olds = [getattr(s, name) for s in xv]
      lays = [getattr(s, name) for s in bv]
      news = [getattr(s, name) for s in tv]
      nlays = [getattr(s, name) for s in tbv]
      where = f"{path}[*].{name}"
      if kind == _per_device.WARM:
        fields[name] = [self.restart(v, where) for v in news]
      elif kind == _per_device.OWNED:
        fields[name] = list(self.buffers(spec, olds, lays, news, nlays,
                                         where, owned=True))
      elif len(olds) == len(news):
        fields[name] = [self.visit(o, lb, n, nb, where)
                        for o, lb, n, nb in zip(olds, lays, news, nlays)]
      else:
        raise ValueError(f"{where}: {len(olds)} buckets on the old sizes, "
                         f"{len(news)} on the new ones")
    return tuple(type(first)(**{k: v[i] for k, v in fields.items()})
                 for i in range(len(tv)))

  def _per_model(self, b):
    return jax.tree.map(lambda v: bool(self.model_axes(v)), b)
