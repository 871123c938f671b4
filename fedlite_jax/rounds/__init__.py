"""Round engines (:func:`make_engine`) and ``for_each_client`` backends."""

from fedlite_jax.rounds.compressed_backend import CompressedBackend
from fedlite_jax.rounds.engine import ClientProgram
from fedlite_jax.rounds.engine import ClientWork
from fedlite_jax.rounds.engine import ENGINE_NAMES
from fedlite_jax.rounds.engine import LoopEngine
from fedlite_jax.rounds.engine import RoundResult
from fedlite_jax.rounds.engine import VmapEngine
from fedlite_jax.rounds.engine import default_engine_name
from fedlite_jax.rounds.engine import make_engine
from fedlite_jax.rounds.errors import EngineConfigError
from fedlite_jax.rounds.errors import SettingError
from fedlite_jax.rounds.fedjax_backend import VmapBackend
from fedlite_jax.rounds.lanes import LanePlan
from fedlite_jax.rounds.lanes import choose_lanes
from fedlite_jax.rounds.lanes import choose_slots
from fedlite_jax.rounds.lanes import plan_lanes
from fedlite_jax.rounds.remote import RemoteClientDataset
from fedlite_jax.rounds.sharding import ClientMesh
from fedlite_jax.rounds.sharding import current_client_mesh
from fedlite_jax.rounds.sharding import make_client_mesh
from fedlite_jax.rounds.sharding import use_client_mesh
from fedlite_jax.rounds.stats import counting_compilations
from fedlite_jax.rounds.stats import recording_stats
from fedlite_jax.rounds.stats import resolve_lanes
from fedlite_jax.rounds.streaming import LaneRun
from fedlite_jax.rounds.streaming import LaneStreams
