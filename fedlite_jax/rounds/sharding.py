"""Clients of a round split across devices and hosts (``jax.sharding``).

Per-client inputs are sharded along a one-axis mesh, the shared input is
replicated, and the sum over clients becomes an all-reduce. Row layout over
processes: docs/notes/engines.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import dataclasses
import math
import socket
import threading
import time
from typing import Any, Iterator, Optional

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from fedlite_jax.rounds import errors

AXIS = 'clients'


@dataclasses.dataclass(frozen=True)
class ClientMesh:
  """A one-axis device mesh over which the clients of a round are split.

  Attributes:
    mesh: ``jax.sharding.Mesh`` with the single axis ``'clients'``; devices
      ordered by (process index, device id).
  """
  mesh: Mesh

  @property
  def num_devices(self) -> int:
    """Devices in the mesh, over all processes."""
    return int(self.mesh.devices.size)

  @property
  def num_processes(self) -> int:
    """Processes owning the mesh's devices."""
    return len({d.process_index for d in self.mesh.devices.flat})

  @property
  def process_index(self) -> int:
    """This process's index (``jax.process_index()``)."""
    return jax.process_index()

  @property
  def multi_process(self) -> bool:
    """Whether the mesh spans several processes."""
    return self.num_processes > 1

  def padded_size(self, cohort_size: int) -> int:
    """``ceil(cohort_size / num_devices) * num_devices`` (clients)."""
    return math.ceil(cohort_size / self.num_devices) * self.num_devices

  def _counts(self, cohort_size: int) -> np.ndarray:
    """Real clients per process: as even as possible, earlier ones first."""
    p = self.num_processes
    return np.asarray([cohort_size // p + (i < cohort_size % p)
                       for i in range(p)])

  def local_clients(self, cohort_size: int,
                    process_index: Optional[int] = None) -> tuple[int, int]:
    """``[lo, hi)``: the cohort positions a process runs and loads.

    Raises errors.SettingError (a ValueError) for a cohort smaller than the
    number of processes.
    """
    if cohort_size < self.num_processes:
      raise errors.SettingError(
          f'A cohort of {cohort_size} clients cannot be split over '
          f'{self.num_processes} processes; clients_per_round must be >= '
          f'{self.num_processes}.', 'clients_per_round')
    counts = self._counts(cohort_size)
    p = self.process_index if process_index is None else process_index
    lo = int(counts[:p].sum())
    return lo, lo + int(counts[p])

  def owner(self, position: int, cohort_size: int) -> int:
    """The process that runs (and loads the data of) cohort ``position``."""
    bounds = np.cumsum(self._counts(cohort_size))
    return int(np.searchsorted(bounds, position, side='right'))

  def is_local(self, position: int, cohort_size: int) -> bool:
    """Whether this process runs cohort ``position``."""
    return self.owner(position, cohort_size) == self.process_index

  @property
  def client_sharding(self) -> NamedSharding:
    """Leading (client) axis split over the mesh."""
    return NamedSharding(self.mesh, P(AXIS))

  @property
  def replicated(self) -> NamedSharding:
    """The same array on every device of the mesh."""
    return NamedSharding(self.mesh, P())

  def put_clients(self, local: np.ndarray, cohort_size: int) -> jax.Array:
    """A global client-sharded ``[C_pad, ...]`` array from this process's block.

    ``local``: its ``[C_pad / P, ...]`` rows; ``cohort_size``: the unpadded C.
    """
    global_shape = (self.padded_size(cohort_size),) + tuple(local.shape[1:])
    if not self.multi_process:
      return jax.device_put(local, self.client_sharding)
    return jax.make_array_from_process_local_data(self.client_sharding, local,
                                                  global_shape)

  def put_replicated(self, tree: Any) -> Any:
    """The same pytree on every device of the mesh."""
    if not self.multi_process:
      return jax.device_put(tree, self.replicated)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            self.replicated, np.asarray(x), np.shape(x)), tree)

  def gather(self, tree: Any) -> Any:
    """NumPy copies of (possibly non-addressable) global arrays."""
    if not self.multi_process:
      return jax.device_get(tree)
    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
        tree)


def local_device_count_error(num_devices: int) -> Optional[str]:
  """Why ``num_devices`` is not allowed here, or None when it is."""
  present = jax.local_device_count()
  if num_devices < 1 or num_devices > present:
    return (f'num_devices={num_devices}: must be between 1 and the '
            f'{present} local {jax.default_backend()} device(s) present '
            f'({", ".join(str(d) for d in jax.local_devices())}). On CPU, '
            'the XLA flag xla_force_host_platform_device_count=N (in the '
            'XLA_FLAGS environment variable) simulates N devices.')
  return None


