"""How tokens and counts travel between ranks: counts exchange, all-to-all-v, and the fused ops."""

from epmoe.comm.all_to_all import all_to_all_v
from epmoe.comm.counts import exchange_counts
from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv

__all__ = ["all_to_all_v", "alltoallv_gmm", "exchange_counts", "gmm_alltoallv"]
