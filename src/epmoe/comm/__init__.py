"""How tokens and counts travel between ranks: counts exchange, all-to-all-v, and the fused ops."""

from epmoe.comm.all_to_all import Traffic, all_to_all_v, count_traffic
from epmoe.comm.counts import exchange_counts
from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv

__all__ = ["Traffic", "all_to_all_v", "alltoallv_gmm", "count_traffic", "exchange_counts", "gmm_alltoallv"]
