"""The two-level exchange (``dispatch="nodes"``): its topology, its config, and (multirank) exactness
against the per-rank exchange and the unsharded model on emulated nodes (node_workers)."""

import pytest
import torch

import epmoe
from epmoe.ep.counts import _node_columns
from epmoe.ep.routing import destinations_TW
from epmoe.ep.topology import NodeLayout, layout_of, nodes_of_ranks, two_level_layout

TOL = 1e-10


def test_layout_groups():
    layout = NodeLayout(ranks_per_node=4, nodes=2)
    assert layout.node_ranks(6) == [4, 5, 6, 7] and layout.rail_ranks(6) == [2, 6]
    assert NodeLayout(2, 3).rail_ranks(1) == [1, 3, 5]


def test_ranks_per_node_must_divide_the_ep_size():
    config = epmoe.ExpertParallelConfig(ranks_per_node=3)
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\(ranks_per_node\): 3 does not divide the EP size 4"):
        nodes_of_ranks(config, None, 4, 10.0)
    told = epmoe.ExpertParallelConfig(ranks_per_node=2)
    assert nodes_of_ranks(told, None, 4, 10.0) == [0, 0, 1, 1]
    assert two_level_layout(told, [0, 0, 1, 1], 0) == NodeLayout(2, 2)
    assert two_level_layout(told, [0], 0) is None  # a group of one exchanges nothing


@pytest.mark.parametrize(
    ("nodes_by_rank", "layout"),
    [
        ([0, 0, 1, 1], NodeLayout(2, 2)),
        ([5, 5, 5, 5], NodeLayout(4, 1)),
        ([0, 1, 2, 3], NodeLayout(1, 4)),
        ([0, 0, 0, 1], None),  # uneven blocks
        ([0, 1, 1, 1], None),
        ([0, 1, 0, 1], None),  # not consecutive
        ([1, 1, 1, 1, 2, 2], None),  # 3 nodes of 8, EP 6: the group [12-17]
        ([0, 0, 1, 1, 1, 1], None),  # the group [6-11]
    ],
)
def test_layout_of_the_launchers_nodes(nodes_by_rank, layout):
    assert layout_of(nodes_by_rank) == layout


