"""Fused communication and compute: ``alltoallv_gmm`` (dispatch) and ``gmm_alltoallv`` (combine).

The layouts of ``torch_npu.npu_alltoallv_gmm`` / ``npu_gmm_alltoallv``, on every ``torch.distributed``
backend and trainable. They keep the vendor's per-slot layout: one row per (token, expert), so a token
with several experts on one rank travels there once per expert (the EP layer's default all-to-all-v
transport sends it once per rank: :mod:`epmoe.ep.dispatch`). ``W = 2`` ranks, ``e = 2`` local
experts, global expert ``g = r*e + j``; ``aRJ`` / ``bRJ`` are the rows rank 0 / rank 1 route to
local expert ``J`` of rank ``R``::

    dispatch input x, rank-major (r, j)          dispatch output y / permuted, expert-major (j, s)
    send_counts[r*e + j]                         recv_counts[s*e + j]

    rank 0: [a00][a01][a10][a11]   --a2a-->      rank 0: [a00][b00][a01][b01]
    rank 1: [b00][b01][b10][b11]   permute       rank 1: [a10][b10][a11][b11]
                                                          j=0 s=0,1  j=1 s=0,1

    combine output y, rank-major (r, j)  <--a2a--  combine input x, expert-major (j, s)
    = the dispatch input's order       unpermute   send_counts = the dispatch's recv_counts,
                                                   recv_counts = the dispatch's send_counts

Implementations (``impl=``)::

    reference   one all-to-all-v, one row gather, one grouped matmul; plain autograd   reference.py
    pipelined   rounds over local-expert ranges, async all-to-all overlapping the       pipelined.py
                grouped matmuls and the shared expert; hand-written backward            autograd.py
    npu_fused   the torch_npu ops where every constraint holds on every rank            npu.py
    auto        npu_fused where eligible, else pipelined

Row orders as offsets: :mod:`~epmoe.comm.layout`; validation and the public entry points:
:mod:`~epmoe.comm.fused.ops`.
"""

from epmoe.comm.fused.ops import IMPLS, alltoallv_gmm, gmm_alltoallv

__all__ = ["IMPLS", "alltoallv_gmm", "gmm_alltoallv"]
