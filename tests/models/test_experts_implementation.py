"""``experts_implementation="epmoe"``: epmoe registered in transformers' ExpertsInterface runs every
decorated experts class through its routed MLP on one device, with grouped_mm's results.

The EP 2 check of a model set to "epmoe" before ``apply_expert_parallel`` runs in the shared 2-rank
spawn of tests/ep/test_ep_parity.py (``experts_implementation/...`` cases)."""

import copy
import inspect
import json
import re
import types
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.integrations.moe import (  # noqa: E402
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    grouped_mm_experts_forward,
    use_experts_implementation,
)

import epmoe  # noqa: E402
from epmoe.ep import recognize  # noqa: E402
from epmoe.integrations import transformers_experts  # noqa: E402
from epmoe.integrations.transformers_experts import epmoe_experts_forward, local_experts  # noqa: E402
from epmoe.models import FAMILIES, build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FAMILIES = {"qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3", "olmoe", "qwen3_5_moe"}


def experts_modules(model):
    return [m for m in model.modules() if recognize.is_packed_experts(m)]


def ran_epmoe(module):
    """Whether ``module`` went through epmoe's experts implementation (it keeps its LocalExperts)."""
    return transformers_experts._ATTRIBUTE in vars(module)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_run(model, reference, ids, tol):
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        ref = ref_grads[name]
        assert (grad is None) == (ref is None), name
        if grad is not None:
            scale = ref.abs().max().clamp_min(1e-12)
            assert ((grad - ref).abs().max() / scale).item() <= tol, name


def test_import_registers_epmoe_beside_the_others():
    """``import epmoe`` put "epmoe" in the registry every instance reads; transformers' own are untouched."""
    assert ALL_EXPERTS_FUNCTIONS["epmoe"] is epmoe_experts_forward
    assert ExpertsInterface()["epmoe"] is epmoe_experts_forward
    assert ALL_EXPERTS_FUNCTIONS["grouped_mm"] is grouped_mm_experts_forward
    assert {"grouped_mm", "batched_mm", "sonicmoe", "epmoe"} <= set(ALL_EXPERTS_FUNCTIONS)
    assert transformers_experts.register()  # again: the same entry
    assert ALL_EXPERTS_FUNCTIONS["epmoe"] is epmoe_experts_forward


def test_families_cover_the_issue():
    assert EXPECTED_FAMILIES <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_equals_grouped_mm(family):
    """Every decorated family of epmoe.models, from_config with experts_implementation="epmoe":
    loss and every gradient equal the grouped_mm model's (fp32, 1e-5), every experts module ran epmoe."""
    reference = build_model(family)
    reference.set_experts_implementation("grouped_mm")
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(reference.config), experts_implementation="epmoe"
    )
    model.load_state_dict(reference.state_dict())
    assert model.config._experts_implementation == "epmoe"
    assert reference.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 256, (2, 11))
    assert_same_run(model, reference, ids, 1e-5)
    experts = experts_modules(model)
    assert experts or family not in EXPECTED_FAMILIES
    assert all(ran_epmoe(m) for m in experts)
    assert not any(ran_epmoe(m) for m in experts_modules(reference))
    for m in experts:  # the epmoe::routed_mlp op; plain autograd only around a post-expert norm
        assert local_experts(m).lean != m.has_post_expert_norm


@pytest.mark.parametrize("family", FAMILIES)
def test_fp64_equals_eager(family):
    """set_experts_implementation("epmoe") on a model built eager: fp64 loss and gradients to 1e-10."""
    reference = build_model(family, dtype=torch.float64)
    model = copy.deepcopy(reference)
    model.set_experts_implementation("epmoe")
    ids = torch.randint(0, 256, (2, 13))
    assert_same_run(model, reference, ids, 1e-10)
    assert all(ran_epmoe(m) for m in experts_modules(model))


def test_from_pretrained_and_generate(tmp_path):
    """``from_pretrained(path, experts_implementation="epmoe")`` loads and runs (training and generation,
    a KV cache and one-token steps) as the grouped_mm model does; the saved config does not name epmoe."""
    build_model("gpt_oss").save_pretrained(tmp_path)
    assert "epmoe" not in (tmp_path / "config.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="epmoe")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert model.config._experts_implementation == "epmoe"
    ids = torch.randint(0, 256, (2, 9))
    assert_same_run(model, reference, ids, 1e-5)
    model.eval(), reference.eval()
    with torch.no_grad():
        out = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        ref = reference.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)


