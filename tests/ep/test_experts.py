"""Grouped experts compute (epmoe.experts) against transformers' own per-expert eager forward."""

import pytest
import torch
from custom_moe import BiasedExpert, ExpertMLP
from npu_emulation import install
from torch import nn

import epmoe
from epmoe.bench.blocks import EPMOE, Shape, build_blocks
from epmoe.ep import experts as experts_mod
from epmoe.ep import recognize
from epmoe.ep.experts import LocalExperts, experts_backend, experts_forward, experts_gmm_backends
from epmoe.gmm import unregister_gmm_backend
from epmoe.gmm.loop import LoopBackend
from epmoe.models import build_model

MIXED = [5, 0, 3, 9, 0, 1, 2, 4]


def packed_experts(family, dtype=torch.float64, **overrides):
    model = build_model(family, dtype=dtype, **overrides)
    return next(m for m in model.modules() if recognize.is_packed_experts(m))


def hidden_size(module):
    if isinstance(module, nn.ModuleList):
        return module[-1].w2.out_features
    return module.down_proj.shape[2 if module.is_transposed else 1]


def eager_per_expert(module, x_em, counts):
    """transformers' eager experts forward, one expert at a time with weight 1."""
    out, start = [], 0
    for j, n in enumerate(counts):
        rows = x_em[start : start + n]
        index = torch.full((n, 1), j, dtype=torch.long)
        out.append(type(module).forward(module, rows, index, torch.ones(n, 1, dtype=rows.dtype)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("counts", [[5, 0, 3, 9, 0, 1, 2, 4], [24, 0, 0, 0, 0, 0, 0, 0]], ids=["mixed", "one_expert"])
def test_packed_experts_match_eager(family, counts):
    """Every flag of @use_experts_implementation: Linear layout, transposed + interleaved gate/up +
    biases + clamped SwiGLU (GPT-OSS), output and gradients of input and every weight."""
    module = packed_experts(family)
    x = torch.randn(
        sum(counts),
        module.down_proj.shape[1 if not module.is_transposed else 2],
        dtype=torch.float64,
        requires_grad=True,
    )
    y = experts_forward(module, x, counts)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    y_ref = eager_per_expert(module, x, counts)
    grads_ref = torch.autograd.grad(y_ref, [x, *module.parameters()], dy, allow_unused=True)
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("counts", [MIXED, [24, 0, 0, 0, 0, 0, 0, 0]], ids=["mixed", "one_expert"])
def test_packed_experts_fp32_torch_backend_match_eager(family, counts):
    """The real HF layouts (Linear layout; GPT-OSS transposed + interleaved gate/up + biases) in fp32
    through the `torch` grouped_mm kernel, against transformers' eager fp32 forward and gradients."""
    module = packed_experts(family, dtype=torch.float32)
    with torch.no_grad():  # non-zero biases, so their gradients and the row-bias gather are exercised
        for name, param in module.named_parameters():
            if name.endswith("_bias"):
                param.normal_()
    assert experts_backend(module).name == "torch"
    x = torch.randn(sum(counts), hidden_size(module), requires_grad=True)
    y = experts_forward(module, x, counts, backend="torch")
    dy = torch.randn_like(y)
    params = [x, *module.parameters()]
    grads = torch.autograd.grad(y, params, dy)
    y_ref = eager_per_expert(module, x, counts)
    grads_ref = torch.autograd.grad(y_ref, params, dy, allow_unused=True)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, y_ref, **tol)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref, **tol)
    for g in grads[1:]:  # idle experts: exactly zero
        assert all(torch.count_nonzero(g[j]) == 0 for j, n in enumerate(counts) if n == 0)


class Placeholder(nn.Module):
    """A parameterless stand-in for an expert held elsewhere (as after sharding)."""


