"""Run outputs in ``output_dir``: metrics.jsonl (one row per round,
:mod:`round_metrics`), communication.csv, summary.json, tb/ (TensorBoard,
tensorboardX: the rows' scalars and the run's hparams), curves.png, run.json
(the run's fingerprint and code version) and .lock (the running pid,
``flock``). Files are written atomically or cut back to complete lines on
resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
from typing import Any, Iterator, Mapping, Optional

from fedlite_jax.training import round_metrics
from fedlite_jax.training.config import ConfigError

RUN_FILE = 'run.json'
LOCK_FILE = '.lock'
_PARTIAL_SUFFIX = '.partial'


def jsonable(x: Any) -> Any:
  """``x`` with non-finite floats as strings (JSON has no NaN/inf)."""
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {k: jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  return x


def _complete_lines(path: pathlib.Path) -> list[str]:
  """The newline-terminated lines of ``path`` (a partial last line dropped)."""
  return path.read_text().split('\n')[:-1]


def _write_atomic(path: pathlib.Path, text: str) -> None:
  """Writes ``text`` to ``path`` via a temporary file and ``os.replace``."""
  tmp = path.with_name(path.name + _PARTIAL_SUFFIX)
  tmp.write_text(text)
  os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """The rows of metrics.jsonl in the current schema
  (:func:`round_metrics.normalize_row`; [] if missing; a partial last line
  dropped)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  return [round_metrics.normalize_row(json.loads(line))
          for line in _complete_lines(path) if line]


def truncate_metrics(path: str | os.PathLike, max_round: int) -> list[dict]:
  """Keeps the complete rows with ``round <= max_round`` (for resuming)."""
  rows = [r for r in read_metrics(path) if r['round'] <= max_round]
  _write_atomic(pathlib.Path(path), ''.join(json.dumps(r) + '\n' for r in rows))
  return rows


def truncate_csv(path: str | os.PathLike, num_rounds: int) -> None:
  """Keeps the header and complete rows of rounds <= ``num_rounds`` (a file
  without a complete header is removed)."""
  path = pathlib.Path(path)
  if not path.exists():
    return
  lines = _complete_lines(path)
  if not lines:
    path.unlink()
    return
  kept = lines[:1] + [l for l in lines[1:]
                      if int(l.split(',', 1)[0]) <= num_rounds]
  _write_atomic(path, ''.join(l + '\n' for l in kept))


def clear_results(output_dir: str | os.PathLike) -> None:
  """Removes a previous run's outputs (all but the lock)."""
  out = pathlib.Path(output_dir)
  for name in ('metrics.jsonl', 'communication.csv', 'summary.json',
               'curves.png', 'curves.pdf', 'curves.svg', RUN_FILE):
    (out / name).unlink(missing_ok=True)
  for name in ('tb', 'checkpoints'):
    shutil.rmtree(out / name, ignore_errors=True)
  remove_partial_files(out)


def remove_partial_files(output_dir: str | os.PathLike) -> None:
  """Deletes the temporary files of writes killed mid-way (``*.partial``)."""
  for p in pathlib.Path(output_dir).glob('*' + _PARTIAL_SUFFIX):
    p.unlink(missing_ok=True)


def _read_run_file(output_dir: str | os.PathLike, key: str) -> Optional[dict]:
  try:
    return dict(json.loads(
        (pathlib.Path(output_dir) / RUN_FILE).read_text())[key])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def read_run_identity(output_dir: str | os.PathLike) -> Optional[dict]:
  """The fingerprint stored in ``run.json``; None if missing or unreadable."""
  return _read_run_file(output_dir, 'fingerprint')


