"""epmoe.platform with device availability patched: as a CPU-only process on any host, and its
accelerator branches against stand-in device modules (no device claims)."""

import inspect
import types

import pytest
import torch

from epmoe import platform


@pytest.fixture
def no_accelerator(monkeypatch):
    """No accelerator is seen, whatever this host has."""
    monkeypatch.setattr(platform, "device_module", lambda t: None)


def test_cpu_process(no_accelerator):
    assert platform.device_type() == "cpu"
    assert platform.current_device() == torch.device("cpu")
    assert platform.comm_backend() == "gloo"
    assert platform.synchronize() is None
    assert platform.device_capability() is None
    assert platform.new_stream(torch.zeros(1)) is None
    with platform.stream(None):
        pass
    platform.wait_stream(None)


@pytest.mark.parametrize(
    "obj,kind",
    [
        (torch.zeros(1), "cpu"),
        (torch.device("meta"), "meta"),
        ("cuda:1", "cuda"),
        ("npu", "npu"),
        (torch.nn.Linear(2, 2), "cpu"),
        (torch.nn.Module(), "cpu"),
        (torch.zeros(1, device="meta"), "meta"),
    ],
)
def test_device_type_of_objects(obj, kind):
    assert platform.device_type(obj) == kind


def test_device_type_rejects_other_objects():
    with pytest.raises(TypeError, match="device_type"):
        platform.device_type(3)


@pytest.mark.parametrize("kind,backend", [("cuda", "nccl"), ("npu", "hccl"), ("xpu", "xccl"), ("cpu", "gloo")])
def test_comm_backend_per_device_type(kind, backend):
    assert platform.comm_backend(kind) == backend


def test_comm_backend_argument_is_device_type():
    """API.md: comm_backend(device_type=None), keyword included."""
    assert list(inspect.signature(platform.comm_backend).parameters) == ["device_type"]
    assert platform.comm_backend(device_type="npu") == "hccl"


def test_comm_backend_unknown():
    with pytest.raises(ValueError, match=r"comm_backend\(device_type\): unknown device type 'tpu'"):
        platform.comm_backend("tpu")


def test_npu_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setattr(platform, "torch_npu", lambda: None)
    monkeypatch.delattr(torch, "npu", raising=False)
    assert platform.device_module("npu") is None
    assert not platform.is_available("npu")
    assert platform.is_available("cpu")


class _FakeDeviceModule(types.SimpleNamespace):
    """Stands in for torch.npu / torch.cuda where the test only checks what epmoe calls."""


def _fake(monkeypatch, kind):
    """Make ``kind`` the only available accelerator; returns the calls its module receives."""
    calls = []
    module = _FakeDeviceModule(
        is_available=lambda: True,
        synchronize=lambda device=None: calls.append(("synchronize", device)),
        current_device=lambda: 3,
        get_device_capability=lambda device=None: calls.append(("capability", device)) or (9, 0),
        Stream=lambda device=None: types.SimpleNamespace(device=device),
    )
    monkeypatch.setattr(platform, "device_module", lambda t: module if t == kind else None)
    return calls


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_accelerator_branches(monkeypatch, kind):
    calls = _fake(monkeypatch, kind)
    assert platform.device_type() == kind  # the first available accelerator wins
    if kind == "cuda":  # torch.device("npu", 3) exists only once torch_npu is imported
        assert platform.current_device() == torch.device(kind, 3)
    assert platform.comm_backend() == {"npu": "hccl", "cuda": "nccl"}[kind]
    platform.synchronize()
    assert calls == [("synchronize", None)]  # the current device
    platform.synchronize("cpu")  # nothing to wait for on the host
    assert calls == [("synchronize", None)]
    assert platform.device_capability() == ((9, 0) if kind == "cuda" else None)


@pytest.mark.parametrize(
    "kind,device",
    [("cuda", "cuda:1"), ("cuda", torch.device("cuda", 1)), ("npu", "npu:1")],  # torch.device("npu") needs torch_npu
    ids=str,
)
def test_indexed_device_reaches_the_device_module(monkeypatch, kind, device):
    """synchronize / new_stream / device_capability act on device 1 itself, not the current device."""
    calls = _fake(monkeypatch, kind)
    platform.synchronize(device)
    assert calls == [("synchronize", 1)]
    assert platform.new_stream(device).device == 1
    assert platform.new_stream(kind).device is None  # no index: the current device
    if kind == "cuda":
        assert platform.device_capability(device) == (9, 0) and calls[-1] == ("capability", 1)


def test_npu_preferred_over_cuda(monkeypatch):
    module = _FakeDeviceModule(is_available=lambda: True)
    monkeypatch.setattr(platform, "device_module", lambda t: module if t in ("npu", "cuda") else None)
    assert platform.device_type() == "npu"


@pytest.mark.multirank
def test_exchange_counts_synchronises_through_platform(monkeypatch):
    """Counts read on the host only after platform.synchronize (the seed's NPU race)."""
    from ranks import start_ranks

    # two header exchanges (lengths, then counts), each read only after synchronising, once (the
    # counts exchange reads the rank's own send counts with what it received)
    order = ["collective", "synchronize", "tolist"] * 2
    assert start_ranks(_sync_order_worker, 2, timeout=60) == [order] * 2


def _sync_order_worker(rank, world):
    import torch.distributed as dist

    from epmoe.comm import counts, steps

    order = []
    real_a2a, real_sync, real_tolist = dist.all_to_all_single, steps.platform.synchronize, torch.Tensor.tolist
    steps.dist.all_to_all_single = lambda *a, **k: (order.append("collective"), real_a2a(*a, **k))[1]
    steps.platform.synchronize = lambda device=None: (order.append("synchronize"), real_sync(device))[1]
    torch.Tensor.tolist = lambda self: (order.append("tolist"), real_tolist(self))[1]
    try:
        counts.exchange_counts(torch.tensor([1, 2, 3, 4]))
    finally:
        steps.dist.all_to_all_single, steps.platform.synchronize = real_a2a, real_sync
        torch.Tensor.tolist = real_tolist
    return order
