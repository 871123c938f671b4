"""Makes FedJAX 0.0.17 run on current JAX (>= 0.6) and NumPy 2.

``fedlite_jax/__init__.py`` calls :func:`apply` before anything imports
``fedjax``. Each fix is the smallest one and a no-op where the old name still
exists; docs/DESIGN_NOTES.md lists each break and its fix.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_APPLIED = False

# jax.tree_<name> -> jax.tree.<name>.
_TREE_ALIASES = ('map', 'leaves', 'flatten', 'unflatten', 'structure',
                 'transpose', 'reduce', 'all')


def _mesh_sharding(devices: Sequence[Any]) -> jax.sharding.NamedSharding:
  mesh = jax.sharding.Mesh(np.asarray(devices), ('devices',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('devices'))


def device_put_sharded(shards: Sequence[Any], devices: Sequence[Any]) -> Any:
  """Replacement for the removed ``jax.device_put_sharded``: ``shards`` (one
  pytree structure and leaf shapes) stacked on a new leading axis, shard
  ``i`` on ``devices[i]``; ValueError unless there is one per device."""
  if len(shards) != len(devices):
    raise ValueError(
        f'device_put_sharded: got {len(shards)} shards for {len(devices)} '
        'devices; they must be equal.')
  sharding = _mesh_sharding(devices)
  return jax.tree.map(
      lambda *xs: jax.device_put(np.stack([np.asarray(x) for x in xs]),
                                 sharding), *shards)


def device_put_replicated(x: Any, devices: Sequence[Any]) -> Any:
  """Replacement for the removed ``jax.device_put_replicated``: ``x`` with a
  new leading axis, one copy per device."""
  sharding = _mesh_sharding(devices)
  n = len(devices)
  return jax.tree.map(
      lambda v: jax.device_put(
          np.broadcast_to(np.asarray(v), (n,) + np.shape(v)), sharding), x)


def _shard(x: jax.Array, i: int) -> jax.Array:
  """Shard ``i`` of a pmapped output without its device axis (new
  ``jax.pmap`` keeps a size-1 axis in ``addressable_data(i)``)."""
  data = x.addressable_data(i)
  if data.ndim == x.ndim:
    return data[0]
  return data


def _patch_pmap_backend() -> None:
  """Replaces FedJAX's pmap backend with one fixed for JAX >= 0.6."""
  from fedjax.core import for_each_client as fec  # pylint: disable=g-import-not-at-top

  if getattr(fec.ForEachClientPmapBackend, '_fedlite_patched', False):
    return
  original = fec.ForEachClientPmapBackend

  class ForEachClientPmapBackend(original):
    """FedJAX's pmap backend, with the shard indexing fixed for new JAX."""

    _fedlite_patched = True

    def __call__(self, client_init, client_step, client_final):
      devices = self._devices or jax.local_devices()
      block_size = len(devices)
      p_client_init = jax.pmap(client_init)

      @functools.partial(jax.pmap, donate_argnums=0)
      def p_client_step(state, batch, mask):
        next_state, step_result = client_step(state, batch)
        next_state = jax.tree.map(
            functools.partial(jnp.where, mask), next_state, state)
        step_result = jax.tree.map(
            lambda x: jnp.where(mask, x, jnp.zeros_like(x)), step_result)
        return next_state, step_result

      p_client_final = jax.pmap(client_final, donate_argnums=1)

      def run(shared_input, clients):
        p_shared_input = device_put_replicated(shared_input, devices)
        for block in fec._blockify(clients, block_size):  # pylint: disable=protected-access
          p_state = p_client_init(
              p_shared_input, device_put_sharded(block.client_input, devices))
          p_step_results = []
          for p_batch, p_mask in block.masked_batches:
            p_state, p_step_result = p_client_step(
                p_state, device_put_sharded(p_batch, devices),
                device_put_sharded(p_mask, devices))
            p_step_results.append(p_step_result)
          p_client_output = p_client_final(p_shared_input, p_state)
          # Copy every client's results to host before yielding, so no
          # cross-device gather is in flight while the caller computes.
          outputs = []
          for i in range(len(block.client_id)):
            if not block.client_mask[i]:
              continue
            client_output, step_results = jax.tree.map(
                lambda x, i=i: np.asarray(_shard(x, i)),
                (p_client_output, p_step_results))
            outputs.append((block.client_id[i], client_output,
                            step_results[:block.num_batches[i]]))
          del p_client_output, p_step_results, p_state
          for client_id, client_output, step_results in outputs:
            yield client_id, *jax.tree.map(
                lambda x: jax.device_put(x, devices[0]),
                (client_output, step_results))

      return run

  fec.ForEachClientPmapBackend = ForEachClientPmapBackend


def _clip_takes_a_min() -> bool:
  try:
    return 'a_min' in inspect.signature(jnp.clip).parameters
  except (TypeError, ValueError):
    return True


def _patch_apfl_clip() -> None:
  if _clip_takes_a_min():
    return
  from fedjax.algorithms import apfl  # pylint: disable=g-import-not-at-top

  if isinstance(apfl.jnp, types.SimpleNamespace):
    return

  def clip(a, a_min=None, a_max=None, **kwargs):
    return jnp.clip(a, kwargs.pop('min', a_min), kwargs.pop('max', a_max),
                    **kwargs)

  shim = types.SimpleNamespace(**{
      name: getattr(jnp, name) for name in dir(jnp) if not name.startswith('__')
  })
  shim.clip = clip
  apfl.jnp = shim


def apply() -> None:
  """Applies every fix; idempotent. Must run before FedJAX code executes."""
  global _APPLIED
  if _APPLIED:
    return
  for new in _TREE_ALIASES:
    if not hasattr(jax, 'tree_' + new):
      setattr(jax, 'tree_' + new, getattr(jax.tree, new))
  if not hasattr(jnp, 'NINF'):
    jnp.NINF = -np.inf
  if not hasattr(np, 'issctype'):
    np.issctype = lambda t: isinstance(t, type) and issubclass(t, np.generic)
  if not hasattr(jax, 'device_put_sharded'):
    jax.device_put_sharded = device_put_sharded
  if not hasattr(jax, 'device_put_replicated'):
    jax.device_put_replicated = device_put_replicated
  _patch_pmap_backend()
  _patch_apfl_clip()
  _APPLIED = True
