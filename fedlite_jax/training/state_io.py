"""Files on disk: round checkpoints, parameter files, the legacy format.

A round checkpoint ``<directory>/<round>/`` is written by orbax's
CheckpointManager (a temporary directory renamed when complete, in a
background thread; the newest ``keep`` kept; a killed save's leftovers
removed by the next :class:`Checkpointer`): ``arrays`` (the state's leaves,
``'3'``, and model parameters that are not leaves, ``'p0'``) and ``meta``
(JSON: format, round, the run's metadata, treedef, zero-size leaves, which
leaves are the parameters); restoring checks all of it. A parameter file
(Ro et al. (2022), Sec. 5, App. D: pretraining, then federated fine-tuning)
is one msgpack dict ``{'format': PARAMS_FORMAT, 'version', 'params',
'metadata': <json str>}``. ``ckpt_<round>.msgpack`` files (fedlite_jax
644e428 and before) are not resumed, but their parameters load. Errors name
paths and values, never command-line flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
from typing import Any, Mapping, Optional

from absl import logging
from flax import serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from fedlite_jax.common import PyTree

FORMAT = 'fedlite_jax.checkpoint'
FORMAT_VERSION = 2
PARAMS_FORMAT = 'fedlite_jax.params'
PARAMS_VERSION = 1
#: The last commit that wrote msgpack checkpoints.
LEGACY_COMMIT = '644e428'
_ITEMS = ('arrays', 'meta')
_LEGACY_NAME = re.compile(r'^ckpt_(\d{8})\.msgpack$')


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


# --- Round checkpoints (orbax) -----------------------------------------------

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


def _restore(path: str | os.PathLike, items: tuple[str, ...]) -> Any:
  """The named items of checkpoint ``path``, or CheckpointError."""
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
    _restore(path, ('meta',))
  except CheckpointError:
    return False
  return True


def _arrays(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """``(meta, {key: array})`` of a checkpoint, zero-size arrays included."""
  restored = _restore(path, ('meta', 'arrays'))
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


def _params_as(like: Any, treedef_str: str, values: list[Any]) -> Any:
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


def _no_params(older: str = '') -> CheckpointError:
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
    raise _no_params()
  return int(meta['round']), _params_as(
      like, section['treedef'], [arrays[k] for k in section['leaves']])


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
    raise _no_params(', e.g. by an older fedlite_jax')
  saved = section['leaves']
  values = [payload['leaves'][str(v)] if isinstance(v, int) else v
            for v in (saved[str(j)] for j in range(len(saved)))]
  return _params_as(like, section['treedef'], values)


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
    return 'orbax', _restore(path, ('meta',)).meta
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
