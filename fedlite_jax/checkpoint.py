"""Round checkpoints: save every N rounds, resume exactly, fail loudly.

One msgpack file per checkpoint (round, state leaves, treedef, metadata such
as the flags, optionally which leaves are the model parameters), written
atomically. Restoring checks the metadata, structure, shapes and dtypes and
raises :class:`CheckpointError` on any difference; it never restarts silently.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile
from typing import Any, Mapping, Optional

from flax import serialization
import jax
import numpy as np

_NAME = re.compile(r'^ckpt_(\d{8})\.msgpack$')
_PARTIAL_PREFIX = '.tmp_ckpt_'
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
  """A checkpoint is corrupt or does not match the run resuming from it."""


def checkpoint_path(directory: str | os.PathLike,
                    round_num: int) -> pathlib.Path:
  return pathlib.Path(directory) / f'ckpt_{round_num:08d}.msgpack'


def _checkpoints(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  return sorted((int(m.group(1)), p) for p in directory.iterdir()
                if (m := _NAME.match(p.name)))


def latest_checkpoint(directory: str | os.PathLike) -> Optional[pathlib.Path]:
  """The checkpoint with the highest round in ``directory``, or None."""
  directory = pathlib.Path(directory)
  found = _checkpoints(directory) if directory.is_dir() else []
  return found[-1][1] if found else None


def remove_partial_files(directory: str | os.PathLike) -> list[pathlib.Path]:
  """Deletes (and returns) the temporary files of saves killed mid-write;
  call it only while no other process saves into ``directory``."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  removed = [p for p in directory.iterdir()
             if p.name.startswith(_PARTIAL_PREFIX) and p.is_file()]
  for p in removed:
    p.unlink()
  return removed


def metadata_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                         saved_name: str = 'checkpoint') -> list[str]:
  """``'key: <saved_name>=<saved> now=<current>'`` per differing key (after
  a JSON round trip: tuples equal lists)."""
  saved = json.loads(json.dumps(dict(saved), sort_keys=True, default=str))
  current = json.loads(json.dumps(dict(current), sort_keys=True, default=str))
  keys = sorted(set(saved) | set(current))
  return [f'{k}: {saved_name}={saved.get(k)!r} now={current.get(k)!r}'
          for k in keys if saved.get(k) != current.get(k)]


def save_checkpoint(directory: str | os.PathLike, round_num: int, state: Any,
                    metadata: Mapping[str, Any], keep: int = 2,
                    params: Any = None) -> pathlib.Path:
  """Writes ``state`` after ``round_num`` rounds atomically; returns the path.

  Args:
    directory: where checkpoints live (created if missing).
    round_num: number of completed rounds (the round to resume at).
    state: any pytree of arrays / Python scalars.
    metadata: JSON-serializable dict compared on restore (e.g. flags).
    keep: how many most recent checkpoints to keep (>= 1).
    params: the model parameters within ``state``, recorded for
      :func:`stored_params` (None: not recorded).
  """
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  leaves, treedef = jax.tree.flatten(state)
  payload = {
      'format_version': FORMAT_VERSION,
      'round': int(round_num),
      'metadata': json.dumps(dict(metadata), sort_keys=True, default=str),
      'treedef': str(treedef),
      'leaves': {str(i): np.asarray(x) for i, x in enumerate(leaves)},
  }
  if params is not None:
    index = {id(x): i for i, x in enumerate(leaves)}
    param_leaves, param_treedef = jax.tree.flatten(params)
    payload['params'] = {
        'treedef': str(param_treedef),
        # An int is the index of a state array; an array is a copy.
        'leaves': {str(j): index[id(x)] if id(x) in index else np.asarray(x)
                   for j, x in enumerate(param_leaves)},
    }
  data = serialization.msgpack_serialize(payload)
  path = checkpoint_path(directory, round_num)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=_PARTIAL_PREFIX)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  for _, p in _checkpoints(directory)[:-keep] if keep >= 1 else []:
    p.unlink()
  return path


