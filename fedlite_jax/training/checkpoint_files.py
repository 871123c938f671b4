"""Round checkpoints: ``<directory>/<round>/`` directories written by orbax.

orbax's CheckpointManager writes a temporary directory and renames it when
complete, in a background thread; the newest ``keep`` are kept and a killed
save's leftovers are removed by the next :class:`Checkpointer`. A checkpoint
holds ``arrays`` (the state's leaves, ``'3'``, and model parameters that are
not leaves, ``'p0'``) and ``meta`` (JSON: format, round, the run's metadata,
treedef, zero-size leaves, which leaves are the parameters); restoring
checks all of it. :mod:`~fedlite_jax.training.state_io` re-exports every
public name. Errors name paths and values, never command-line flags.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping, Optional

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 'fedlite_jax.checkpoint'
FORMAT_VERSION = 2
_ITEMS = ('arrays', 'meta')


class CheckpointError(RuntimeError):
  """A checkpoint is corrupt or does not match the run resuming from it."""


def _json(x: Any) -> Any:
  """``x`` after a JSON round trip (tuples become lists; odd values str)."""
  return json.loads(json.dumps(x, sort_keys=True, default=str))


def _process_options() -> ocp.options.MultiprocessingOptions:
  """orbax acting for this process alone (process 0 writes; every process
  may read)."""
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me},
      barrier_sync_key_prefix=f'fedlite_ckpt_p{me}')


class Checkpointer:
  """Saves a run's checkpoints into ``directory`` (this process writes).

  Args:
    directory: where checkpoints live (created if missing).
    keep: how many most recent checkpoints to keep (>= 1).
    use_async: write in a background thread (:meth:`save` returns once the
      arrays are copied); :meth:`wait` / :meth:`close` wait for it.

  Raises:
    ValueError: ``keep < 1``.
  """

  def __init__(self, directory: str | os.PathLike, keep: int = 2,
               use_async: bool = True):
    if keep < 1:
      raise ValueError(f'keep must be >= 1; got {keep}.')
    self.directory = pathlib.Path(directory).absolute()  # orbax needs it.
    # orbax creates it only without active_processes.
    self.directory.mkdir(parents=True, exist_ok=True)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=_ITEMS,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, cleanup_tmp_directories=True,
            enable_async_checkpointing=use_async,
            multiprocessing_options=_process_options()))

  def save(self, round_num: int, state: Any, metadata: Mapping[str, Any],
           params: Any = None) -> pathlib.Path:
    """Starts writing ``state`` after ``round_num`` rounds; returns the
    checkpoint's path (complete after :meth:`wait`).

    Args:
      round_num: number of completed rounds (the round to resume at).
      state: any pytree of arrays / Python scalars.
      metadata: JSON-serializable dict compared on restore (e.g. flags).
      params: the model parameters within ``state``, recorded for
        :func:`stored_params` (None: not recorded).
    """
    leaves, treedef = jax.tree.flatten(state)
    # Copies: the state's device buffers may be donated while orbax writes.
    arrays = {str(i): np.array(x, copy=True) for i, x in enumerate(leaves)}
    meta = {'format': FORMAT, 'format_version': FORMAT_VERSION,
            'round': int(round_num), 'metadata': _json(dict(metadata)),
            'treedef': str(treedef), 'num_leaves': len(leaves)}
    if params is not None:
      index = {id(x): i for i, x in enumerate(leaves)}
      param_leaves, param_treedef = jax.tree.flatten(params)
      refs = []
      for j, x in enumerate(param_leaves):
        if id(x) in index:
          refs.append(str(index[id(x)]))
        else:
          refs.append(f'p{j}')
          arrays[f'p{j}'] = np.array(x, copy=True)
      meta['params'] = {'treedef': str(param_treedef), 'leaves': refs}
    meta['empty'] = {k: [list(a.shape), a.dtype.name]
                     for k, a in arrays.items() if a.size == 0}
    arrays = {k: a for k, a in arrays.items() if a.size}
    self._manager.save(int(round_num), args=ocp.args.Composite(
        arrays=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta)))
    return self.directory / str(int(round_num))

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def save_checkpoint(directory: str | os.PathLike, round_num: int, state: Any,
                    metadata: Mapping[str, Any], keep: int = 2,
                    params: Any = None) -> pathlib.Path:
  """:meth:`Checkpointer.save`, complete on return; returns the path."""
  with Checkpointer(directory, keep=keep, use_async=False) as ckpt:
    return ckpt.save(round_num, state, metadata, params)


def latest_checkpoint(directory: str | os.PathLike) -> Optional[pathlib.Path]:
  """The complete checkpoint with the highest round in ``directory``, or
  None (also for a missing directory)."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return None
  steps = ocp.path.step.checkpoint_steps(directory)
  return directory / str(max(steps)) if steps else None


def restore_items(path: str | os.PathLike, items: tuple[str, ...]) -> Any:
  """The named items (``'meta'``, ``'arrays'``) of checkpoint ``path``.

  Raises:
    CheckpointError: not a ``<directory>/<round>`` checkpoint of this module.
  """
  path = pathlib.Path(path)
  if not path.name.isdigit() or not path.is_dir():
    raise CheckpointError(f'{path} is not a checkpoint (a <directory>/<round> '
                          'directory).')
  args = {'meta': ocp.args.JsonRestore(), 'arrays': ocp.args.PyTreeRestore()}
  try:
    reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                              multiprocessing_options=_process_options())
    restored = reader.restore(path.absolute(), args=ocp.args.Composite(
        **{k: args[k] for k in items}))
    meta = restored.meta if 'meta' in items else None
    if meta is not None and meta.get('format') != FORMAT:
      raise ValueError(f'format {meta.get("format")!r}, not {FORMAT!r}')
  except Exception as e:  # Any decoding failure means a corrupt checkpoint.
    raise CheckpointError(
        f'Checkpoint {path} is corrupt or not a fedlite_jax checkpoint '
        f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}).'
    ) from e
  return restored


