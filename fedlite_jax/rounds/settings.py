"""The lane settings shared by the vmap engine and the vmap backend."""

from __future__ import annotations

import dataclasses

from fedlite_jax.checks import check_int
from fedlite_jax.common import PyTree
from fedlite_jax.rounds import stats


@dataclasses.dataclass(frozen=True)
class LaneSettings:
  """How clients are laid on lanes, as given (validated when made).

  Attributes:
    lanes_per_device: an int >= 1, or 'auto' (at most
      :func:`~fedlite_jax.rounds.stats.resolve_lanes` of the parameters'
      bytes and the device memory).
    segment_steps: lane-steps per compiled segment (>= 1).
    slots: finalizations per device and step, an int >= 1 or 'auto'.

  Raises:
    ValueError: a value outside those.
  """
  lanes_per_device: int | str = 'auto'
  segment_steps: int = 4
  slots: int | str = 'auto'

  def __post_init__(self):
    if self.lanes_per_device != 'auto':
      stats.resolve_lanes(self.lanes_per_device, 0)
    check_int(self.segment_steps, 'segment_steps')
    if self.slots != 'auto':
      check_int(self.slots, 'slots')

  def most_lanes(self, shared_input: PyTree, num_clients: int,
                 devices: int) -> int:
    """Lanes per device for a first cohort of ``num_clients``: the setting
    (``'auto'`` resolved from ``shared_input``'s bytes), at most the
    clients per device."""
    return min(stats.resolve_lanes(self.lanes_per_device,
                                   stats.tree_bytes(shared_input)),
               -(-num_clients // devices))
