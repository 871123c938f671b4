"""Round engines: run the client updates of a round and reduce them.

The algorithm code (``fedlite_jax.algorithms``) describes a client update as a
:class:`ClientProgram` (FedJAX's ``client_init`` / ``client_step`` /
``client_final`` shape); an engine runs the sampled clients of a round and
returns the weighted sum of their outputs. The engines give the same result
to float tolerance; which is fastest depends on the platform (see
``benchmarks/bench_fedavg.py``). ``sharding`` splits a round's clients over
the devices (and hosts) of a ``jax.sharding.Mesh``. For FedJAX's own
``for_each_client`` algorithms, :class:`VmapBackend` runs clients as
vmapped programs in chunks and :class:`CompressedBackend` adds download/upload
compression with a communication ledger.
"""

from fedlite_jax.rounds.chunking import Chunk
from fedlite_jax.rounds.chunking import bucket_steps
from fedlite_jax.rounds.chunking import plan_chunks
from fedlite_jax.rounds.chunking import recording_stats
from fedlite_jax.rounds.chunking import resolve_clients_per_chunk
from fedlite_jax.rounds.compressed_backend import CompressedBackend
from fedlite_jax.rounds.engine import ClientProgram
from fedlite_jax.rounds.engine import ClientWork
from fedlite_jax.rounds.engine import ENGINE_NAMES
from fedlite_jax.rounds.engine import LoopEngine
from fedlite_jax.rounds.engine import RoundResult
from fedlite_jax.rounds.engine import VmapEngine
from fedlite_jax.rounds.engine import VmappedClients
from fedlite_jax.rounds.engine import default_engine_name
from fedlite_jax.rounds.engine import make_engine
from fedlite_jax.rounds.fedjax_backend import VmapBackend
from fedlite_jax.rounds.remote import RemoteClientDataset
from fedlite_jax.rounds.sharding import ClientMesh
from fedlite_jax.rounds.sharding import current_client_mesh
from fedlite_jax.rounds.sharding import make_client_mesh
from fedlite_jax.rounds.sharding import use_client_mesh
