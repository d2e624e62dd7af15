"""Models whose experts modules hold more than per-expert weights, or compute in another dtype.

* Tiny transformers models, from their configs (no download), of the families whose experts module
  holds a parameter shared by every expert (MuseSpark's ``post_expert_norm``) or whose own experts
  forward computes in float32 whatever the model's dtype (Inkling2, Inkling2Loop, OpenAI's privacy
  filter; Nemotron-H's did up to transformers 5.24).
* Custom models: packed experts (``@use_experts_implementation(has_post_expert_norm=True)``)
  whose post-expert "norm" is a learned scale and bias shared by all experts, packed experts whose
  activation has a learned scale, and ``nn.ModuleList`` experts that all hold one shared norm module.
"""

import types

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.integrations import use_experts_implementation

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
_INKLING = dict(
    _COMMON,
    unpadded_vocab_size=VOCAB,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_layers_per_attn_res_block=1,
    sliding_window_size=8,
    rel_extent=8,
    d_rel=4,
)
FAMILIES = {  # family -> (config class, model class, config kwargs)
    "muse_spark": (
        "MuseSparkTextConfig",
        "MuseSparkTextModel",
        dict(
            _COMMON,
            intermediate_size=64,
            moe_intermediate_size=32,
            moe_hidden_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
    ),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM", _INKLING),
    "inkling2_loop": (
        "Inkling2LoopTextConfig",
        "Inkling2LoopForCausalLM",
        dict(
            _INKLING,
            num_hidden_layers=3,
            loop_layer_index_start=1,
            loop_layer_index_end=2,
            loop_num_passes=2,
            loop_gate_rank=8,
        ),
    ),
    "openai_privacy_filter": (
        "OpenAIPrivacyFilterConfig",
        "OpenAIPrivacyFilterForTokenClassification",
        dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
}
FLOAT32_FAMILIES = ("inkling2", "inkling2_loop", "openai_privacy_filter")


def build_family(family, dtype=torch.float64, seed=0):
    """A tiny model of ``family`` from its config, transformers' own experts loop as the reference
    (``experts_implementation="eager"``), in ``dtype`` (:func:`to_dtype`)."""
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**kwargs)
    config._experts_implementation = "eager"
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, model_name)(config)
    finally:
        torch.random.set_rng_state(state)
    return to_dtype(model, dtype)


def to_dtype(model, dtype):
    """``model`` in ``dtype``, the tensors its class keeps in float32 (``_keep_in_fp32_modules_strict``,
    as ``from_pretrained`` does: routers whose code casts their input to float32) left in float32."""
    model = model.to(dtype)
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and any(k in name for k in keep):
                tensor.data = tensor.data.float()
    return model


def batch_of(rank, length=10, batch=2):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randint(2, VOCAB, (batch, length + 3 * rank), generator=g)


def outputs_of(model, ids):
    """The model's outputs (the logits, or a text model's last hidden state), in float64 where they
    are, else float32."""
    out = model(ids, use_cache=False) if isinstance(model, transformers.PreTrainedModel) else model(ids)
    y = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    y = y if y is not None else out.last_hidden_state
    return y if y.dtype == torch.float64 else y.float()


def loss_of(model, ids):
    """A scalar of every output (:func:`outputs_of`)."""
    return outputs_of(model, ids).square().mean()


class RowScale(nn.Module):
    """``x * weight + bias`` per row: a learned scale and bias every expert's rows share."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(hidden))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        return x * self.weight + self.bias


@use_experts_implementation(has_post_expert_norm=True)
class ScaledExperts(nn.Module):
    """Packed experts whose every output row goes through one shared :class:`RowScale`."""

    def __init__(self, config):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden, config.inter
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(0.3 * torch.randn(E, 2 * inter, H))
        self.down_proj = nn.Parameter(0.3 * torch.randn(E, H, inter))
        self.act_fn = nn.SiLU()
        self.post_expert_norm = RowScale(H)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, k = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = self.post_expert_norm(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            out.index_add_(0, token, y * top_k_weights[token, k, None])
        return out


class LearnedSiLU(nn.Module):
    """``silu(x * scale)``: an activation with a learned scale every expert shares."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(width))

    def forward(self, x):
        return F.silu(x * self.scale)


@use_experts_implementation
class LearnedGateExperts(nn.Module):
    """Packed experts, no post-expert norm, whose gate's activation has a learned scale all share."""

    def __init__(self, config):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden, config.inter
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(0.3 * torch.randn(E, 2 * inter, H))
        self.down_proj = nn.Parameter(0.3 * torch.randn(E, H, inter))
        self.act_fn = LearnedSiLU(inter)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.gate_up_proj.shape[0]):
            token, k = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, k, None])
        return out


class NormedExpert(nn.Module):
    """One expert of an ``nn.ModuleList``, its output through ``norm``, a module all experts share."""

    def __init__(self, hidden, inter, norm):
        super().__init__()
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.down(torch.tanh(self.up(x))))


class SharedBlock(nn.Module):
    """Softmax top-k router and experts: packed :class:`ScaledExperts` (``"packed"``) or
    :class:`LearnedGateExperts` (``"packed_gate"``), or a ``ModuleList`` of :class:`NormedExpert`
    sharing one norm (``"module_list"``, transformers 4.x style: the block loops over experts)."""

    def __init__(self, kind, hidden=16, inter=24, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        if kind in ("packed", "packed_gate"):
            config = types.SimpleNamespace(
                _experts_implementation="eager", num_experts=num_experts, hidden=hidden, inter=inter
            )
            self.experts = (ScaledExperts if kind == "packed" else LearnedGateExperts)(config)
        else:
            norm = nn.LayerNorm(hidden)
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.2, 0.2)
            self.experts = nn.ModuleList(NormedExpert(hidden, inter, norm) for _ in range(num_experts))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = torch.topk(F.softmax(self.gate(x), dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)  # transformers 4.x routing
        if isinstance(self.experts, nn.ModuleList):
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                token, k = torch.where(selected == e)
                out.index_add_(0, token, expert(x[token]) * weights[token, k, None])
        else:
            out = self.experts(x, selected, weights)
        return out.view_as(hidden_states)


class SharedLM(nn.Module):
    """Embedding, two :class:`SharedBlock` (residual), a head."""

    def __init__(self, kind, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList([SharedBlock(kind, hidden), SharedBlock(kind, hidden)])
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def build_custom(kind, dtype=torch.float64, seed=0):
    """:class:`SharedLM` with ``kind`` experts (see :class:`SharedBlock`)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return SharedLM(kind).to(dtype)
    finally:
        torch.random.set_rng_state(state)