def make_client_mesh(num_devices: Optional[int] = None) -> ClientMesh:
  """A :class:`ClientMesh` over ``num_devices`` local devices per process.

  Args:
    num_devices: devices of each process (default: all local ones).

  Raises:
    errors.SettingError: (a ValueError) ``num_devices`` < 1 or more than the
      local devices present.
  """
  if num_devices is None:
    num_devices = jax.local_device_count()
  error = local_device_count_error(num_devices)
  if error:
    raise errors.SettingError(error, 'num_devices')
  if jax.process_count() > 1:
    counts = multihost_utils.process_allgather(np.int32(num_devices))
    if len(set(np.asarray(counts).ravel().tolist())) != 1:
      raise errors.SettingError(
          f'num_devices differs across processes: {np.asarray(counts)}; '
          'every process must use the same number of local devices.',
          'num_devices')
  devices = []
  for p in range(jax.process_count()):
    local = sorted((d for d in jax.devices() if d.process_index == p),
                   key=lambda d: d.id)
    devices.extend(local[:num_devices])
  return ClientMesh(Mesh(np.asarray(devices), (AXIS,)))


_CURRENT = threading.local()


def current_client_mesh() -> Optional[ClientMesh]:
  """The mesh set by :func:`use_client_mesh` in this thread (or None)."""
  return getattr(_CURRENT, 'mesh', None)


@contextlib.contextmanager
def use_client_mesh(mesh: Optional[ClientMesh]) -> Iterator[None]:
  """Engines built inside this context split clients over ``mesh``."""
  previous = current_client_mesh()
  _CURRENT.mesh = mesh
  try:
    yield
  finally:
    _CURRENT.mesh = previous


class DistributedInitError(RuntimeError):
  """``jax.distributed`` could not be initialized (e.g. no coordinator).

  Attributes:
    settings: the setting names the message quotes (see
      :class:`errors.SettingError`).
  """

  settings = ('coordinator_address', 'num_processes')


def initialize_distributed(coordinator_address: str, num_processes: int,
                           process_id: int, timeout_s: int = 60) -> None:
  """``jax.distributed.initialize`` with CPU collectives and a clear timeout.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: number of processes (>= 1).
    process_id: this process's index in ``[0, num_processes)``.
    timeout_s: seconds to wait for every process to connect.

  Raises:
    errors.SettingError: (a ValueError) process_id out of range or a bad
      address.
    DistributedInitError: (process > 0) the coordinator was not reachable
      within ``timeout_s`` (process 0 is ended by XLA with DEADLINE_EXCEEDED).
  """
  if num_processes < 1:
    raise errors.SettingError(
        f'num_processes={num_processes}: must be >= 1.', 'num_processes')
  if not 0 <= process_id < num_processes:
    raise errors.SettingError(
        f'process_id={process_id}: must be in [0, {num_processes}) for '
        f'num_processes={num_processes}.', 'process_id', 'num_processes')
  host, _, port = coordinator_address.rpartition(':')
  if not host or not port.isdigit():
    raise errors.SettingError(
        f'coordinator_address={coordinator_address!r}: must be host:port, '
        'e.g. localhost:12355.', 'coordinator_address')
  if process_id != 0:
    # XLA aborts the process when the coordinator is unreachable: probe.
    _wait_for_port(host, int(port), timeout_s, coordinator_address,
                   process_id, num_processes)
  # CPU collectives; set before any backend is initialized.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=timeout_s)


def _wait_for_port(host: str, port: int, timeout_s: float, address: str,
                   process_id: int, num_processes: int) -> None:
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedInitError(
            f'Process {process_id} of {num_processes} could not reach the '
            f'jax.distributed coordinator at {address} within {timeout_s:g} '
            f's ({e}). Start process 0 with the same coordinator_address '
            'and num_processes, and check that the port is reachable.'
        ) from None
      time.sleep(0.2)


def barrier(name: str) -> None:
  """Waits until every process reaches this point (no-op in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def check_same_across_processes(name: str, value: Any) -> None:
  """Raises ValueError if ``value`` (e.g. the flags) differs by process."""
  if jax.process_count() == 1:
    return
  digest = np.frombuffer(
      hashlib.sha256(repr(value).encode()).digest()[:8],
      np.int64).copy()
  digests = np.asarray(multihost_utils.process_allgather(digest)).ravel()
  if len(set(digests.tolist())) != 1:
    raise ValueError(
        f'{name} differ across processes (process {jax.process_index()} has '
        f'{value!r}); every process must be started with the same flags.')