class ScaledExpert(nn.Module):
    """An expert whose first parameter is 1-D."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x * self.scale)))


def _module_list(expert_cls, hidden, inter, n=4):
    return nn.ModuleList(expert_cls(hidden, inter) for _ in range(n))


@pytest.mark.parametrize(
    "make,inter,expected",
    [
        (
            lambda inter: packed_experts("qwen3_moe", torch.float32, hidden_size=16, moe_intermediate_size=inter),
            6,
            "loop",
        ),
        (
            lambda inter: packed_experts("qwen3_moe", torch.float32, hidden_size=16, moe_intermediate_size=inter),
            8,
            "torch",
        ),
        (lambda inter: packed_experts("gpt_oss", torch.float32, hidden_size=16, intermediate_size=inter), 6, "loop"),
        (lambda inter: packed_experts("gpt_oss", torch.float32, hidden_size=16, intermediate_size=inter), 8, "torch"),
        (lambda inter: _module_list(ExpertMLP, 16, inter), 6, "loop"),
        (lambda inter: _module_list(ExpertMLP, 16, inter), 8, "torch"),
    ],
    ids=["packed-I6", "packed-I8", "gpt_oss-I6", "gpt_oss-I8", "module_list-I6", "module_list-I8"],
)
def test_experts_backend_judges_every_projection(make, inter, expected):
    """H=16, I=6 fp32: the gate/up projection fits the `torch` kernel, the down projection (K=I) does
    not; the backend experts_backend picks must run experts_forward (up and down, forward and backward)."""
    module = make(inter)
    statuses = {s.name: s for s in experts_gmm_backends(module)}
    backend = experts_backend(module).name
    assert backend == expected
    if expected == "loop":
        assert statuses["torch"].reason.startswith("down_proj: x stride 6")
        with pytest.raises(ValueError, match=r"backend='torch'.*down_proj: x stride 6"):
            experts_backend(module, "torch")
    counts = MIXED[: recognize.num_experts_of(module)]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    y = experts_forward(module, x, counts, backend=backend)
    y.square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())


@pytest.mark.parametrize(
    "experts",
    [
        lambda: _module_list(BiasedExpert, 16, 8),
        lambda: _module_list(ScaledExpert, 16, 8),
        lambda: nn.ModuleList([Placeholder(), *_module_list(ExpertMLP, 16, 8, n=3)]),
    ],
    ids=["biased", "first_param_1d", "placeholder_first"],
)
def test_module_list_run_expert_by_expert_reports_loop(experts):
    """Experts run one by one issue no grouped matmul: `loop` is what runs, whatever their parameters."""
    experts = experts()
    statuses = experts_gmm_backends(experts)
    assert [s.name for s in statuses if s.eligible] == ["loop"]
    assert all("each runs its own forward" in s.reason for s in statuses if not s.eligible)
    assert experts_backend(experts).name == "loop"
    with pytest.raises(ValueError, match="backend='torch'.*each runs its own forward"):
        experts_backend(experts, "torch")


@pytest.mark.parametrize("expert_cls", [BiasedExpert, ExpertMLP], ids=["expert_by_expert", "stacked"])
@pytest.mark.parametrize("counts", [[3, 0, 4, 0], [0, 0, 0, 0]], ids=["mixed", "no_rows"])
def test_module_list_idle_experts_get_zero_grads(expert_cls, counts):
    """Every ModuleList path gives an idle expert exact-zero gradients (not None), like the packed path."""
    experts = _module_list(expert_cls, 16, 8).double()
    x = torch.randn(sum(counts), 16, dtype=torch.float64, requires_grad=True)
    y = experts_forward(experts, x, counts)
    dy = torch.randn_like(y)
    y.backward(dy)
    start = 0
    for expert, n in zip(experts, counts):
        rows = x.detach()[start : start + n].requires_grad_()
        expert_grads = [p.grad for p in expert.parameters()]
        assert all(g is not None for g in expert_grads)
        if n == 0:
            assert all(torch.count_nonzero(g) == 0 for g in expert_grads)
        else:
            ref = torch.autograd.grad(expert(rows), list(expert.parameters()), dy[start : start + n])
            for g, g_ref in zip(expert_grads, ref):
                torch.testing.assert_close(g, g_ref)
        start += n
    assert x.grad is not None and x.grad.shape == x.shape


class LookalikeExpert(ExpertMLP):
    """Has the Linear triple and act_fn of ExpertMLP, but its forward does more than the triple."""

    def __init__(self, hidden, inter, dropout=0.0):
        super().__init__(hidden, inter)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(2.0 * super().forward(x))


@pytest.mark.parametrize("variant", ["scaled_forward", "dropout_in_training", "mixed_activations"])
def test_module_list_stacks_only_experts_whose_forward_is_the_triple(variant):
    """Experts that merely look like a Linear triple run their own forward, expert by expert."""
    if variant == "mixed_activations":
        experts = _module_list(ExpertMLP, 16, 8).double()
        experts[2].act_fn = nn.GELU()
    else:
        experts = nn.ModuleList(
            LookalikeExpert(16, 8, 0.5 if variant == "dropout_in_training" else 0.0) for _ in range(4)
        ).double()
        if variant == "scaled_forward":
            experts[1] = ExpertMLP(16, 8).double()  # one genuine triple does not make the list stackable
    state = torch.random.get_rng_state()
    assert experts_backend(experts).name == "loop"
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe restored the RNG
    counts = [3, 0, 4, 2]
    x = torch.randn(sum(counts), 16, dtype=torch.float64)
    torch.manual_seed(7)
    y = experts_forward(experts, x, counts)
    torch.manual_seed(7)
    start, ref = 0, []
    for expert, n in zip(experts, counts):
        ref.append(expert(x[start : start + n]))
        start += n
    torch.testing.assert_close(y, torch.cat(ref))


def test_module_list_of_true_triples_is_stacked():
    experts = _module_list(ExpertMLP, 16, 8)
    assert experts_backend(experts).name == "torch"  # fp32, 16-byte rows: the grouped path


def test_experts_forward_validates_counts():
    with pytest.raises(ValueError, match="3 counts for 8 experts"):
        experts_forward(packed_experts("qwen3_moe"), torch.zeros(3, 64, dtype=torch.float64), [1, 1, 1])


def test_npu_uses_swiglu_only_for_the_default_silu_gate(monkeypatch):
    """On an NPU, the default SiLU gate runs as torch_npu.npu_swiglu; a custom gate (GPT-OSS) runs as written."""
    fake = install(monkeypatch)
    monkeypatch.setattr(experts_mod.platform, "device_type", lambda obj=None: "npu")
    qwen, gpt = packed_experts("qwen3_moe"), packed_experts("gpt_oss")
    qwen, gpt = qwen.float(), gpt.float()
    h = torch.randn(4, 2 * 32)
    torch.testing.assert_close(LocalExperts(qwen).gate_activation(h), qwen._apply_gate(h))
    assert len(fake.swiglu_calls) == 1
    torch.testing.assert_close(LocalExperts(gpt).gate_activation(h), gpt._apply_gate(h))
    assert len(fake.swiglu_calls) == 1


def test_backend_eligibility_is_judged_once_not_per_grouped_matmul():
    """Each backend judges an experts module's grouped matmuls once (its probes, at the first forward
    on a device and dtype); later forwards and backwards choose from that, without asking again."""
    import epmoe
    from epmoe.gmm import unregister_gmm_backend
    from epmoe.gmm.loop import LoopBackend

    class Counting(LoopBackend):
        name, accelerated, asked = "counting", False, 0

        def ineligible_reason(self, x, weight, *, trans_weight=False):
            Counting.asked += 1
            return "declines, and counts the questions"

    epmoe.register_gmm_backend(Counting())
    try:
        module = packed_experts("qwen3_moe")
        experts = LocalExperts(module)
        x = torch.randn(6, hidden_size(module), dtype=torch.float64, requires_grad=True)
        experts.forward(x, [2, 0, 4] + [0] * (recognize.num_experts_of(module) - 3)).sum().backward()
        first = Counting.asked
        for _ in range(3):
            experts.forward(x, [1, 5] + [0] * (recognize.num_experts_of(module) - 2)).sum().backward()
        assert first == 1 and Counting.asked == first  # declined at the first probe, once
    finally:
        unregister_gmm_backend("counting")


class JudgedBackend(LoopBackend):
    """Eligible everywhere and first in the registry (``auto`` takes it), runs as ``loop``, and
    counts how often its eligibility is asked and how many grouped matmuls it ran."""

    name, accelerated = "judged", True

    def __init__(self):
        self.asked = self.ran = 0

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        self.asked += 1
        return None

    def forward(self, x_TD, weight, counts, trans_weight):
        self.ran += 1
        return super().forward(x_TD, weight, counts, trans_weight)

    def __enter__(self):
        epmoe.register_gmm_backend(self, before="npu")
        return self

    def __exit__(self, *exc):
        unregister_gmm_backend(self.name)


def test_the_backend_is_judged_once_across_a_layers_forward_and_backward():
    """An EP-1 block, forward + backward (the routed MLP op: two grouped matmuls in forward, three
    in backward): the backend is judged once, on the module's two projections together, and then
    runs every grouped matmul without being asked again, for every later step."""
    with JudgedBackend() as judged:
        block = build_blocks(
            Shape("small", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=16), 0, torch.device("cpu")
        )[EPMOE]
        applied = judged.asked  # apply_expert_parallel checks the configured backend once
        block(torch.randn(1, 16, 64, requires_grad=True)).sum().backward()
        assert judged.asked - applied == 2  # one judgement: the up and the down projection, once each
        assert judged.ran == 4  # every grouped matmul: 2 in forward, dx of both projections in backward
        for _ in range(3):
            block(torch.randn(1, 16, 64, requires_grad=True)).sum().backward()
        assert judged.asked - applied == 2


@pytest.mark.parametrize("kind", ["packed", "module_list"])
def test_the_plain_autograd_path_judges_once_and_again_where_the_operands_differ(kind):
    """LocalExperts.forward (plain autograd through grouped_mm): judged once per dtype across
    forward and backward; judged again, once, for another dtype and for weights substituted with
    other strides (what counts as differing operands: epmoe.gmm.registry.Operands)."""
    with JudgedBackend() as judged:
        module = packed_experts("qwen3_moe") if kind == "packed" else _module_list(ExpertMLP, 16, 8).double()
        experts = LocalExperts(module)
        E = recognize.num_experts_of(module)
        counts = [2, 0, 4] + [0] * (E - 3)

        def step(dtype, sync_weights=None):
            x = torch.randn(6, hidden_size(module), dtype=dtype, requires_grad=True)
            experts.forward(x, counts, sync_weights=sync_weights).sum().backward()

        step(torch.float64)
        step(torch.float64)
        assert judged.asked == 2 and judged.ran > 0
        module.float()
        step(torch.float32)
        step(torch.float32)
        assert judged.asked == 4  # another dtype: judged again, once
        if kind == "packed":  # the same values with column-major strides: judged again, once

            def restrided(weights, per_parameter=False):
                return [w.transpose(1, 2).contiguous().transpose(1, 2) for w in weights]

            step(torch.float32, restrided)
            step(torch.float32, restrided)
            assert judged.asked == 6
            step(torch.float32)
            assert judged.asked == 6


def test_the_fused_ops_judge_once_per_call_not_per_round():
    """alltoallv_gmm / gmm_alltoallv (group of one, three rounds): one judgement per op call covers
    every round's grouped matmul of its forward and of its backward; a backend object passed in is
    run as given, judged by no one."""
    with JudgedBackend() as judged:
        x, w1, w2 = (
            torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((9, 4), (3, 4, 5), (3, 5, 4))
        )
        counts = [2, 3, 4]
        y, _, _ = epmoe.alltoallv_gmm(x, w1, counts, counts, num_chunks=3)
        z, _ = epmoe.gmm_alltoallv(torch.tanh(y), w2, counts, counts, num_chunks=3)
        z.sum().backward()
        assert judged.asked == 2  # one per op
        assert judged.ran == 3 * 2 + 3 * 2  # per round: forward, and dx in backward, of each op
        z, _ = epmoe.gmm_alltoallv(x, w1, counts, counts, num_chunks=3, gmm_backend=judged)
        z.sum().backward()
        assert judged.asked == 2
