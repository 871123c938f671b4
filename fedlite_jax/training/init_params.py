"""Initial model parameters from a file (transfer learning warm start).

Ro et al. (2022), Sec. 5 and App. D: centralized pretraining on another
corpus, then federated fine-tuning starting from the pretrained parameters.
``experiments/pretrain_centralized.py`` writes a parameter file with
:func:`save_params`; the runner's ``--init_checkpoint`` loads it with
:func:`load_params` in place of ``model.init(PRNGKey(seed))``.

File format: one msgpack file (``flax.serialization.msgpack_serialize``) of
``{'format': 'fedlite_jax.params', 'version': 1, 'params': <state dict>,
'metadata': <json str>}``; written atomically.

:func:`load_init_params` (the runner's loader) also takes one of the
runner's own round checkpoints (``<output_dir>/checkpoints/ckpt_*.msgpack``,
:mod:`fedlite_jax.checkpoint`): the run starts from that run's model
parameters (its server model; for SplitFed / FedLite the merged client and
server model), with a fresh optimizer state and ledger.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
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
  """Writes ``params`` (any pytree of arrays) to ``path``.

  Args:
    path: destination file (parent directories are created).
    params: the model parameters.
    metadata: JSON-serializable description (corpus, steps, model, ...).

  Returns:
    The path written (str).
  """
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


def file_sha256(path: str | os.PathLike[str]) -> str:
  """Hex SHA-256 of the file's bytes (its identity in run fingerprints).

  Raises:
    FileNotFoundError: no such file (names ``--init_checkpoint``).
  """
  return hashlib.sha256(_read_bytes(path)).hexdigest()


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
  """Loads parameters shaped like ``like`` (e.g. ``model.init(key)``).

  Args:
    path: a file written by :func:`save_params`.
    like: the target pytree (structure, shapes, dtypes to match).

  Returns:
    A pytree with ``like``'s structure holding the file's arrays (as
    ``like``'s dtypes).

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a parameter file, or a structure / shape / dtype
      mismatch (the message names the first differing variable).
  """
  return _params_from_payload(path, _read(path), like)


def _params_from_payload(path: str | os.PathLike[str], payload: dict[str, Any],
                         like: PyTree) -> PyTree:
  """The parameters of a decoded :func:`save_params` file, shaped like ``like``."""
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
  """Starting parameters read by :func:`load_init_params`.

  Attributes:
    params: the parameters (``like``'s structure, numpy arrays).
    path: the file read.
    sha256: hex SHA-256 of the file's bytes (its identity in run
      fingerprints and ``summary.json``).
    source: ``'params_file'`` (:func:`save_params`) or ``'checkpoint'`` (a
      runner round checkpoint).
    round: the checkpoint's number of completed rounds (None for a
      parameter file).
  """
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
    path: a :func:`save_params` file (e.g. from
      ``experiments/pretrain_centralized.py``) or a runner checkpoint
      ``<output_dir>/checkpoints/ckpt_*.msgpack`` saved with its parameters
      recorded (:func:`fedlite_jax.checkpoint.save_checkpoint` ``params=``).
    like: the model's parameters (structure, shapes and dtypes to match).

  Returns:
    The parameters with the file's SHA-256 and kind.

  Raises:
    FileNotFoundError: no such file.
    ValueError: neither kind of file, or parameters that do not fit
      ``like``; one line starting ``--init_checkpoint=<path>:``.
  """
  path = os.fspath(path)
  data = _read_bytes(path)
  digest = hashlib.sha256(data).hexdigest()
  payload = _decode(path, data)
  if _is_params_file(payload):
    return InitParams(_params_from_payload(path, payload, like), path, digest,
                      'params_file')
  if checkpoint.is_checkpoint(payload):
    try:
      params = checkpoint.stored_params(payload, like)
      round_num = int(payload['round'])
    except (checkpoint.CheckpointError, KeyError, TypeError, ValueError) as e:
      raise ValueError(f'--init_checkpoint={path}: cannot start from this '
                       f'round checkpoint: {e}.') from None
    return InitParams(params, path, digest, 'checkpoint', round_num)
  raise ValueError(f'--init_checkpoint={path}: neither a {FORMAT} file '
                   '(experiments/pretrain_centralized.py, '
                   'init_params.save_params) nor a runner checkpoint '
                   '(<output_dir>/checkpoints/ckpt_*.msgpack).')


def file_kind(path: str | os.PathLike[str]) -> str:
  """``'params_file'`` or ``'checkpoint'``: which kind ``path`` is (no model needed).

  Raises:
    FileNotFoundError: no such file.
    ValueError: neither kind; one line starting ``--init_checkpoint=<path>:``.
  """
  path = os.fspath(path)
  payload = _decode(path, _read_bytes(path))
  if _is_params_file(payload):
    return 'params_file'
  if checkpoint.is_checkpoint(payload):
    return 'checkpoint'
  raise ValueError(f'--init_checkpoint={path}: neither a {FORMAT} file '
                   '(experiments/pretrain_centralized.py, '
                   'init_params.save_params) nor a runner checkpoint '
                   '(<output_dir>/checkpoints/ckpt_*.msgpack).')


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}/{k}' if prefix else str(k)))
    return out
  return {prefix: tree}