def _decode(path: pathlib.Path) -> tuple[int, dict, Mapping[str, Any], str]:
  """``(round, metadata, leaves, treedef)`` of a file, or CheckpointError."""
  try:
    return _fields(serialization.msgpack_restore(path.read_bytes()))
  except Exception as e:  # Any decoding failure means a corrupt file.
    raise CheckpointError(
        f'Checkpoint {path} is corrupt or not a fedlite_jax checkpoint '
        f'({type(e).__name__}: {e}). Delete it (or the output directory) to '
        'start over, or point --output_dir elsewhere.') from e


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The metadata a checkpoint was saved with (CheckpointError if corrupt)."""
  return _decode(pathlib.Path(path))[1]


def restore_checkpoint(path: str | os.PathLike, target: Any,
                       metadata: Mapping[str, Any]) -> tuple[int, Any]:
  """``(round_num, state)`` of a checkpoint, as ``target``'s structure.

  Raises:
    CheckpointError: corrupt file, ``metadata`` other than the saved one, or
      a structure, shape or dtype other than ``target``'s.
  """
  path = pathlib.Path(path)
  round_num, saved_meta, saved_leaves, saved_treedef = _decode(path)
  diffs = metadata_differences(saved_meta, metadata)
  if diffs:
    raise CheckpointError(
        f'Checkpoint {path} was written with different flags; refusing to '
        f'resume. Differences: {"; ".join(diffs)}. Use the same flags, or a '
        'new --output_dir.')
  leaves, treedef = jax.tree.flatten(target)
  if saved_treedef != str(treedef) or len(saved_leaves) != len(leaves):
    raise CheckpointError(
        f'Checkpoint {path} holds a different state structure than this run '
        f'({len(saved_leaves)} vs {len(leaves)} arrays); was the model or '
        'algorithm changed?')
  restored = []
  for i, ref in enumerate(leaves):
    arr = np.asarray(saved_leaves[str(i)])
    ref_arr = np.asarray(ref)
    if arr.shape != ref_arr.shape or arr.dtype != ref_arr.dtype:
      raise CheckpointError(
          f'Checkpoint {path}: array {i} has shape {arr.shape} {arr.dtype}, '
          f'this run expects {ref_arr.shape} {ref_arr.dtype}.')
    restored.append(arr if isinstance(ref, (np.ndarray, jax.Array)) else
                    type(ref)(arr.item()) if np.ndim(ref) == 0 else arr)
  return round_num, jax.tree.unflatten(treedef, restored)


def _fields(payload: Any) -> tuple[int, dict, Mapping[str, Any], str]:
  """``(round, metadata, leaves, treedef)`` of a decoded checkpoint."""
  return (int(payload['round']), json.loads(payload['metadata']),
          payload['leaves'], payload['treedef'])


def is_checkpoint(payload: Any) -> bool:
  """Whether a decoded msgpack payload looks like a checkpoint."""
  return (isinstance(payload, Mapping) and 'format_version' in payload and
          'leaves' in payload and 'round' in payload)


def stored_params(payload: Mapping[str, Any], like: Any) -> Any:
  """The model parameters recorded (``params=``) in a decoded checkpoint,
  as numpy arrays in ``like``'s structure.

  Raises:
    CheckpointError: none recorded, or a structure, shape or dtype other
      than ``like``'s (naming the first bad variable, not the file).
  """
  section = payload.get('params')
  if not isinstance(section, Mapping):
    raise CheckpointError(
        'the checkpoint does not record which of its arrays are the model '
        'parameters (saved without params=, e.g. by an older fedlite_jax)')
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  saved = section['leaves']
  if section['treedef'] != str(treedef) or len(saved) != len(flat):
    raise CheckpointError(
        f'its model parameters have a different structure ({len(saved)} '
        f'arrays) than this model ({len(flat)} arrays); was it written for '
        'another task or --model?')
  out = []
  for j, (key_path, ref) in enumerate(flat):
    v = saved[str(j)]
    arr = np.asarray(payload['leaves'][str(v)] if isinstance(v, int) else v)
    ref = np.asarray(ref)
    if arr.shape != ref.shape or arr.dtype != ref.dtype:
      raise CheckpointError(
          f'parameter {jax.tree_util.keystr(key_path)} has shape {arr.shape} '
          f'{arr.dtype}, this model needs {ref.shape} {ref.dtype}')
    out.append(arr)
  return jax.tree.unflatten(treedef, out)
