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


def save_checkpoint(directory: str | os.PathLike, round_num: int, state: Any,
                    metadata: Mapping[str, Any], keep: int = 2) -> pathlib.Path:
  """Writes ``state`` after ``round_num`` completed rounds; keeps ``keep`` files.

  Args:
    directory: where checkpoints live (created if missing).
    round_num: number of completed rounds (the round to resume at).
    state: any pytree of arrays / Python scalars.
    metadata: JSON-serializable dict compared on restore (e.g. flags).
    keep: how many most recent checkpoints to keep (>= 1).

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
  data = serialization.msgpack_serialize(payload)
  path = checkpoint_path(directory, round_num)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp_ckpt_')
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
  try:
    payload = serialization.msgpack_restore(path.read_bytes())
    round_num = int(payload['round'])
    saved_meta = json.loads(payload['metadata'])
    saved_leaves = payload['leaves']
    saved_treedef = payload['treedef']
  except Exception as e:  # Any decoding failure means a corrupt file.
    raise CheckpointError(
        f'Checkpoint {path} is corrupt or not a fedlite_jax checkpoint '
        f'({type(e).__name__}: {e}). Delete it (or the output directory) to '
        'start over, or point --output_dir elsewhere.') from e
  current_meta = json.loads(json.dumps(dict(metadata), sort_keys=True,
                                       default=str))
  if saved_meta != current_meta:
    keys = sorted(set(saved_meta) | set(current_meta))
    diffs = [f'{k}: checkpoint={saved_meta.get(k)!r} now={current_meta.get(k)!r}'
             for k in keys if saved_meta.get(k) != current_meta.get(k)]
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
