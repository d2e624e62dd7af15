"""Grouped matmul behind one interface: :func:`grouped_mm` and its per-platform backends."""

from epmoe.gmm.backend import BackendStatus, GmmBackend
from epmoe.gmm.op import grouped_mm
from epmoe.gmm.registry import (
    ENV_BACKEND,
    BackendChoice,
    choose_backend,
    gmm_backends,
    gmm_backends_for,
    register_gmm_backend,
    select_backend,
    unregister_gmm_backend,
)

__all__ = [
    "ENV_BACKEND",
    "BackendChoice",
    "BackendStatus",
    "GmmBackend",
    "choose_backend",
    "gmm_backends",
    "gmm_backends_for",
    "grouped_mm",
    "register_gmm_backend",
    "select_backend",
    "unregister_gmm_backend",
]
