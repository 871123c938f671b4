"""Initial model parameters from a file (transfer learning warm start).

Ro et al. (2022), Sec. 5 and App. D: centralized pretraining on another
corpus, then federated fine-tuning starting from the pretrained parameters.
``experiments/pretrain_centralized.py`` writes a parameter file with
:func:`save_params`; the runner's ``--init_checkpoint`` loads it with
:func:`load_params` in place of ``model.init(PRNGKey(seed))``.

File format: one msgpack file (``flax.serialization.msgpack_serialize``) of
``{'format': 'fedlite_jax.params', 'version': 1, 'params': <state dict>,
'metadata': <json str>}``; written atomically.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from flax import serialization
import jax
import numpy as np

PyTree = Any
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


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'--init_checkpoint={path}: no such file.')
  with open(path, 'rb') as f:
    data = f.read()
  try:
    payload = serialization.msgpack_restore(data)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'--init_checkpoint={path}: not a parameter file '
                     f'({type(e).__name__}: {e}).') from None
  if not isinstance(payload, dict) or payload.get('format') != FORMAT:
    raise ValueError(f'--init_checkpoint={path}: not a {FORMAT} file (write '
                     'it with fedlite_jax.experiment.init_params.save_params).')
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
    ValueError: not a parameter file, or a structure / shape mismatch (the
      message names the first differing variable).
  """
  payload = _read(path)
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
    if np.shape(s) != np.shape(t):
      raise ValueError(f'--init_checkpoint={os.fspath(path)}: variable '
                       f'{name} has shape {np.shape(s)}, the model needs '
                       f'{np.shape(t)}.')
  restored = serialization.from_state_dict(like, saved)
  return jax.tree.map(lambda r, t: np.asarray(r, dtype=np.asarray(t).dtype),
                      restored, like)


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}/{k}' if prefix else str(k)))
    return out
  return {prefix: tree}