@pytest.mark.parametrize(
    ("options", "told"),
    [
        ({}, 2),  # "auto" over 2 nodes of 2
        ({"capacity_factor": 1.0}, None),  # capacity's global order: the per-rank exchange
        ({}, 4),  # one node
        ({}, 1),  # one rank per node: nothing to gather per node
        ({"dispatch": "nodes"}, 1),  # asked for: run as told
        ({"dispatch": "alltoallv"}, None),
    ],
)
def test_auto_takes_the_two_level_exchange_over_nodes_of_several_ranks(options, told):
    config = epmoe.ExpertParallelConfig(**options, ranks_per_node=told)
    expected = {
        (2, False): NodeLayout(2, 2),
        (1, True): NodeLayout(1, 4),
    }.get((told, options.get("dispatch") == "nodes"))
    nodes_by_rank = [r // (told or 2) for r in range(4)]
    assert two_level_layout(config, nodes_by_rank, 0) == expected
    assert two_level_layout(config, nodes_by_rank, 0, shares_batch=True) is None


def test_nodes_refuses_a_layout_it_cannot_serve_naming_each_ranks_node():
    config = epmoe.ExpertParallelConfig(dispatch="nodes")
    with pytest.raises(ValueError, match=r"dispatch='nodes'\).*\[0, 1, 1, 1\]"):
        two_level_layout(config, [0, 1, 1, 1], 2)
    assert two_level_layout(epmoe.ExpertParallelConfig(), [0, 1, 1, 1], 2) is None


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_ranks_per_node_is_validated(value):
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\(ranks_per_node\)"):
        epmoe.ExpertParallelConfig(ranks_per_node=value)


@pytest.mark.parametrize(
    "options",
    [
        {"dispatch": "alltoallv", "ranks_per_node": 2},
        {"dispatch": "static", "ranks_per_node": 2},  # sync-free across nodes: not served, by name
        {"dispatch": "nodes", "capacity_factor": 1.0},
    ],
    ids=["alltoallv", "static", "capacity"],
)
def test_what_the_two_level_exchange_cannot_serve_is_refused(options):
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\((ranks_per_node|capacity_factor|replicas)\)"):
        epmoe.ExpertParallelConfig(**options)


def test_node_columns_tell_each_rail_peer_its_rows():
    """A sender's columns: to its rail peer on each node, its rows for that node and for each rank
    there; zeros to the others (EP 4 = 2 nodes x 2; sender = EP rank 1, local index 1)."""
    index = torch.tensor([[0, 3], [1, 2], [4, 5], [6, 7], [0, 1]])  # e = 2 experts per rank
    dest_TW = destinations_TW(index, 2, 4)  # ranks: t0 -> 0, 1; t1 -> 0, 1; t2 -> 2; t3 -> 3; t4 -> 0
    columns = _node_columns(dest_TW, rank=1, P=2)
    assert columns[0].tolist() == [0, 0, 0]  # rank 0: another local index
    assert columns[2].tolist() == [0, 0, 0]
    assert columns[1].tolist() == [3, 3, 2]  # its own node: 3 tokens; 3 rows for rank 0, 2 for rank 1
    assert columns[3].tolist() == [2, 1, 1]  # node 1: 2 tokens (t2, t3); 1 row for rank 2, 1 for rank 3


# --------------------------------------------------------------------------------------------
# multirank: exactness (node_workers), two spawns


@pytest.fixture
def four_ranks(tmp_path_factory):
    from node_workers import four_rank_run
    from ranks import start_ranks

    return start_ranks(four_rank_run, 4, str(tmp_path_factory.getbasetemp() / "nodes"), timeout=600, once=True)


@pytest.fixture
def eight_ranks():
    from node_workers import eight_rank_run
    from ranks import start_ranks

    return start_ranks(eight_rank_run, 8, timeout=900, once=True)


def assert_module(results, key):
    for rank, result in enumerate(results):
        for name, case in result[key].items():
            assert case["transport"] == "nodes", case["transport"]
            for k, err in {**case["errors"], **{f"alltoallv/{k}": v for k, v in case["plain"].items()}}.items():
                assert err <= 1e-12, f"rank {rank} {key}/{name}: {k} relative error {err:.3g}"
            for k, nonzero in case["exact_zero"].items():
                assert nonzero == 0, f"rank {rank} {key}/{name}: an expert without tokens has a nonzero gradient ({k})"


def assert_exact(results, key):
    for rank, result in enumerate(results):
        res = result[key]
        worst = max(res["errors"], key=res["errors"].get)
        assert res["errors"][worst] <= TOL, f"rank {rank} {key}: {worst} relative error {res['errors'][worst]:.3g}"
        assert res["transports"] == ["nodes"] and res["load_equal"], res


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["module_2x2", "module_1x4", "module_2x2_replicas"])
def test_experts_module_at_2x2_and_on_one_node(four_ranks, key):
    """Random top-2 and top-4, a rank with no tokens, an expert with none, a node that receives
    nothing, every slot on one expert; fp64, against the unsharded module and the per-rank exchange;
    with expert replicas too (their moved slots through both hops, their weights lent)."""
    assert_module(four_ranks, key)
    if key.endswith("replicas"):
        assert all(case["moves"] > 0 for result in four_ranks for case in result[key].values())


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["ddp", "fsdp2", "checkpointing", "auto", "mesh_inside", "mesh_across", "replicas_ddp"])
def test_training_over_two_nodes_equals_per_rank_and_unsharded(four_ranks, key):
    """3 clipped AdamW steps, ranks of different batch sizes: DDP, FSDP2, gradient checkpointing,
    dispatch="auto" told only the node size, EP x DP meshes whose EP group sits inside one node or
    spans two, expert replicas on; losses, logits, every gradient, clip norms, parameters;
    expert_load the same."""
    assert_exact(four_ranks, key)
    if key == "replicas_ddp":
        assert all(result[key]["moves"] > 0 for result in four_ranks)


