"""What the round engines did: step counts, lanes, program compilations.

Counts go to the open :func:`recording_stats`; compilations are JAX's own
``backend_compile`` events (:func:`counting_compilations`). Also the
memory budget of ``lanes_per_device='auto'`` (:func:`resolve_lanes`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.common import PyTree

#: Counts summed over the engine calls of a round (and of a run).
ADDITIVE = ('clients', 'useful_steps', 'executed_steps', 'sequential_steps',
            'segments')
#: Settings of the last engine call: lanes (over all devices), steps per
#: segment, finalization slots per device and step.
SETTINGS = ('lanes', 'segment_steps', 'slots')
#: Largest over the engine calls: the longest client's local steps.
MAXIMA = ('longest_client_steps',)


class StatsRecorder:
  """Engine counts while a :func:`recording_stats` context is open.

  :data:`ADDITIVE` counts (``useful_steps``: useful steps, ``executed_steps``:
  lane-steps executed, masks included, ``sequential_steps``: steps one
  after another, ``segments``: compiled-program calls), :data:`MAXIMA`, and
  the last call's ``name`` and :data:`SETTINGS`.
  """

  def __init__(self):
    self._counts = dict.fromkeys(ADDITIVE + MAXIMA, 0)
    self._totals = dict.fromkeys(ADDITIVE + MAXIMA, 0)
    self._settings: dict[str, Any] = dict.fromkeys(('name',) + SETTINGS)

  def add(self, name: str, **counts: int) -> None:
    """Adds one call of engine ``name``; ValueError for an unknown count."""
    self._settings['name'] = name
    for k, v in counts.items():
      if k in SETTINGS:
        self._settings[k] = int(v)
      elif k in ADDITIVE:
        self._counts[k] += int(v)
        self._totals[k] += int(v)
      elif k in MAXIMA:
        self._counts[k] = max(self._counts[k], int(v))
        self._totals[k] = max(self._totals[k], int(v))
      else:
        raise ValueError(f'Unknown engine count {k!r}; allowed: '
                         f'{ADDITIVE + SETTINGS + MAXIMA}.')

  def take(self) -> dict[str, Any]:
    """The counts since the last ``take`` (then reset), and the settings."""
    out = {**self._settings, **self._counts}
    self._counts = dict.fromkeys(ADDITIVE + MAXIMA, 0)
    return out

  def totals(self) -> dict[str, Any]:
    """The counts since the recorder was opened, and the settings."""
    return {**self._settings, **self._totals}


_RECORDERS: list[StatsRecorder] = []


@contextlib.contextmanager
def recording_stats() -> Iterator[StatsRecorder]:
  """Collects the counts of every engine call made inside the context."""
  recorder = StatsRecorder()
  _RECORDERS.append(recorder)
  try:
    yield recorder
  finally:
    _RECORDERS.remove(recorder)


def record(name: str, **counts: int) -> None:
  """Adds one engine call's counts (:class:`StatsRecorder`)."""
  for recorder in _RECORDERS:
    recorder.add(name, **counts)


# --- compilations ------------------------------------------------------------

_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
_COUNTERS: list['CompileCounter'] = []
_LOCK = threading.Lock()
_LISTENING = False


class CompileCounter:
  """XLA compilations (JAX's ``backend_compile`` events) while open.

  A program loaded from JAX's persistent compilation cache
  (``JAX_COMPILATION_CACHE_DIR``) raises the same event and counts as a
  compilation; its seconds are those of the load.

  Attributes:
    by_program: ``{'jit(name)': count}``.
    seconds: ``{'jit(name)': seconds}`` of backend compilation.
  """

  def __init__(self):
    self.by_program: collections.Counter = collections.Counter()
    self.seconds: collections.Counter = collections.Counter()

  @property
  def total(self) -> int:
    """Compilations of every program."""
    return int(sum(self.by_program.values()))

  @property
  def total_seconds(self) -> float:
    """Seconds of backend compilation of every program."""
    return float(sum(self.seconds.values()))

  def count(self, *names: str) -> int:
    """Compilations of the programs called ``jit(name)`` for ``names``."""
    return int(sum(self.by_program[f'jit({n})'] for n in names))

  def summary(self, client_programs: tuple[str, ...]) -> dict[str, Any]:
    """``{'total', 'seconds', 'client_program', 'by_program'}``."""
    return {'total': self.total, 'seconds': round(self.total_seconds, 3),
            'client_program': self.count(*client_programs),
            'by_program': dict(self.by_program.most_common())}


