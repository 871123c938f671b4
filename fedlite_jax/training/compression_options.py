"""Options shared by the compressed-update algorithms (one flag each).

The same :class:`~fedlite_jax.training.registry.Option` object is listed by
several algorithms (``registry.register`` accepts an option name used by
several algorithms when the options are identical), e.g. ``--local_steps``
for ``sgd``, ``topk``, ``fetchsgd`` and every ``igc_*``.
"""

from __future__ import annotations

import zlib

from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import nonfinite
from fedlite_jax.training import registry

Option = registry.Option

LOCAL_STEPS = Option(
    'local_steps', 0,
    'Local steps per round (each on one shuffled batch of '
    '--client_batch_size examples). 0 = the algorithm\'s default: one step '
    'for sgd/topk/fetchsgd/igc_* (one local step per update as in '
    'Melas-Kyriazi & Wang (2022) and FetchSGD), --client_epochs passes over '
    'the client data for fedavg. > 0: exactly that many steps (client data '
    'reshuffled and repeated as needed); compressed algorithms then compress '
    'the model delta; fedavg becomes FedAvg with s local iterations.',
    lower_bound=0)

NONFINITE_UPDATES = Option(
    'nonfinite_updates', 'raise',
    'What to do with a client whose update is NaN/Inf (every algorithm): '
    'raise = stop the run with an error naming the clients, before the bad '
    'round is evaluated or checkpointed; skip = drop the client from its '
    'round (it uploads 0 bits; its download is still counted; summary '
    'communication.skipped_client_rounds counts them) and log a warning; a '
    'round whose clients are all skipped still stops the run. A non-finite '
    'server model stops the run either way. Not part of the checkpoint '
    'fingerprint: a run stopped by raise can resume from its last '
    'checkpoint with skip.',
    choices=nonfinite.POLICIES, affects_result=False)

TOPK_K = Option(
    'topk_k', 12_000,
    'k: entries sent per client (topk) / coordinates updated per round '
    '(fetchsgd); 1 <= k <= number of parameters.',
    lower_bound=1)

DOWNLOAD_ACCOUNTING = Option(
    'download_accounting', 'changed',
    'Download bits of topk/fetchsgd: changed = 32 bits per weight changed '
    'since the client last participated (FetchSGD/CommEfficient), dense = '
    '32 bits x all parameters.',
    choices=fedopt.DOWNLOAD_ACCOUNTING)


def local_steps(options) -> int:
  """``--local_steps`` for the one-step algorithms (0 means 1)."""
  return int(options['local_steps']) or 1


def derived_seed(option_value: int, run_seed: int, salt: bytes) -> int:
  """``option_value`` if >= 0, else a 32-bit seed derived from the run seed."""
  if option_value >= 0:
    return int(option_value) % 2**32
  return zlib.crc32(salt + int(run_seed).to_bytes(8, 'little', signed=True))
