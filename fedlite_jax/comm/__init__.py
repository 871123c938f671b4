"""Communication accounting (bits per client per round)."""

from fedlite_jax.comm.ledger import CommLedger, total_compression
