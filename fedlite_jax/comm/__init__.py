"""Communication accounting (bits per client per round)."""

from fedlite_jax.comm.ledger import CommLedger
from fedlite_jax.comm.ledger import total_compression
