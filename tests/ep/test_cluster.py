"""A real two-node launch on one machine: two network namespaces joined by a shaped veth pair
(epmoe.bench.netns), ``torchrun --nnodes 2 --nproc-per-node 2`` in each, gloo over each namespace's
veth. The default config takes the two-level exchange from the launcher's environment and trains
exactly (fp64, 1e-10 against the per-rank exchange and the unsharded model); what the cluster created
is gone afterwards. Exactness, not time: the time is `epmoe bench cluster`'s. Skipped, with the
reason, where the machine cannot make network namespaces (not root, no iproute2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epmoe.bench.netns import EmulatedCluster, Link, unavailable

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


@pytest.mark.multirank
def test_training_across_two_emulated_nodes_is_exact_and_leaves_nothing(tmp_path):
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no emulated cluster here: {reason}")
    port = 29400 + os.getpid() % 500
    with EmulatedCluster(between=Link(200), inside=Link(1000)) as cluster:
        procs = []
        for node in range(EmulatedCluster.NODES):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.device(node), "OMP_NUM_THREADS": "1"}
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--node-rank", str(node), "--master-addr", cluster.address(0), "--master-port", str(port),
                    str(HERE / "cluster_script.py"), str(tmp_path)]  # fmt: skip
            procs.append(
                cluster.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        try:
            outputs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        assert all(proc.returncode == 0 for proc in procs), "\n".join(o[-4000:] for o in outputs)
    assert cluster.leftovers() == []
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in results] == ["0", "0", "1", "1"]
    for rank, result in enumerate(results):
        assert result["transports"] == ["nodes"], (rank, result)
        assert result["errors"] <= 1e-10, (rank, result)


@pytest.mark.multirank  # runs ip and tc
def test_a_cluster_removes_what_it_made_when_its_body_raises():
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no emulated cluster here: {reason}")
    with pytest.raises(ZeroDivisionError), EmulatedCluster(between=Link(80)) as cluster:
        assert len(cluster.leftovers()) == 2  # its two namespaces
        raise ZeroDivisionError
    assert cluster.leftovers() == []


def test_link_shapes():
    assert Link(None).qdisc("lo") is None
    command = Link(80).qdisc("v0")
    assert command[:8] == ["tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate"] and command[8] == "80mbit"
    assert int(command[command.index("burst") + 1]) >= 2 * 65536  # a loopback frame fits twice
