"""Files on disk: round checkpoints, parameter files, the legacy format.

Round checkpoints (``<directory>/<round>/``, orbax) are
:mod:`~fedlite_jax.training.checkpoint_files`'s, re-exported here. A
parameter file (Ro et al. (2022), Sec. 5, App. D: pretraining, then
federated fine-tuning) is one msgpack dict ``{'format': PARAMS_FORMAT,
'version', 'params', 'metadata': <json str>}``. ``ckpt_<round>.msgpack``
files (fedlite_jax 644e428 and before) are not resumed, but their
parameters load. Errors name paths and values, never command-line flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
from typing import Any, Mapping, Optional

from flax import serialization
import jax
import numpy as np

from fedlite_jax.common import PyTree
from fedlite_jax.training.checkpoint_files import (  # noqa: F401 (re-exported)
    FORMAT, FORMAT_VERSION, CheckpointError, Checkpointer, is_checkpoint,
    latest_checkpoint, metadata_differences, no_params_error, params_as,
    read_leaves, restore_checkpoint, restore_items, save_checkpoint,
    stored_params)

PARAMS_FORMAT = 'fedlite_jax.params'
PARAMS_VERSION = 1
#: The last commit that wrote msgpack checkpoints.
LEGACY_COMMIT = '644e428'
_LEGACY_NAME = re.compile(r'^ckpt_(\d{8})\.msgpack$')


# --- Round checkpoints of 644e428 and before (msgpack) -----------------------

def legacy_checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
  """The msgpack checkpoints of the earlier format in ``directory``, by
  round ([] for none or a missing directory)."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  return sorted((p for p in directory.iterdir() if _LEGACY_NAME.match(p.name)),
                key=lambda p: p.name)


def legacy_error(directory: str | os.PathLike) -> CheckpointError:
  """The one-line error for resuming from msgpack checkpoints."""
  found = legacy_checkpoints(directory)
  return CheckpointError(
      f'{directory} holds checkpoints in the msgpack format of fedlite_jax '
      f'{LEGACY_COMMIT} and before ({found[-1].name if found else "none"}); '
      'this version resumes only its orbax checkpoints (load_init_params '
      'still reads their model parameters).')


def decode_legacy(data: bytes) -> Optional[dict[str, Any]]:
  """A decoded msgpack checkpoint of the earlier format, or None if
  ``data`` is not one."""
  payload = _msgpack(data)
  if (isinstance(payload, Mapping) and 'format_version' in payload and
      'leaves' in payload and 'round' in payload):
    return dict(payload)
  return None


def legacy_stored_params(payload: Mapping[str, Any], like: Any) -> Any:
  """The model parameters a msgpack checkpoint of the earlier format
  recorded (``params=``), as NumPy arrays in ``like``'s structure.

  Raises:
    CheckpointError: as :func:`stored_params`.
  """
  section = payload.get('params')
  if not isinstance(section, Mapping):
    raise no_params_error(', e.g. by an older fedlite_jax')
  saved = section['leaves']
  values = [payload['leaves'][str(v)] if isinstance(v, int) else v
            for v in (saved[str(j)] for j in range(len(saved)))]
  return params_as(like, section['treedef'], values)


# --- Parameter files and the dispatch on what a path holds -------------------