def is_checkpoint(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a checkpoint directory of this module."""
  try:
    restore_items(path, ('meta',))
  except CheckpointError:
    return False
  return True


def _arrays(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """``(meta, {key: array})`` of a checkpoint, zero-size arrays included."""
  restored = restore_items(path, ('meta', 'arrays'))
  meta, arrays = restored.meta, dict(restored.arrays)
  for k, (shape, dtype) in meta['empty'].items():
    arrays[k] = np.zeros(shape, dtype)
  return meta, arrays


def read_leaves(path: str | os.PathLike) -> tuple[int, list[np.ndarray]]:
  """``(round, the state's leaves as NumPy arrays, in tree order)``."""
  meta, arrays = _arrays(path)
  return int(meta['round']), [np.asarray(arrays[str(i)])
                              for i in range(meta['num_leaves'])]


def metadata_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                         saved_name: str = 'checkpoint') -> list[str]:
  """``'key: <saved_name>=<saved> now=<current>'`` per differing key (after
  a JSON round trip: tuples equal lists)."""
  saved, current = _json(dict(saved)), _json(dict(current))
  keys = sorted(set(saved) | set(current))
  return [f'{k}: {saved_name}={saved.get(k)!r} now={current.get(k)!r}'
          for k in keys if saved.get(k) != current.get(k)]


def restore_checkpoint(path: str | os.PathLike, target: Any,
                       metadata: Mapping[str, Any]) -> tuple[int, Any]:
  """``(round_num, state)`` of a checkpoint, as ``target``'s structure.

  Raises:
    CheckpointError: corrupt checkpoint, ``metadata`` other than the saved
      one, or a structure, shape or dtype other than ``target``'s.
  """
  meta, arrays = _arrays(path)
  diffs = metadata_differences(meta['metadata'], metadata)
  if diffs:
    raise CheckpointError(
        f'Checkpoint {path} was written with other metadata; refusing to '
        f'resume. Differences: {"; ".join(diffs)}.')
  leaves, treedef = jax.tree.flatten(target)
  if meta['treedef'] != str(treedef) or meta['num_leaves'] != len(leaves):
    raise CheckpointError(
        f'Checkpoint {path} holds a different state structure than this run '
        f'({meta["num_leaves"]} vs {len(leaves)} arrays); was the model or '
        'algorithm changed?')
  restored = []
  for i, ref in enumerate(leaves):
    arr = np.asarray(arrays[str(i)])
    ref_arr = np.asarray(ref)
    if arr.shape != ref_arr.shape or arr.dtype != ref_arr.dtype:
      raise CheckpointError(
          f'Checkpoint {path}: array {i} has shape {arr.shape} {arr.dtype}, '
          f'this run expects {ref_arr.shape} {ref_arr.dtype}.')
    restored.append(arr if isinstance(ref, (np.ndarray, jax.Array)) else
                    type(ref)(arr.item()) if np.ndim(ref) == 0 else arr)
  logging.info('Restored round %d from %s.', meta['round'], path)
  return int(meta['round']), jax.tree.unflatten(treedef, restored)


def params_as(like: Any, treedef_str: str, values: list[Any]) -> Any:
  """``values`` (one per parameter) in ``like``'s structure, or
  CheckpointError naming the first parameter of another shape or dtype."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  if treedef_str != str(treedef) or len(values) != len(flat):
    raise CheckpointError(
        f'its model parameters have a different structure ({len(values)} '
        f'arrays) than this model ({len(flat)} arrays); was it written for '
        'another task or model?')
  out = []
  for (key_path, ref), v in zip(flat, values):
    arr, ref = np.asarray(v), np.asarray(ref)
    if arr.shape != ref.shape or arr.dtype != ref.dtype:
      raise CheckpointError(
          f'parameter {jax.tree_util.keystr(key_path)} has shape {arr.shape} '
          f'{arr.dtype}, this model needs {ref.shape} {ref.dtype}')
    out.append(arr)
  return jax.tree.unflatten(treedef, out)


def no_params_error(older: str = '') -> CheckpointError:
  """The error for a checkpoint saved without ``params=`` (``older``: a
  note on who wrote it)."""
  return CheckpointError(
      'the checkpoint does not record which of its arrays are the model '
      f'parameters (saved without params={older})')


def stored_params(path: str | os.PathLike, like: Any) -> tuple[int, Any]:
  """``(round, the model parameters recorded in checkpoint path)`` as
  NumPy arrays in ``like``'s structure.

  Raises:
    CheckpointError: a corrupt checkpoint, none recorded (saved without
      ``params=``), or a structure, shape or dtype other than ``like``'s
      (naming the first bad variable, not the checkpoint).
  """
  meta, arrays = _arrays(path)
  section = meta.get('params')
  if not isinstance(section, Mapping):
    raise no_params_error()
  return int(meta['round']), params_as(
      like, section['treedef'], [arrays[k] for k in section['leaves']])
