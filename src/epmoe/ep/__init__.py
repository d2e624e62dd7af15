"""Expert parallelism on a model: find experts, shard them, route tokens to them and back."""

from epmoe.ep.apply import apply_expert_parallel, find_experts_modules, resolve_groups
from epmoe.ep.config import ExpertParallelConfig, ExpertShard

__all__ = ["ExpertParallelConfig", "ExpertShard", "apply_expert_parallel", "find_experts_modules", "resolve_groups"]