def _listener(event: str, duration: float, **kwargs) -> None:
  if event != _COMPILE_EVENT:
    return
  name = str(kwargs.get('fun_name', '?'))
  with _LOCK:
    for counter in _COUNTERS:
      counter.by_program[name] += 1
      counter.seconds[name] += float(duration)


@contextlib.contextmanager
def counting_compilations() -> Iterator[CompileCounter]:
  """Counts the XLA compilations of this process inside the context."""
  global _LISTENING
  with _LOCK:
    if not _LISTENING:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      _LISTENING = True
    counter = CompileCounter()
    _COUNTERS.append(counter)
  try:
    yield counter
  finally:
    with _LOCK:
      _COUNTERS.remove(counter)


#: Programs that run the client updates: the vmap engine's and the loop
#: engine's (``jit(name)`` in the compile events).
CLIENT_PROGRAMS = ('lanes_begin', 'lanes_segment', 'lanes_finish',
                   'loop_init', 'loop_step', 'loop_final')


# --- the memory budget of lanes_per_device='auto' ---------------------------

#: A lane is budgeted this many copies of the parameters (optimizer state,
#: gradients, delta, carries) plus :data:`AUTO_LANE_EXTRA_BYTES` within
#: :data:`AUTO_MEMORY_FRACTION` of the device's memory, at most
#: :data:`AUTO_MAX_LANES` lanes per device.
AUTO_PARAM_COPIES = 16
AUTO_LANE_EXTRA_BYTES = 64 * 2**20
AUTO_MEMORY_FRACTION = 0.5
AUTO_MAX_LANES = 256
#: ``'auto'``'s most lanes on XLA:CPU, where a lane adds no parallel
#: hardware.
AUTO_CPU_LANES = 2


def device_memory_bytes(device: Optional[jax.Device] = None) -> int:
  """Bytes of ``device``: its allocator limit, or the host's total memory."""
  device = device or jax.local_devices()[0]
  try:
    mem = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without stats.
    mem = None
  if mem and mem.get('bytes_limit'):
    return int(mem['bytes_limit'])
  return int(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))


def resolve_lanes(value: int | str, param_bytes: int,
                  memory_bytes: Optional[int] = None) -> int:
  """Lanes per device for ``value``.

  Args:
    value: an int >= 1, or 'auto': ``floor(AUTO_MEMORY_FRACTION * memory /
      (AUTO_PARAM_COPIES * param_bytes + AUTO_LANE_EXTRA_BYTES))`` in
      ``[1, AUTO_MAX_LANES]`` (on CPU at most :data:`AUTO_CPU_LANES`).
    param_bytes: bytes of one copy of the model parameters.
    memory_bytes: the device's memory (default :func:`device_memory_bytes`).

  Raises:
    ValueError: an int < 1 or another string.
  """
  if isinstance(value, str):
    if value != 'auto':
      raise ValueError(f"lanes_per_device must be an int >= 1 or 'auto'; got "
                       f'{value!r}.')
    memory = device_memory_bytes() if memory_bytes is None else memory_bytes
    lane = AUTO_PARAM_COPIES * max(int(param_bytes), 1) + AUTO_LANE_EXTRA_BYTES
    most = AUTO_CPU_LANES if jax.default_backend() == 'cpu' else AUTO_MAX_LANES
    return int(min(max(AUTO_MEMORY_FRACTION * memory // lane, 1), most))
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
      value < 1:
    raise ValueError(f"lanes_per_device must be an int >= 1 or 'auto'; got "
                     f'{value!r}.')
  return int(value)


def tree_bytes(tree: PyTree) -> int:
  """Bytes of the arrays of ``tree``."""
  return sum(int(np.prod(np.shape(x))) * np.dtype(jnp.result_type(x)).itemsize
             for x in jax.tree.leaves(tree))