def test_models_that_do_not_ask_are_untouched():
    """A model left on its own implementation never enters epmoe's; switching back leaves epmoe."""
    model = build_model("qwen3_moe")
    ids = torch.randint(0, 256, (1, 7))
    for name in ("eager", "grouped_mm", "batched_mm"):
        model.set_experts_implementation(name)
        model(ids)
        assert not any(ran_epmoe(m) for m in experts_modules(model))
    model.set_experts_implementation("epmoe")
    with_epmoe = model(ids).logits
    model.set_experts_implementation("eager")
    torch.testing.assert_close(model(ids).logits, with_epmoe)


def test_apply_expert_parallel_takes_over(monkeypatch):
    """apply_expert_parallel (EP 1, no process group) on an "epmoe" model replaces the experts' forwards
    as on any other; results unchanged, the registry's function no longer called."""
    reference = build_model("qwen3_moe")
    model = copy.deepcopy(reference)
    model.set_experts_implementation("epmoe")
    ids = torch.randint(0, 256, (2, 9))
    model(ids)
    epmoe.apply_expert_parallel(model)
    calls = []
    monkeypatch.setitem(ExpertsInterface._global_mapping, "epmoe", lambda *a: calls.append(a))
    assert_same_run(model, reference, ids, 1e-5)
    assert calls == []


class Config(types.SimpleNamespace):
    """What a decorated experts class reads of its config here."""


def _init_params(module, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)


@use_experts_implementation(has_gate=False, has_bias=True)
class UngatedBiasedExperts(nn.Module):
    """Up -> act_fn -> down with biases (as Nemotron-H, plus biases)."""

    def __init__(self, config):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = E
        self.up_proj = nn.Parameter(torch.empty(E, I, H))
        self.up_proj_bias = nn.Parameter(torch.empty(E, I))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.act_fn = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("the eager path is not used here")


class NormedTransposedExperts(nn.Module):
    """Default SiLU gate on (E, H, 2I) weights and a norm after the down projection (as MuseSpark)."""

    def __init__(self, config):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.act_fn = nn.SiLU()
        self.post_expert_norm = nn.RMSNorm(H, eps=1e-6)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("the eager path is not used here")