def save_params(path: str | os.PathLike[str], params: PyTree,
                metadata: Optional[Mapping[str, Any]] = None) -> str:
  """Writes ``params`` (a pytree of arrays) and JSON-able ``metadata`` to
  ``path`` atomically (parents created); returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  payload = {
      'format': PARAMS_FORMAT,
      'version': PARAMS_VERSION,
      'params': serialization.to_state_dict(
          jax.tree.map(np.asarray, params)),
      'metadata': json.dumps(dict(metadata or {}), sort_keys=True,
                             default=str),
  }
  tmp = f'{path}.{os.getpid()}.partial'
  with open(tmp, 'wb') as f:
    f.write(serialization.msgpack_serialize(payload))
  os.replace(tmp, path)
  return path


def file_sha256(path: str | os.PathLike[str]) -> str:
  """Hex SHA-256 of the file, or of a directory's files (their relative
  paths and contents, in path order).

  Raises:
    FileNotFoundError: ``'<path>: no such file or directory.'``
  """
  root = pathlib.Path(_existing(path))
  if not root.is_dir():
    return hashlib.sha256(root.read_bytes()).hexdigest()
  digest = hashlib.sha256()
  for f in sorted(p for p in root.rglob('*') if p.is_file()):
    name = f.relative_to(root).as_posix().encode()
    digest.update(len(name).to_bytes(8, 'little') + name)
    data = f.read_bytes()
    digest.update(len(data).to_bytes(8, 'little') + data)
  return digest.hexdigest()


def _msgpack(data: bytes) -> Any:
  """``data`` decoded as msgpack, or None if it is not msgpack."""
  try:
    return serialization.msgpack_restore(data)
  except Exception:  # pylint: disable=broad-except
    return None


def _existing(path: str | os.PathLike[str]) -> str:
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no such file or directory.')
  return path


def _open(path: str | os.PathLike[str]) -> tuple[str, Any]:
  """The one dispatch on what ``path`` holds: ``('orbax', meta)``,
  ``('legacy', payload)`` or ``('params_file', payload)``.

  Raises:
    FileNotFoundError: no such path.
    CheckpointError: a directory that is not a readable round checkpoint.
    ValueError: a file of none of the three kinds.
  """
  path = _existing(path)
  if os.path.isdir(path):
    return 'orbax', restore_items(path, ('meta',)).meta
  with open(path, 'rb') as f:
    data = f.read()
  payload = _msgpack(data)
  if isinstance(payload, dict) and payload.get('format') == PARAMS_FORMAT:
    return 'params_file', payload
  if (legacy := decode_legacy(data)) is not None:
    return 'legacy', legacy
  raise ValueError(
      f'{path}: not a parameter file ({PARAMS_FORMAT}, written by save_params '
      'or experiments/pretrain_centralized.py), a round checkpoint directory '
      f'(<directory>/<round>) or a msgpack checkpoint of fedlite_jax '
      f'{LEGACY_COMMIT} and before.')


def file_kind(path: str | os.PathLike[str]) -> str:
  """``'params_file'`` or ``'checkpoint'`` (orbax or msgpack).

  Raises:
    FileNotFoundError: no such path.
    ValueError: none of those (``'<path>: ...'``).
  """
  try:
    kind, _ = _open(path)
  except CheckpointError as e:
    raise ValueError(f'{os.fspath(path)}: {e}') from None
  return 'params_file' if kind == 'params_file' else 'checkpoint'


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The metadata dict a round checkpoint, legacy checkpoint or parameter
  file was written with.

  Raises:
    FileNotFoundError, ValueError: as :func:`file_kind`.
    CheckpointError: a directory that is not a readable round checkpoint.
  """
  kind, contents = _open(path)
  if kind == 'orbax':
    return dict(contents['metadata'])
  return json.loads(contents['metadata'])


@dataclasses.dataclass(frozen=True)
class InitParams:
  """Starting parameters (numpy) read by :func:`load_init_params` from
  ``path`` (hex ``sha256``), a ``'params_file'`` or ``'checkpoint'``
  (``source``) of ``round`` completed rounds (None for a parameter file)."""
  params: PyTree
  path: str
  sha256: str
  source: str
  round: Optional[int] = None

  def describe(self) -> dict[str, Any]:
    """JSON-ready description (no arrays), for ``summary.json``."""
    return {'path': self.path, 'sha256': self.sha256, 'source': self.source,
            'round': self.round}


def load_init_params(path: str | os.PathLike[str], like: PyTree) -> InitParams:
  """Reads starting parameters from a parameter file or a round checkpoint.

  Args:
    path: a :func:`save_params` file, or a round checkpoint saved with
      ``params=`` (a :class:`Checkpointer` ``<directory>/<round>``, or a
      ``ckpt_*.msgpack`` of the earlier format); a checkpoint gives its
      model (SplitFed/FedLite: client + server part).
    like: the model's parameters (structure, shapes and dtypes to match).

  Raises:
    FileNotFoundError: no such file or directory.
    ValueError: none of those kinds, or parameters that do not fit
      ``like``; one line starting ``<path>:``.
  """
  path = os.fspath(path)
  digest = file_sha256(path)
  try:
    kind, contents = _open(path)
    if kind == 'orbax':
      round_num, params = stored_params(path, like)
      return InitParams(params, path, digest, 'checkpoint', round_num)
    if kind == 'legacy':
      return InitParams(legacy_stored_params(contents, like), path, digest,
                        'checkpoint', int(contents['round']))
  except (CheckpointError, KeyError, TypeError) as e:
    raise ValueError(f'{path}: cannot start from this round checkpoint: '
                     f'{e}.') from None
  return InitParams(_params_from_file(path, contents, like), path, digest,
                    'params_file')


def _params_from_file(path: str, payload: dict[str, Any],
                      like: PyTree) -> PyTree:
  """The parameters of a decoded :func:`save_params` file, as ``like``."""
  saved = payload['params']
  saved_flat = _flatten(saved)
  target_flat = _flatten(serialization.to_state_dict(like))
  if set(saved_flat) != set(target_flat):
    missing = sorted(set(target_flat) - set(saved_flat))[:3]
    extra = sorted(set(saved_flat) - set(target_flat))[:3]
    raise ValueError(f'{path}: variables differ from the model (missing '
                     f'{missing}, unexpected {extra}); was it written for '
                     'another model?')
  for name, t in target_flat.items():
    s, t = np.asarray(saved_flat[name]), np.asarray(t)
    if s.shape != t.shape or s.dtype != t.dtype:
      raise ValueError(f'{path}: variable {name} has shape {s.shape} '
                       f'{s.dtype}, the model needs {t.shape} {t.dtype}.')
  return jax.tree.map(np.asarray, serialization.from_state_dict(like, saved))


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}/{k}' if prefix else str(k)))
    return out
  return {prefix: tree}