@pytest.mark.multirank
def test_auto_takes_the_per_rank_exchange_where_the_nodes_are_not_blocks(four_ranks):
    """Launcher nodes [0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 0, 1] (uneven or scattered blocks): under
    ``"auto"`` every rank takes the per-rank exchange (EP rank 0 logs why once) and trains exactly;
    ``dispatch="nodes"`` raises ValueError on every rank naming each rank's node; [0, 0, 1, 1] takes
    the two-level exchange."""
    from node_workers import LAYOUTS_4

    for rank, result in enumerate(four_ranks):
        for name, nodes in LAYOUTS_4.items():
            seen = result["launcher_layouts"][name]
            if name == "blocks":
                assert seen["auto"] == ["nodes"] and seen["nodes"] is None and not seen["logged"], seen
                continue
            assert seen["auto"] == ["alltoallv"], (rank, name, seen)
            assert str(nodes) in (seen["nodes"] or ""), (rank, name, seen)
            assert "ExpertParallelConfig(dispatch='nodes')" in seen["nodes"], seen["nodes"]
            said = [m for m in seen["logged"] if "takes the per-rank exchange" in m and str(nodes) in m]
            assert len(said) == (1 if rank == 0 else 0), (rank, name, seen["logged"])
        inside, between, nodes = result["launcher_layouts"]["uneven_1_3"]["links"]
        assert nodes == LAYOUTS_4["uneven_1_3"] and inside > 0 and between > 0, (inside, between, nodes)
        training = result["launcher_layouts"]["uneven_1_3"]["training"]
        worst = max(training["errors"], key=training["errors"].get)
        assert training["errors"][worst] <= TOL and training["transports"] == ["alltoallv"], (worst, training)


@pytest.mark.multirank
def test_transformers_ep_keeps_node_groups_only_while_their_ep_group_lives(four_ranks):
    assert all(result["node_groups_freed"] == [] for result in four_ranks), [r["node_groups_freed"] for r in four_ranks]


@pytest.mark.multirank
def test_link_costs_are_measured_per_class_and_agreed_or_set(four_ranks):
    """With replicas on, apply measures flops per byte inside a node and between nodes (2 x 2 emulated:
    both loopback here), the same figures on every rank; a config's figures are taken as they are."""
    measured = [result["link_costs"]["measured"] for result in four_ranks]
    assert all(seen == measured[0] for seen in measured), measured
    inside, between, was_measured, nodes = measured[0]
    assert was_measured and nodes == [0, 0, 1, 1] and 0 < inside < 1e6 and 0 < between < 1e6, measured[0]
    assert all(r["link_costs"]["set"] == (80.0, 900.0, False, [0, 0, 1, 1]) for r in four_ranks)


@pytest.mark.multirank
def test_apply_logs_the_whole_models_parameter_count(four_ranks):
    """A framework prints one rank's parameters; apply's log line counts every expert once."""
    for result in four_ranks:
        lines, whole = result["parameters_logged"]
        assert len(lines) == 1 and lines[0].startswith(f"epmoe: the model holds {whole} parameters"), (lines, whole)


@pytest.mark.multirank
def test_routing_replay_and_save_pretrained_over_two_nodes(four_ranks):
    """Replayed routes give the per-rank exchange's loss and gradients; save_pretrained after a step
    writes the same tensors, which plain transformers reads back at world size 1 to the same logits."""
    for rank, result in enumerate(four_ranks):
        seen = result["replay_and_save"]
        worst = max(seen["errors"], key=seen["errors"].get)
        assert seen["errors"][worst] <= TOL, f"rank {rank}: {worst} {seen['errors'][worst]:.3g}"
        assert seen["same_keys"]


@pytest.mark.multirank
def test_two_nodes_of_four(eight_ranks):
    assert_module(eight_ranks, "module_2x4")
    assert_exact(eight_ranks, "ddp")


@pytest.mark.multirank
def test_two_ep_groups_of_different_layouts_in_one_world(eight_ranks):
    """A ("dp", "ep") mesh of 2 x 4 over launcher nodes [0, 0, 1, 1 | 1, 1, 1, 2]: the first EP group
    runs the two-level exchange, the second (uneven) the per-rank one, and DDP training over the mesh
    equals the unsharded model's on every rank (no group waits on the other)."""
    for rank, result in enumerate(eight_ranks):
        seen = result["groups_of_two_layouts"]
        worst = max(seen["errors"], key=seen["errors"].get)
        assert seen["errors"][worst] <= TOL, f"rank {rank}: {worst} {seen['errors'][worst]:.3g}"
        assert seen["transports"] == (["nodes"] if rank < 4 else ["alltoallv"]), (rank, seen["transports"])


# --------------------------------------------------------------------------------------------
# a real two-node launch on one machine: the docs' script and commands, on loopback

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _docs_multinode():
    """``(script, commands)``: the multi-node script of docs/training.md and its two torchrun lines."""
    import re

    text = (ROOT / "docs" / "training.md").read_text()
    found = re.search(r"<!-- multinode: (\S+) -->\n```python\n(.*?)```\n\n```bash\n(.*?)```", text, re.S)
    assert found, "docs/training.md: the multi-node recipe (a script and its torchrun commands) is gone"
    name, script, commands = found.groups()
    return name, script, [line.split("  #")[0].split() for line in commands.strip().splitlines()]


