"""A custom MoE model with ``nn.ModuleList`` experts (transformers 4.x style), for the EP tests."""

import torch
import torch.nn.functional as F
from torch import nn


class ExpertMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class BiasedExpert(nn.Module):
    """Not a recognised Linear triple: epmoe calls it on its own rows."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class SparseBlock(nn.Module):
    """Softmax top-k router, a loop over experts, an optional gated shared expert; returns
    ``(hidden, router_logits)`` like transformers 4.x Mixtral / Qwen2-MoE."""

    def __init__(self, hidden, inter, num_experts, top_k, expert_cls=ExpertMLP, shared=False):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = True
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(expert_cls(hidden, inter) for _ in range(num_experts))
        if shared:
            self.shared_expert = ExpertMLP(hidden, inter)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(selected == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(b, s, h), router_logits


class TinyMoELM(nn.Module):
    def __init__(self, vocab=64, hidden=16, inter=24, num_experts=4, top_k=2, expert_cls=ExpertMLP):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [
                SparseBlock(hidden, inter, num_experts, top_k, expert_cls, shared=True),
                SparseBlock(hidden, inter, num_experts, top_k, expert_cls),
            ]
        )
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)[0]
        return self.head(h)
