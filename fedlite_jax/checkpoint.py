"""Round checkpoints: save every N rounds, resume exactly, fail loudly.

A checkpoint is one msgpack file (``flax.serialization``) holding the round
number, the leaves of the run's state pytree (server state, ledger totals,
...), the pytree structure and a metadata dict (the flags that determine the
result). Files are written atomically (temporary file + ``os.replace``), so a
run killed while saving leaves the previous checkpoint intact.

Resuming checks, before anything is used: the file decodes (else
:class:`CheckpointError` "corrupt"), the metadata equals the current run's
(else "mismatched flags", naming each differing flag), and the pytree
structure, leaf shapes and dtypes equal the current model's (else "mismatched
state"). It never silently restarts from scratch.

A checkpoint saved with ``params=`` also records which of its arrays are the
model parameters (``spec.eval_params(state)``), so another run can start
from them (``--init_checkpoint``, :func:`stored_params`) whatever the
algorithm's state layout. A save killed mid-write leaves a
``.tmp_ckpt_*`` file; :func:`remove_partial_files` deletes them.
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


def checkpoint_path(directory: str | os.PathLike, round_num: int) -> pathlib.Path:
  return pathlib.Path(directory) / f'ckpt_{round_num:08d}.msgpack'


def latest_checkpoint(directory: str | os.PathLike) -> Optional[pathlib.Path]:
  """The checkpoint with the highest round in ``directory``, or None."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return None
  found = [(int(m.group(1)), p) for p in directory.iterdir()
           if (m := _NAME.match(p.name))]
  return max(found)[1] if found else None


def remove_partial_files(directory: str | os.PathLike) -> list[pathlib.Path]:
  """Deletes the temporary files of saves that were killed mid-write.

  Call it only while no other process saves into ``directory`` (the runner
  holds the output directory's lock).

  Returns:
    The paths removed.
  """
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
  """``'key: <saved_name>=<saved value> now=<current value>'`` per differing key.

  Both dicts are compared after a JSON round trip (tuples equal lists).
  """
  saved = json.loads(json.dumps(dict(saved), sort_keys=True, default=str))
  current = json.loads(json.dumps(dict(current), sort_keys=True, default=str))
  keys = sorted(set(saved) | set(current))
  return [f'{k}: {saved_name}={saved.get(k)!r} now={current.get(k)!r}'
          for k in keys if saved.get(k) != current.get(k)]


def save_checkpoint(directory: str | os.PathLike, round_num: int, state: Any,
                    metadata: Mapping[str, Any], keep: int = 2,
                    params: Any = None) -> pathlib.Path:
  """Writes ``state`` after ``round_num`` completed rounds; keeps ``keep`` files.

  Args:
    directory: where checkpoints live (created if missing).
    round_num: number of completed rounds (the round to resume at).
    state: any pytree of arrays / Python scalars.
    metadata: JSON-serializable dict compared on restore (e.g. flags).
    keep: how many most recent checkpoints to keep (>= 1).
    params: the model parameters within ``state`` (e.g.
      ``spec.eval_params(state['server'])``), recorded for
      :func:`stored_params`: as indices of ``state``'s arrays when they are
      the same objects, else as copies. None: not recorded.

  Returns:
    The path written.
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
  old = sorted((int(m.group(1)), p) for p in directory.iterdir()
               if (m := _NAME.match(p.name)))
  for _, p in old[:-keep] if keep >= 1 else []:
    p.unlink()
  return path


def _decode(path: pathlib.Path) -> tuple[int, dict, Mapping[str, Any], str]:
  """``(round, metadata, leaves, treedef)`` of a checkpoint file.

  Raises:
    CheckpointError: the file does not decode as a checkpoint.
  """
  try:
    return _fields(serialization.msgpack_restore(path.read_bytes()))
  except Exception as e:  # Any decoding failure means a corrupt file.
    raise CheckpointError(
        f'Checkpoint {path} is corrupt or not a fedlite_jax checkpoint '
        f'({type(e).__name__}: {e}). Delete it (or the output directory) to '
        'start over, or point --output_dir elsewhere.') from e


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The metadata dict a checkpoint was saved with.

  Raises:
    CheckpointError: a corrupt file.
  """
  return _decode(pathlib.Path(path))[1]


def restore_checkpoint(path: str | os.PathLike, target: Any,
                       metadata: Mapping[str, Any]) -> tuple[int, Any]:
  """Restores a checkpoint into the structure of ``target``.

  Args:
    path: the checkpoint file.
    target: a pytree with the expected structure, shapes and dtypes (e.g. the
      freshly initialized state).
    metadata: the current run's metadata; must equal the saved one.

  Returns:
    ``(round_num, state)``.

  Raises:
    CheckpointError: corrupt file, mismatched metadata or state.
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
  """Whether a decoded msgpack payload looks like a checkpoint of this module."""
  return (isinstance(payload, Mapping) and 'format_version' in payload and
          'leaves' in payload and 'round' in payload)


def stored_params(payload: Mapping[str, Any], like: Any) -> Any:
  """The model parameters recorded in a decoded checkpoint.

  Args:
    payload: ``flax.serialization.msgpack_restore`` of a checkpoint file
      saved with ``params=`` (see :func:`save_checkpoint`).
    like: the target parameters (structure, shapes and dtypes to match),
      e.g. ``model.init(key)``.

  Returns:
    A pytree with ``like``'s structure of numpy arrays.

  Raises:
    CheckpointError: no parameters recorded, or a structure, shape or dtype
      different from ``like`` (the message names the first bad variable;
      it does not name the file).
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
