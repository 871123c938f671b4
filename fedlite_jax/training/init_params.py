"""Initial model parameters from a file (transfer learning warm start).

Source: Ro et al. (2022), Sec. 5 and App. D (centralized pretraining, then
federated fine-tuning). A parameter file is one msgpack dict ``{'format':
FORMAT, 'version', 'params': <state dict>, 'metadata': <json str>}``;
``--init_checkpoint`` also takes a runner round checkpoint (an orbax
directory ``<output_dir>/checkpoints/<round>``, or a ``ckpt_*.msgpack`` file
of fedlite_jax 644e428 and before).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any, Mapping, Optional

from flax import serialization
import jax
import numpy as np

from fedlite_jax import checkpoint
from fedlite_jax.common import PyTree

FORMAT = 'fedlite_jax.params'
VERSION = 1


def save_params(path: str | os.PathLike[str], params: PyTree,
                metadata: Optional[Mapping[str, Any]] = None) -> str:
  """Writes ``params`` (a pytree of arrays) and JSON-able ``metadata`` to
  ``path`` atomically (parents created); returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  payload = {
      'format': FORMAT,
      'version': VERSION,
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


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The metadata dict stored by :func:`save_params`."""
  return json.loads(_read(path)['metadata'])


def _read_bytes(path: str | os.PathLike[str]) -> bytes:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'--init_checkpoint={path}: no such file.')
  with open(path, 'rb') as f:
    return f.read()


def _check_exists(path: str | os.PathLike[str]) -> str:
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f'--init_checkpoint={path}: no such file or '
                            'directory.')
  return path


def file_sha256(path: str | os.PathLike[str]) -> str:
  """Hex SHA-256 of the file, or of a directory's files (their relative
  paths and contents, in path order); FileNotFoundError naming
  --init_checkpoint."""
  path = _check_exists(path)
  if not os.path.isdir(path):
    return hashlib.sha256(_read_bytes(path)).hexdigest()
  digest = hashlib.sha256()
  root = pathlib.Path(path)
  for f in sorted(p for p in root.rglob('*') if p.is_file()):
    name = f.relative_to(root).as_posix().encode()
    digest.update(len(name).to_bytes(8, 'little') + name)
    data = f.read_bytes()
    digest.update(len(data).to_bytes(8, 'little') + data)
  return digest.hexdigest()


def _decode(path: str | os.PathLike[str], data: bytes) -> Any:
  try:
    return serialization.msgpack_restore(data)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'--init_checkpoint={os.fspath(path)}: not a parameter '
                     f'file ({type(e).__name__}: {e}).') from None


def _is_params_file(payload: Any) -> bool:
  return isinstance(payload, dict) and payload.get('format') == FORMAT


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
  payload = _decode(path, _read_bytes(path))
  if not _is_params_file(payload):
    raise ValueError(f'--init_checkpoint={os.fspath(path)}: not a {FORMAT} '
                     'file (write it with '
                     'fedlite_jax.training.init_params.save_params).')
  return payload


def load_params(path: str | os.PathLike[str], like: PyTree) -> PyTree:
  """Loads a :func:`save_params` file into ``like``'s structure (shapes and
  dtypes must match).

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a parameter file, or a mismatch (naming the variable).
  """
  return _params_from_payload(path, _read(path), like)


def _params_from_payload(path: str | os.PathLike[str], payload: dict[str, Any],
                         like: PyTree) -> PyTree:
  """The parameters of a decoded :func:`save_params` file, as ``like``."""
  saved = payload['params']
  target = serialization.to_state_dict(like)
  saved_flat = _flatten(saved)
  target_flat = _flatten(target)
  if set(saved_flat) != set(target_flat):
    missing = sorted(set(target_flat) - set(saved_flat))[:3]
    extra = sorted(set(saved_flat) - set(target_flat))[:3]
    raise ValueError(f'--init_checkpoint={os.fspath(path)}: variables differ '
                     f'from the model (missing {missing}, unexpected '
                     f'{extra}); was it written for another --model?')
  for name, t in target_flat.items():
    s = saved_flat[name]
    s, t = np.asarray(s), np.asarray(t)
    if s.shape != t.shape or s.dtype != t.dtype:
      raise ValueError(f'--init_checkpoint={os.fspath(path)}: variable '
                       f'{name} has shape {s.shape} {s.dtype}, the model '
                       f'needs {t.shape} {t.dtype}.')
  restored = serialization.from_state_dict(like, saved)
  return jax.tree.map(np.asarray, restored)


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
  """Reads starting parameters from a parameter file or a runner checkpoint.

  Args:
    path: a :func:`save_params` file, or a runner checkpoint saved with
      ``params=`` (:class:`fedlite_jax.checkpoint.Checkpointer`: a
      ``checkpoints/<round>`` directory; or a msgpack ``ckpt_*.msgpack`` of
      the earlier format); a checkpoint gives its model (SplitFed/FedLite:
      client + server part).
    like: the model's parameters (structure, shapes and dtypes to match).

  Raises:
    FileNotFoundError: no such file or directory.
    ValueError: neither kind of file, or parameters that do not fit
      ``like``; one line starting ``--init_checkpoint=<path>:``.
  """
  path = _check_exists(path)
  digest = file_sha256(path)
  try:
    if os.path.isdir(path):
      if not checkpoint.is_checkpoint(path):
        raise _neither(path)
      round_num, params = checkpoint.stored_params(path, like)
      return InitParams(params, path, digest, 'checkpoint', round_num)
    data = _read_bytes(path)
    legacy = checkpoint.decode_legacy(data)
    if legacy is not None:
      params = checkpoint.legacy_stored_params(legacy, like)
      return InitParams(params, path, digest, 'checkpoint',
                        int(legacy['round']))
  except (checkpoint.CheckpointError, KeyError, TypeError) as e:
    raise ValueError(f'--init_checkpoint={path}: cannot start from this '
                     f'round checkpoint: {e}.') from None
  payload = _decode(path, data)
  if _is_params_file(payload):
    return InitParams(_params_from_payload(path, payload, like), path, digest,
                      'params_file')
  raise _neither(path)


def file_kind(path: str | os.PathLike[str]) -> str:
  """``'params_file'`` or ``'checkpoint'`` (as :func:`load_init_params`)."""
  path = _check_exists(path)
  if os.path.isdir(path):
    if checkpoint.is_checkpoint(path):
      return 'checkpoint'
    raise _neither(path)
  data = _read_bytes(path)
  if checkpoint.decode_legacy(data) is not None:
    return 'checkpoint'
  if _is_params_file(_decode(path, data)):
    return 'params_file'
  raise _neither(path)


def _neither(path: str) -> ValueError:
  return ValueError(f'--init_checkpoint={path}: neither a {FORMAT} file '
                    '(experiments/pretrain_centralized.py, '
                    'init_params.save_params) nor a runner checkpoint '
                    '(<output_dir>/checkpoints/<round>).')


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}/{k}' if prefix else str(k)))
    return out
  return {prefix: tree}
