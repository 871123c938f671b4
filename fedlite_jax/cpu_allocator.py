"""XLA:CPU's per-call buffers without a page fault per 4 KiB.

XLA:CPU allocates a program's outputs and temporaries at every call. glibc
serves blocks over 32 MiB (and any block too large for a thread's arena)
with a fresh ``mmap`` and unmaps it on free, so each call faults its memory
in again, 4 KiB at a time: ~96k page faults per call of a vmapped FEMNIST
CNN step over 10 lanes (194 ms; 100 ms without them). Two remedies, both
with the same results:

* **huge pages** (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc >= 2.35,
  where the kernel gives transparent huge pages on request): the same
  mmaps fault in 2 MiB at a time and memory is still returned on free. glibc
  reads it only when a process starts: the experiment binary starts itself
  again once with it (:func:`restart_with_huge_pages`).
* **tuned** (``FEDLITE_CPU_ALLOCATOR=tuned``): ``mallopt`` before JAX starts
  its CPU threads (no ``mmap`` for large blocks, no trimming, one arena), so
  blocks are reused; faster still, but freed memory stays with the process
  and peak memory grew by up to 2x (``docs/performance.md``). Opt-in.

GPU and TPU buffers do not come from glibc; nothing here was measured there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from typing import Mapping

#: Environment variable read by :func:`configure` when no mode is given.
ENV = 'FEDLITE_CPU_ALLOCATOR'
#: ``'system'`` (default): glibc's settings; ``'tuned'``: see module doc.
MODES = ('system', 'tuned')
#: Set to ``0`` to keep the binary from starting itself again.
HUGE_PAGES_ENV = 'FEDLITE_CPU_HUGE_PAGES'
HUGE_PAGES_TUNABLE = 'glibc.malloc.hugetlb=1'
_THP = '/sys/kernel/mm/transparent_hugepage/enabled'

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1),
             (_M_ARENA_MAX, 1))

#: What :func:`configure` did: ``'tuned'``, or ``'system'`` with the reason
#: after a colon.
STATE = 'system: not configured'


def glibc_version() -> tuple[int, ...]:
  """(major, minor) of glibc; () on another C library."""
  name, version = platform.libc_ver()
  if name != 'glibc' or not version:
    return ()
  return tuple(int(v) for v in version.split('.')[:2])


def thp_mode(path: str = _THP) -> str:
  """The kernel's transparent huge page mode (``always``, ``madvise``,
  ``never``), '' where unknown."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return ''
  return text.split('[', 1)[1].split(']', 1)[0] if '[' in text else ''


def huge_pages(environ: Mapping[str, str] = os.environ,
               thp: str | None = None) -> bool:
  """Whether glibc's large blocks get huge pages in this process (``thp``:
  the kernel's mode, None reads it)."""
  thp = thp_mode() if thp is None else thp
  return thp == 'always' or (
      thp == 'madvise' and 'glibc.malloc.hugetlb=' in environ.get(
          'GLIBC_TUNABLES', '') and glibc_version() >= (2, 35))


def restart_env(environ: Mapping[str, str], thp_mode: str,
                glibc: tuple[int, ...]) -> dict[str, str] | None:
  """The environment to start again with (huge pages on request), or None
  where nothing would change: not glibc >= 2.35, the kernel's mode is not
  ``madvise``, ``glibc.malloc.hugetlb`` already set, or
  ``FEDLITE_CPU_HUGE_PAGES=0``."""
  tunables = environ.get('GLIBC_TUNABLES', '')
  if (environ.get(HUGE_PAGES_ENV, '1') == '0' or thp_mode != 'madvise'
      or glibc < (2, 35) or 'glibc.malloc.hugetlb=' in tunables):
    return None
  env = dict(environ)
  env['GLIBC_TUNABLES'] = ':'.join(filter(None, (tunables,
                                                 HUGE_PAGES_TUNABLE)))
  return env


def restart_with_huge_pages() -> None:
  """Replaces this process by itself (same PID, arguments and interpreter
  options) with :data:`HUGE_PAGES_TUNABLE` added, where JAX's default
  backend is the CPU and :func:`restart_env` says it helps; returns
  otherwise (GPU/TPU buffers do not come from glibc). Call it first thing
  in a program's main.

  Raises:
    OSError: the interpreter could not be started again (``os.execve``).
  """
  env = restart_env(os.environ, thp_mode(), glibc_version())
  if env is None:
    return
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == 'cpu':
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def configure(mode: str | None = None) -> str:
  """Sets glibc's allocator for XLA:CPU (see module doc); importing
  :mod:`fedlite_jax` calls it.

  Args:
    mode: one of :data:`MODES`; None reads ``$FEDLITE_CPU_ALLOCATOR``
      (default ``'system'``).

  Returns:
    :data:`STATE`, also stored there, plus ``', huge pages'`` where
    :func:`huge_pages`.

  Raises:
    ValueError: an unknown mode.
  """
  global STATE
  if mode is None:
    mode = os.environ.get(ENV, 'system')
  if mode not in MODES:
    raise ValueError(f'{ENV}={mode!r} is not a CPU allocator mode; use one '
                     f'of {", ".join(MODES)}.')
  why = 'default' if mode == 'system' else ''
  if not why and not glibc_version():
    why = 'not glibc'
  if not why:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      why = 'JAX had already started its CPU threads'
      logging.warning('CPU allocator not tuned: %s (import fedlite_jax '
                      'before running JAX computations).', why)
  if not why:
    mallopt = ctypes.CDLL(None).mallopt
    if not all(mallopt(p, v) == 1 for p, v in _SETTINGS):
      why = 'mallopt refused a setting'
  STATE = (f'system: {why}' if why else 'tuned') + (
      ', huge pages' if huge_pages() else '')
  return STATE