@pytest.mark.multirank
def test_the_docs_two_node_launch_runs_the_two_level_exchange(tmp_path):
    """Two ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K`` on loopback, ``dispatch="auto"``
    told nothing: every rank runs the two-level exchange and its losses equal the per-rank exchange's."""
    import os
    import re
    import socket
    import subprocess

    name, script, commands = _docs_multinode()
    (tmp_path / name).write_text(script)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    torchrun = (
        str(ROOT / ".venv" / "bin" / "torchrun") if (ROOT / ".venv" / "bin" / "torchrun").exists() else "torchrun"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    procs = []
    for command in commands:
        argv = [torchrun if arg == "torchrun" else arg for arg in command]
        argv = ["127.0.0.1" if arg == "$HEAD" else port if arg == "29500" else arg for arg in argv]
        procs.append(
            subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    assert all(proc.returncode == 0 for proc in procs), "\n".join(out[-3000:] for out in outs)
    text = "".join(outs)
    assert text.count("dispatch='auto' ran ['nodes']") == 4, text[-3000:]
    # the ranks of a node print to one pipe: their lines may run into each other
    differences = [float(x) for x in re.findall(r"per-rank exchange (\d\.\de[+-]\d+)", text)]
    assert len(differences) == 4 and max(differences) < 1e-10, differences


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_between_the_hops_ends_the_others_wait(how, tmp_path):
    """EP rank 3 of 2 nodes x 2 dies (SIGKILL) or hangs alive after hop 1: the launcher names it and
    every other rank raises within the timeout (4 s), naming the hop and its ranks, never a hang."""
    import json

    from node_workers import failing_run
    from ranks import start_ranks

    from epmoe.launch import RankError

    with pytest.raises(RankError) as info:
        start_ranks(failing_run, 4, how, str(tmp_path), timeout=120)
    if how == "dies":
        assert str(info.value).startswith("rank 3 died, killed by SIGKILL"), str(info.value)
    failed = json.loads((tmp_path / "failed.json").read_text())["time"]
    survivors = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for seen in survivors:
        assert seen["type"] == "RuntimeError" and seen["time"] - failed < 15, seen
    messages = " ".join(seen["message"] for seen in survivors)
    assert "the two-level exchange's hop 2, inside the node (EP ranks [2, 3])" in messages, messages


def test_the_counts_rows_columns_and_width():
    """One object says where each extra column of a counts row sits and how wide the row is: e counts,
    total, dtype, then rows, the guard, (with replicas) the key (inside, between) and E slots,
    (two-level) 1 + P splits."""
    from epmoe.ep.config import ExpertShard
    from epmoe.ep.counts import GUARD, CountsRow

    plain, both = CountsRow(2), CountsRow(2, experts=8, ranks_per_node=2)
    assert plain.width == 2 + 3 + GUARD and plain.nodes == slice(5, 5)
    assert both.guard == slice(1, 1 + GUARD) and both.key == slice(1 + GUARD, 3 + GUARD)
    assert both.slots == slice(7, 15) and both.nodes == slice(15, 18) and both.width == 2 + 2 + 18
    assert CountsRow(2, ranks_per_node=4).nodes == slice(5, 10)
    shards = [ExpertShard("a", 8, 2, 0, 2, 0, 4), ExpertShard("b", 16, 4, 0, 4, 0, 4)]
    assert CountsRow.widest(shards, True, 2) == CountsRow(4, 16, 2).width


@pytest.mark.parametrize(
    "given", [-1.0, float("nan"), True, "10", {"inside": 1.0}, {"inside": 1.0, "between": 2.0, "rail": 3.0}]
)
def test_flops_per_link_byte_is_validated(given):
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\(flops_per_link_byte\)"):
        epmoe.ExpertParallelConfig(flops_per_link_byte=given)


def test_link_costs_price_a_link_by_its_class():
    from epmoe.ep.links import LinkCosts

    links = LinkCosts((0, 0, 1, 1), inside=50.0, between=600.0)
    assert links.flops_per_byte(0, 1) == 50.0 and links.flops_per_byte(1, 2) == 600.0
    a = epmoe.ExpertParallelConfig(flops_per_link_byte={"between": 2, "inside": 1})
    assert a == epmoe.ExpertParallelConfig(flops_per_link_byte={"inside": 1, "between": 2})
    assert repr(a.flops_per_link_byte) == "{'inside': 1, 'between': 2}"  # one order: one code on every rank
