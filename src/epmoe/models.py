"""Small transformers MoE models built from configs (no download), for the demo, benchmarks and tests.

Each family keeps its own router and experts code from transformers; only the sizes are small.
Requires the ``models`` extra (transformers v5).
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe")

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# family: (config class, model class, the config's expert-count field, the small sizes)
_SMALL = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "num_experts",
        dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        "num_experts",
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "num_experts",
        dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=False),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_local_experts", dict(head_dim=16, intermediate_size=48)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "n_routed_experts",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        "num_local_experts",
        dict(head_dim=16, intermediate_size=32, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        "num_experts",
        dict(intermediate_size=32, pad_token_id=1, eos_token_id=2),
    ),
}


def _family_config(family: str, num_experts: int, top_k: int) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, config kwargs) of a small model of ``family``."""
    if family not in _SMALL:
        raise ValueError(f"family: {family!r} is not one of {list(FAMILIES)}")
    config_class, model_class, experts_key, sizes = _SMALL[family]
    return config_class, model_class, {**sizes, experts_key: num_experts, "num_experts_per_tok": top_k}


def build_model(
    family: str = "qwen3_moe",
    *,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised small causal LM of ``family`` (same weights for the same ``seed``)."""
    import transformers

    config_name, model_name, kwargs = _family_config(family, num_experts, top_k)
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs, **overrides})
    config._experts_implementation = "eager"  # the reference: transformers' own per-expert loop
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, model_name)(config)
    finally:
        torch.random.set_rng_state(generator_state)
    if family == "deepseek_v3":  # a non-trivial correction bias, so its routing path is exercised
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, num_experts))
    return model.to(dtype)
