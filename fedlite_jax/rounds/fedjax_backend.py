"""A vmapped (and device-sharded) ``fedjax.ForEachClientBackend``.

FedJAX's own algorithms (``fedjax.algorithms.fed_avg``, ``fed_prox``,
``mime_lite``, ...) and any user algorithm written with
``fedjax.for_each_client`` run their clients through a backend. FedJAX's
``jit`` backend calls a jitted step per client per batch from Python; its
``pmap`` backend needs one device per client. :class:`VmapBackend` runs all
clients of a call as ONE compiled program, the program of
:class:`~fedlite_jax.rounds.VmapEngine`
(:class:`~fedlite_jax.rounds.engine.VmappedClients`): ``jax.vmap`` over
clients, ``lax.scan`` over local steps (padded with masked no-op steps to a
power of two), and the clients split over a
:class:`~fedlite_jax.rounds.sharding.ClientMesh` when several devices are
present (padding clients with zero inputs fill the last device; their
outputs are dropped). Select it without touching the
algorithm, BEFORE building it (FedJAX binds the backend when the algorithm
calls ``fedjax.for_each_client``, i.e. at construction)::

  fedjax.set_for_each_client_backend(fedlite_jax.rounds.VmapBackend())
  algorithm = fedjax.algorithms.fed_avg.federated_averaging(...)
  # or: with fedjax.for_each_client_backend(VmapBackend()):
  #       algorithm = ...  (built inside; apply may run outside)

Speed: on GPU/TPU this is the layout of choice. On XLA:CPU a vmap + scan
around a convolutional training step is far slower than FedJAX's per-step
jit calls (``benchmarks/results/scaling.md``: ~40x for the EMNIST CNN), as
for :class:`~fedlite_jax.rounds.VmapEngine`; small dense models are fine.

Same results as FedJAX's ``jit`` backend to float tolerance
(``tests/test_fedjax_backend.py``); ``benchmarks/bench_scaling.py`` times it.

Requirements: every batch of every client in one call must have the same
structure and shapes (true for ``shuffle_repeat_batch`` and
``padded_batch``, which FedJAX's algorithms use); a mismatch raises
``ValueError`` naming the client.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import fedjax
import jax
import numpy as np

from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.rounds import sharding

PyTree = Any


def _signature(tree: PyTree) -> tuple:
  return jax.tree.structure(tree), tuple(
      (np.shape(x), np.result_type(x).name) for x in jax.tree.leaves(tree))


class VmapBackend(fedjax.ForEachClientBackend):
  """``for_each_client`` as one vmapped, optionally sharded, program.

  Args:
    mesh: the devices to split clients over; None uses every local device
      (:func:`~fedlite_jax.rounds.sharding.make_client_mesh`). A mesh of one
      device is plain vmap on that device.
    step_bucket: local-step padding: 'pow2' (default), 'exact' or an int
      budget (see :class:`~fedlite_jax.rounds.VmapEngine`).

  Raises:
    ValueError: from the returned function, for batches whose shapes differ
      between clients or steps, or a client with no batches when others
      have some and shapes cannot be inferred.
  """

  def __init__(self, mesh: Optional[sharding.ClientMesh] = None,
               step_bucket: str | int = 'pow2'):
    self._mesh = mesh
    self._bucket = step_bucket

  def __call__(self, client_init, client_step, client_final):
    mesh = self._mesh or sharding.make_client_mesh()
    if mesh.multi_process:
      raise ValueError('VmapBackend runs the clients of one process; with '
                       'several processes use the fedlite_jax round engines.')
    program = engine_lib.VmappedClients(
        client_init, client_step, client_final,
        mesh=mesh if mesh.num_devices > 1 else None)

    def run(shared_input: PyTree,
            clients: Iterable[tuple[Any, Iterable[PyTree], PyTree]]
            ) -> Iterator[tuple[Any, PyTree, list[PyTree]]]:
      clients = [(cid, list(batches), cin) for cid, batches, cin in clients]
      if not clients:
        return
      with_batches = [c for c in clients if c[1]]
      if not with_batches:
        raise ValueError('for_each_client: no client has any batch.')
      sig = _signature(with_batches[0][1][0])
      for cid, batches, _ in clients:
        for b in batches:
          if _signature(b) != sig:
            raise ValueError(
                f'VmapBackend needs equally shaped batches; client {cid!r} '
                f'has {_signature(b)[1]} vs {sig[1]}. Use shuffle_repeat_batch '
                'or padded_batch, or the jit backend.')
      steps = engine_lib.bucket_steps(max(len(b) for _, b, _ in clients),
                                      self._bucket)
      outputs, step_results = program(
          shared_input, [b for _, b, _ in clients],
          [cin for _, _, cin in clients], steps)
      # One unstack per leaf (not one slice per client per leaf); step
      # results are small and come to the host at once. Single process:
      # client i is row i; padding rows follow and are dropped.
      leaves, treedef = jax.tree.flatten(outputs)
      per_leaf = [list(x) for x in leaves]
      step_results = jax.device_get(step_results)
      for i, (cid, client_batches, _) in enumerate(clients):
        output = jax.tree.unflatten(treedef, [leaf[i] for leaf in per_leaf])
        results = [jax.tree.map(lambda x, i=i, t=t: x[i, t], step_results)
                   for t in range(len(client_batches))]
        yield cid, output, results

    return run
