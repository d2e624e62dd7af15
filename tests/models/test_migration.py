"""From transformers' own expert parallelism to epmoe in one change: ``epmoe.from_pretrained(cls, path,
distributed_config=DistributedConfig(ep_size=N, fsdp_size=M))`` takes the config a transformers user
already has and trains exactly like the unsharded model (EP over the world on 2 ranks; ``ep_size=2,
fsdp_size=4`` on 4, each expert on two ranks); what it cannot map raises naming the field, and a model
transformers sharded at load is refused by ``apply_expert_parallel`` with that one change in its
message."""

import pytest
from ranks import start_ranks

pytest.importorskip("transformers.distributed")

EXACT = 1e-10


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from epmoe.bench.versus import QUICK_PLAN, model_of

    path = tmp_path_factory.mktemp("migration")
    model_of("qwen3_moe", QUICK_PLAN).save_pretrained(path)
    return str(path)


@pytest.mark.multirank
def test_distributed_config_on_two_ranks(saved):
    from migration_workers import two_ranks

    for rank, result in enumerate(start_ranks(two_ranks, 2, saved, timeout=300)):
        for exact in (result["exact"], result["exact with ep_implementation='epmoe'"]):
            assert exact["loss"] <= EXACT and exact["grads"] <= EXACT and exact["compared"] > 20, (rank, exact)
        refusals = result["refusals"]
        message = refusals["apply_expert_parallel"]
        assert message.startswith("ValueError") and "distributed_config" in message, message
        assert "epmoe.from_pretrained(" in message and refusals["still transformers'"], refusals
        for field in ("tp_size", "ep_implementation", "fsdp_size"):
            assert refusals[field].startswith("ValueError") and field in refusals[field], refusals[field]
        assert refusals["not a DistributedConfig"].startswith("TypeError"), refusals


@pytest.mark.multirank
def test_distributed_config_ep_smaller_than_the_world(saved):
    from migration_workers import exact

    for rank, result in enumerate(start_ranks(exact, 4, saved, 2, timeout=300)):
        assert result["loss"] <= EXACT and result["grads"] <= EXACT, (rank, result)