@use_experts_implementation
class CustomGateExperts(nn.Module):
    """Its own ``_apply_gate`` (a scaled tanh gate on interleaved gate/up columns)."""

    def __init__(self, config):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return torch.tanh(gate) * 0.5 * (up + 1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("the eager path is not used here")


# a norm after the down projection: a decorator option transformers 5.6 lacks (and so its modules)
if "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters:
    NormedTransposedExperts = use_experts_implementation(has_post_expert_norm=True, is_transposed=True)(
        NormedTransposedExperts
    )
    SYNTHETIC = [UngatedBiasedExperts, NormedTransposedExperts, CustomGateExperts]
else:
    SYNTHETIC = [UngatedBiasedExperts, CustomGateExperts]
H = 16  # rows of 16 fp32: transformers' grouped_mm on the CPU needs strides of a multiple of 16 bytes


def _pair(cls, dtype):
    """The same experts twice, one on epmoe, one on transformers' grouped_mm (fp32; batched_mm in
    fp64, which grouped_mm does not take on the CPU)."""
    fields = dict(num_experts=6, hidden_size=H, intermediate_size=8)
    implementation = "batched_mm" if dtype == torch.float64 else "grouped_mm"
    reference = cls(Config(_experts_implementation=implementation, **fields)).to(dtype)
    _init_params(reference, 3)
    model = cls(Config(_experts_implementation="epmoe", **fields)).to(dtype)
    model.load_state_dict(reference.state_dict())
    return model, reference


def _run(module, x, index, weights, dy, weight_grad=True):
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_(weight_grad)
    y = module(x, index, weights)
    grads = torch.autograd.grad(y, [x, *[weights] * weight_grad, *module.parameters()], dy)
    return [y, *grads]


def _one_route_per_row(model, x, index, weights) -> bool:
    """Whether a decorated class's own eager forward takes one route per row only (it fails on two
    choices per token): Ergo's projections, which its experts call once per route with weight one."""
    model.config._experts_implementation = "eager"
    try:
        with torch.no_grad():
            model.double()(x, index, weights)
    except (IndexError, RuntimeError):
        return True
    return False


def _routing(T, K, E, dtype, seed=0, num_ids=None):
    generator = torch.Generator().manual_seed(seed)
    index = (
        torch.stack([torch.randperm(num_ids or E, generator=generator)[:K] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.long)
    )
    weights = torch.rand(T, K, generator=generator, dtype=dtype)
    return index, weights


@pytest.mark.parametrize("cls", SYNTHETIC, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T", [13, 1, 0])
def test_every_flag_equals_grouped_mm(cls, dtype, tol, T):
    """has_gate=False, has_bias, is_transposed, a post-expert norm and a family's own _apply_gate:
    output, input / routing-weight / every parameter gradient equal transformers' (fp64: batched_mm,
    fp32: grouped_mm); no tokens too."""
    model, reference = _pair(cls, dtype)
    index, weights = _routing(T, 3, 6, dtype)
    x = torch.randn(T, H, dtype=dtype)
    dy = torch.randn(T, H, dtype=dtype)
    for got, want in zip(_run(model, x, index, weights, dy), _run(reference, x, index, weights, dy)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert ran_epmoe(model)
    assert local_experts(model).lean == (cls is not NormedTransposedExperts)


@pytest.mark.parametrize("cls", SYNTHETIC, ids=lambda c: c.__name__)
def test_transformers_expert_parallel_sentinels(cls):
    """Under transformers' own EP (``_is_expert_parallel``, ``num_experts`` the local count) routing
    ids past ``num_experts`` are other ranks': they contribute nothing forward or backward, as in
    transformers' batched_mm (weights there zero, as transformers' EP hands them), fp64 exact."""
    model, reference = _pair(cls, torch.float64)
    for module in (model, reference):
        module._is_expert_parallel = True
    index, weights = _routing(11, 4, 6, torch.float64, seed=5, num_ids=12)  # ids 6..11: another rank's
    weights = weights.masked_fill(index >= 6, 0)
    x = torch.randn(11, H, dtype=torch.float64)
    dy = torch.randn(11, H, dtype=torch.float64)
    got, want = _run(model, x, index, weights, dy), _run(reference, x, index, weights, dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert torch.count_nonzero(got[2][index >= 6]) == 0  # no routing-weight gradient for other ranks' slots


def test_bad_routing_raises_naming_the_argument():
    model, _ = _pair(CustomGateExperts, torch.float32)
    x = torch.randn(5, H)
    index, weights = _routing(5, 2, 6, torch.float32)
    with pytest.raises(ValueError, match="top_k_index of shape"):
        model(x, index[:4], weights[:4])
    with pytest.raises(ValueError, match="top_k_weights"):
        model(x, index, weights[:, :1])
    with pytest.raises(TypeError, match="integer top_k_index"):
        model(x, index.float(), weights)
    with pytest.raises(ValueError, match="is not packed experts"):
        epmoe_experts_forward(nn.Linear(H, H), x, index, weights)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_int32_routing_ids(expert_parallel):
    model, reference = _pair(CustomGateExperts, torch.float32)
    model._is_expert_parallel = reference._is_expert_parallel = expert_parallel
    index, weights = _routing(9, 2, 6, torch.float32, num_ids=8 if expert_parallel else None)
    weights = weights.masked_fill(index >= 6, 0)
    x = torch.randn(9, H)
    torch.testing.assert_close(model(x, index.int(), weights), reference(x, index, weights))


def test_int32_routing_ids_under_expert_parallelism():
    """An EP model's experts take int32 routing ids (as grouped_mm does) with the int64 ids' result;
    floating ids raise ``TypeError``."""
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    experts = model.model.layers[0].mlp.experts
    index, weights = _routing(9, 2, model.config.num_experts, torch.float32)
    x = torch.randn(9, model.config.hidden_size)
    torch.testing.assert_close(experts(x, index.int(), weights), experts(x, index, weights), rtol=0, atol=0)
    with pytest.raises(TypeError, match="integer top_k_index"):
        experts(x, index.float(), weights)


def test_mixed_dtypes_follow_grouped_mm():
    """Experts kept in fp32 under bf16 hidden states (families that compute experts in float32): the
    input is cast to the weights' dtype and the result back, as grouped_mm does."""
    model, reference = _pair(CustomGateExperts, torch.float32)
    index, weights = _routing(9, 2, 6, torch.float32)
    x = torch.randn(9, H).to(torch.bfloat16)
    out, ref = model(x, index, weights), reference(x, index, weights)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def test_traces_whole_after_the_first_forward():
    """torch.compile: a cold "epmoe" model breaks the graph once, where each experts module is set up;
    after one forward it traces whole, as grouped_mm does."""
    from compile_workers import break_sites

    model = build_model("qwen3_moe")
    model.set_experts_implementation("epmoe")
    ids = torch.randint(0, 256, (2, 8))
    cold = break_sites(model, ids)
    assert cold and all(function == "local_experts" for _, function in cold), cold
    assert break_sites(model, ids) == []


def test_deepcopy_runs_its_own_experts():
    model = build_model("qwen3_moe")
    model.set_experts_implementation("epmoe")
    ids = torch.randint(0, 256, (1, 6))
    model(ids)
    twin = copy.deepcopy(model)
    for a, b in zip(experts_modules(model), experts_modules(twin)):
        assert local_experts(b).module is b and local_experts(a).module is a
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert not torch.equal(twin(ids).logits, model(ids).logits)


def test_activation_bytes_benchmark_runs():
    """``epmoe bench experts`` at a tiny shape: a sanity check of the figure (the Qwen3-30B-A3B-shaped
    table is benchmarks/experts_implementation_cpu.md)."""
    from epmoe.bench import experts as benchmark

    result = json.loads(json.dumps(benchmark.measure(benchmark.QUICK)))  # what --json prints
    assert "**met**" in benchmark.markdown(result, "epmoe bench experts --quick")
    assert result["ratio"]["experts"] < 0.5 and result["ratio"]["block"] < 0.5
    assert result["max_abs_diff"] <= 1e-5 * result["max_abs"]


def readme_first_example():
    """The README's first python block."""
    return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


def test_readme_first_example_runs(tmp_path):
    """The README's first model example, run as written (one device: ``ep_group`` None, no process
    group): the "epmoe" model loaded by from_pretrained, then made expert-parallel; its loss equals
    the grouped_mm model's."""
    code = readme_first_example()
    assert 'experts_implementation="epmoe"' in code and "apply_expert_parallel" in code
    build_model("qwen3_moe").save_pretrained(tmp_path)
    input_ids = torch.randint(0, 256, (2, 10))
    scope = {"path": str(tmp_path), "input_ids": input_ids, "ep_group": None}
    exec(compile(code, "README.md", "exec"), scope)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    torch.testing.assert_close(scope["loss"], reference(input_ids, labels=input_ids).loss)
    assert scope["model"].config._experts_implementation == "epmoe"
    assert len(scope["shards"]) == len(experts_modules(scope["model"]))


def decorated_experts_classes():
    """``(modeling module, class)`` of every experts class the installed transformers decorates with
    ``@use_experts_implementation`` (found by the decorator's forward, in every modeling file that
    uses it)."""
    import importlib
    import inspect

    found = []
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        if "@use_experts_implementation" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for cls in vars(module).values():
            code = getattr(getattr(cls, "forward", None), "__code__", None)
            if (
                inspect.isclass(cls)
                and cls.__module__ == module.__name__
                and code is not None
                and "experts_interface" in code.co_freevars
            ):
                found.append((module, cls))
    return found


def tiny_experts(module, cls, implementation):
    """``cls`` built from the first of its modeling module's configs (and their sub-configs) it accepts
    (as layer 0 where it takes a ``layer_idx``), every int size above 16 made 16 (4 for expert counts),
    sizes left unset made so; ``None`` if none fits."""
    import inspect

    candidates = []
    for obj in vars(module).values():
        config_class = getattr(obj, "config_class", None)
        if inspect.isclass(obj) and inspect.isclass(config_class) and config_class not in candidates:
            candidates.append(config_class)
    candidates += [
        sub
        for c in list(candidates)
        for sub in getattr(c, "sub_configs", {}).values()
        if inspect.isclass(sub) and sub not in candidates
    ]
    for config_class in candidates:
        try:
            config = config_class()
            for key, value in list(vars(config).items()):
                sized = "expert" in key or "intermediate" in key
                if key.startswith("_") or isinstance(value, bool):
                    continue
                if (
                    isinstance(value, int)
                    and value > 16
                    or value is None
                    and sized
                    or isinstance(value, list)
                    and sized
                    and all(isinstance(v, int) for v in value)
                ):
                    setattr(config, key, 4 if "expert" in key else 16)
            config._experts_implementation = implementation
            takes_layer = "layer_idx" in inspect.signature(cls.__init__).parameters  # per-layer settings (Step3p7)
            return cls(config, layer_idx=0) if takes_layer else cls(config)
        except Exception:  # noqa: BLE001 - this config does not build this class; try the next
            continue
    return None


def error(got, want):
    """The largest relative error over pairs of tensors (each against its own largest value)."""
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in zip(got, want))


def test_every_decorated_experts_class_of_transformers():
    """Every @use_experts_implementation class of the installed transformers (found by structure), built
    tiny: output, input / routing-weight / parameter gradients equal grouped_mm's in fp32 (1e-5) and
    batched_mm's and the class's own eager forward's in fp64 (1e-10; where transformers' batched_mm
    and eager already differ, computing experts or a norm in float32 on purpose, within twice that).
    A class whose eager forward takes one route per row (Ergo's projections) is checked so: one
    choice per token, weight one, no routing-weight gradient."""
    found = decorated_experts_classes()
    assert len(found) >= 60, f"only {len(found)} decorated experts classes found"
    built, failures = 0, []
    for module, cls in found:
        model = tiny_experts(module, cls, "epmoe")
        if model is None:
            continue
        built += 1
        _init_params(model, 1)
        T, E = 7, model.num_experts
        index, weights = _routing(T, min(2, E), E, torch.float64, seed=2)
        width = model.down_proj.shape[2 if model.is_transposed else 1]
        x, dy = torch.randn(T, width, dtype=torch.float64), torch.randn(T, width, dtype=torch.float64)
        per_route = _one_route_per_row(model, x, index, weights)
        if per_route:  # its callers give each route a row and weight one: so does this check
            index, weights = index[:, :1], torch.ones(T, 1, dtype=torch.float64)
        runs = {}
        for name in ("epmoe", "batched_mm", "eager"):
            model.config._experts_implementation = name
            runs[name] = _run(model.double(), x, index, weights, dy, not per_route)
        model.config._experts_implementation = "grouped_mm"
        fp32_reference = _run(model.float(), x.float(), index, weights.float(), dy.float(), not per_route)
        model.config._experts_implementation = "epmoe"
        fp32 = _run(model, x.float(), index, weights.float(), dy.float(), not per_route)
        fp64_tol = max(1e-10, 2 * error(runs["batched_mm"], runs["eager"]))  # transformers' own disagreement
        checks = {
            "batched_mm fp64": (error(runs["epmoe"], runs["batched_mm"]), fp64_tol),
            "eager fp64": (error(runs["epmoe"], runs["eager"]), fp64_tol),
            "grouped_mm fp32": (error(fp32, fp32_reference), 1e-5),
        }
        failures += [
            f"{cls.__name__}: {what} {err:.2e} > {tol:.0e}" for what, (err, tol) in checks.items() if err > tol
        ]
    assert built >= len(found) - 2, f"only {built} of {len(found)} classes could be built tiny"
    assert not failures, "\n".join(failures)


def test_a_decorated_forward_doing_more_than_the_contract_is_refused_at_its_first_call():
    """experts_implementation="epmoe" replaces a class's decorated forward: a class decorated with its
    own forward adding a learned bias after the weighted sum (a tensor the layout does not know) is
    refused at its first call, naming the class and the probe's difference; the same bias added by a
    subclass's forward around the decorated call (epmoe replaces only that call) runs, equal to eager."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations import use_experts_implementation
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    eager = Qwen3MoeExperts.forward.__wrapped__

    @use_experts_implementation
    class BiasedExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return eager(self, hidden_states, top_k_index, top_k_weights) + self.output_bias

    class BiasAroundExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) + self.output_bias

    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4)
    index, weights = _routing(5, 2, 4, torch.float64, seed=3)
    x = torch.randn(5, 16, dtype=torch.float64)
    for cls in (BiasedExperts, BiasAroundExperts):
        config._experts_implementation = "epmoe"
        module = cls(config).double()
        _init_params(module, 1)
        module.output_bias = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
        if cls is BiasedExperts:
            with pytest.raises(
                ValueError,
                match=r"BiasedExperts cannot run through epmoe: it holds tensors the "
                r"decorated layout does not \(output_bias\), and its own forward "
                r"differs",
            ):
                module(x, index, weights)
            continue
        out = module(x, index, weights)
        config._experts_implementation = "eager"
        torch.testing.assert_close(out, module(x, index, weights), rtol=1e-12, atol=1e-12)