def code_version() -> dict[str, Any]:
  """``{'commit', 'dirty'}`` of the package's git checkout (None if none)."""
  root = pathlib.Path(__file__).resolve().parents[2]

  def git(*args: str) -> Optional[str]:
    try:
      return subprocess.run(['git', '-C', str(root), *args], check=True,
                            capture_output=True, text=True,
                            timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return None

  commit = git('rev-parse', 'HEAD')
  status = git('status', '--porcelain', '--untracked-files=no', '--',
               'fedlite_jax')
  return {'commit': commit,
          'dirty': None if commit is None or status is None else bool(status)}


def read_code_version(output_dir: str | os.PathLike) -> Optional[dict]:
  """The :func:`code_version` stored in ``run.json`` (None if absent)."""
  return _read_run_file(output_dir, 'code')


def write_run_identity(output_dir: str | os.PathLike,
                       fingerprint: Mapping[str, Any],
                       code: Optional[Mapping[str, Any]] = None,
                       num_rounds: Optional[int] = None) -> None:
  """Writes ``run.json`` (``{'fingerprint', 'code', 'num_rounds'}``)
  atomically; ``code`` is informational (a resume under other code only
  warns), ``num_rounds`` the rounds the run is set to reach."""
  _write_atomic(pathlib.Path(output_dir) / RUN_FILE,
                json.dumps({'fingerprint': dict(fingerprint),
                            'code': dict(code or {}),
                            'num_rounds': num_rounds}, indent=1,
                           sort_keys=True, default=str))


def read_planned_rounds(output_dir: str | os.PathLike) -> Optional[int]:
  """The ``num_rounds`` stored in ``run.json`` (None if absent)."""
  try:
    value = json.loads((pathlib.Path(output_dir) / RUN_FILE).read_text()
                       ).get('num_rounds')
  except (OSError, ValueError, AttributeError):
    return None
  return int(value) if isinstance(value, int) else None


@contextlib.contextmanager
def lock_output_dir(output_dir: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Holds an exclusive ``flock`` on ``output_dir/.lock`` (holding the pid;
  released when the process exits or is killed); yields its path.

  Raises:
    ConfigError: another process holds it (naming its pid).
  """
  path = pathlib.Path(output_dir) / LOCK_FILE
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = path.read_text().strip() or 'unknown'
      raise ConfigError(
          f'--output_dir={output_dir} is in use by another run (pid {holder} '
          f'holds {path}); wait for it to finish or choose another '
          '--output_dir.') from None
    os.ftruncate(fd, 0)
    os.write(fd, f'{os.getpid()}\n'.encode())
    yield path
  finally:
    os.close(fd)


def _records(path: pathlib.Path) -> Iterator[bytes]:
  """The TFRecord payloads of an event file (a torn last record ends it)."""
  data = path.read_bytes()
  pos = 0
  while pos + 12 <= len(data):
    (length,) = struct.unpack('<Q', data[pos:pos + 8])
    if pos + 12 + length + 4 > len(data):
      return
    yield data[pos + 12:pos + 12 + length]
    pos += 12 + length + 4


def read_tensorboard(tb_dir: str | os.PathLike
                     ) -> tuple[dict[str, list[tuple[int, float]]],
                                dict[str, Any]]:
  """The scalars and hparams in a run's ``tb/`` event files, as TensorBoard
  shows them (a restart's ``purge_step`` drops the earlier events of steps
  >= it).

  Returns:
    ``({tag: [(step, value), ...] in step order}, {hparam: value})``.
  """
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboardX.proto import plugin_hparams_pb2  # pylint: disable=g-import-not-at-top
  scalars: dict[str, dict[int, float]] = {}
  hparams: dict[str, Any] = {}
  for path in sorted(pathlib.Path(tb_dir).glob('events.out.tfevents.*')):
    for record in _records(path):
      event = event_pb2.Event.FromString(record)
      if (event.HasField('session_log') and
          event.session_log.status == event.session_log.START):
        for points in scalars.values():
          for step in [s for s in points if s >= event.step]:
            del points[step]
      for value in event.summary.value:
        plugin = value.metadata.plugin_data
        if plugin.plugin_name == 'hparams':
          data = plugin_hparams_pb2.HParamsPluginData.FromString(
              plugin.content)
          for k, v in data.session_start_info.hparams.items():
            hparams[k] = getattr(v, v.WhichOneof('kind'))
        elif value.HasField('simple_value'):
          scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return ({tag: sorted(points.items()) for tag, points in scalars.items()},
          hparams)


def write_summary(output_dir: str | os.PathLike, summary: dict) -> pathlib.Path:
  """Writes ``summary.json`` atomically; returns its path."""
  path = pathlib.Path(output_dir) / 'summary.json'
  _write_atomic(path, json.dumps(jsonable(summary), indent=2, sort_keys=True))
  return path


def read_summary(output_dir: str | os.PathLike) -> Optional[dict]:
  """``summary.json`` of ``output_dir``; None if missing or unreadable."""
  try:
    return dict(json.loads((pathlib.Path(output_dir) /
                            'summary.json').read_text()))
  except (OSError, ValueError, TypeError):
    return None
