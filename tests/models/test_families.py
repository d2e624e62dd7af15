"""Coverage of every MoE family of the installed transformers: exact at EP 2 (fp64, 2 gloo ranks), or
refused by name (the experts class, its module path and the reason), before anything is changed.

The families are found by structure (tests/support/families.py), not listed: a family a new transformers adds
is checked here without an edit, and fails until it is exact or refused by name. All families run in
one spawned group (families_workers.check_families); the families table of docs/models.md is this run's
output (tests/models/families_table.py --write) and is checked against it.
"""

from __future__ import annotations

import re

import experts_variants
import families
import families_table
import pytest
from families_workers import TOL, TOL_ROUNDS_TO, check_families, stacked_and_zero_cases, verdict
from ranks import start_ranks


def found() -> dict[str, families.Family | str]:
    return {f if isinstance(f, str) else f.name: f for f in families.families()}


def variant(name: str) -> families.Family:
    return next(f for f in families.variants() if f.variant == name)


def checked() -> list[families.Family]:
    """Every family, then the experts classes made for the purpose (experts_variants.py)."""
    return [f for f in families.families() if not isinstance(f, str)] + families.variants()


def results(world: int = 2) -> dict[str, list[dict]]:
    """Every checked family's per-rank result from one spawned run of ``world`` ranks per session, by
    ``Family.key``."""
    out = start_ranks(check_families, world, checked(), timeout=900, once=True)
    return {f.key: [r[f.key] for r in out] for f in checked()}


def test_every_family_builds_a_tiny_model_with_its_experts():
    """Every directory defining experts-like classes yields a tiny model holding them (else the
    generic sizes need a CONFIG_FIXES entry); the known families are among them."""
    by_name = found()
    unbuilt = [name for name, f in by_name.items() if isinstance(f, str)]
    assert not unbuilt, f"no tiny model with experts could be built for {unbuilt}"
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4", "dbrx", "jetmoe", "switch_transformers"} <= set(
        by_name
    )
    assert "bamba" not in by_name  # mentions experts, defines none


def test_docs_list_every_family():
    """The families table of docs/models.md for the installed release names exactly the families found
    now, and which of them transformers' own expert parallelism has a plan for."""
    page = families_table.PAGE.read_text()
    assert families_table.release() in families_table.releases(page), (
        f"docs/models.md has no families table of transformers {families_table.release()} "
        "(tests/models/families_table.py --write)"
    )
    listed = families_table.table_rows(page)
    assert set(listed) == set(found())
    from epmoe.bench.versus import ep_plans

    plans = ep_plans()
    assert {name for name, (_, plan) in listed.items() if plan == "yes"} == plans & set(listed), (
        "docs/models.md's column of transformers' EP plans is stale (tests/models/families_table.py --write)"
    )


@pytest.mark.parametrize("directory", ["jetmoe", "doge", "switch_transformers", "vitpose_backbone"])
def test_refused_by_name_before_anything_changes(directory):
    """Experts epmoe cannot take: ValueError naming the experts class, its module path and why;
    the model is unchanged (one process: the refusal needs no collective)."""
    import epmoe

    family = found()[directory]
    model = families.build(family)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as error:
        epmoe.apply_expert_parallel(model)
    _assert_names_class_path_reason(family, str(error.value), model)
    assert not any(hasattr(m, "_epmoe") for m in model.modules())
    assert all(p.equal(before[n]) for n, p in model.named_parameters())


def _assert_names_class_path_reason(family, message, model=None):
    model = model if model is not None else families.build(family)
    classes = families.experts_classes(family.name)
    named = [(n, m) for n, m in model.named_modules() if f" at {n} (" in message]
    assert named, f"{family.name}: no module path in {message!r}"
    assert any(f"{type(m).__name__} at {n} (" in message and type(m).__name__ in classes for n, m in named), (
        f"{family.name}: the experts class is not named in {message!r}"
    )
    assert message.split("): ", 1)[1].strip(), f"{family.name}: no reason in {message!r}"


@pytest.mark.multirank
@pytest.mark.releases
@pytest.mark.timeout(900)
@pytest.mark.parametrize("directory", families.candidate_directories())
def test_family_exact_or_refused_by_name(directory):
    """At EP 2 in fp64: outputs, loss and non-expert gradients equal the unsharded model's on the
    rank's batch, expert gradients its sum over both ranks' batches (1e-10, or 1e-4 for a family whose
    own experts forward rounds float64 to float32); or a ValueError naming
    the experts class, module path and reason. The verdict in docs/models.md's families table is this one."""
    family = found().get(directory)
    if family is None:  # the directory mentions experts but defines no experts-like class
        return
    assert not isinstance(family, str), f"{directory}: no tiny model could be built"
    per_rank = results()[directory]
    line = verdict(family, per_rank)
    listed = families_table.table_verdicts(families_table.PAGE.read_text())
    assert listed.get(directory) == line.replace("|", "/"), (
        f"{directory}: docs/models.md says {listed.get(directory)!r}, the run {line!r} (tests/models/families_table.py --write)"
    )
    if line.startswith("refused"):
        assert per_rank[0]["refused"] == per_rank[1]["refused"]
        _assert_names_class_path_reason(family, per_rank[0]["refused"])
        return
    assert line.startswith("exact"), f"{directory}: {line}\n{per_rank[0].get('error', '')}"


@pytest.mark.multirank
@pytest.mark.releases
@pytest.mark.timeout(900)
def test_lora_on_every_familys_experts_is_exact_or_refused():
    """PEFT LoRA on every per-expert tensor (``target_parameters``) of every family epmoe runs, at EP 2
    in fp64 (the same spawn as the verdicts): outputs on the rank's batch and every LoRA factor's
    gradient (the unsharded sum over ranks, this rank's experts' part) equal the unsharded peft model's
    with the same seed (1e-10, or the family's own float32 rounding); or epmoe refuses it by name (LoRA
    on biases, on stacked rows, beside zero-computation experts); or peft's LoRA does not run on the
    unsharded model either (DBRX; Ergo's projections and per-expert norm together). Before, GPT-OSS's bias LoRA and Llama4's LoRA (peft read epmoe's
    layout flag) ran silently unlike the unsharded model, and Llama4's crashed."""
    outcomes = {}
    for family in checked():
        per_rank = results()[family.key]
        if any("refused" in r or "error" in r for r in per_rank):
            continue  # EP itself refused (or failed: test_family_exact_or_refused_by_name says so)
        for run in ("lora", "lora_projections", "lora_post"):
            if run not in per_rank[0]:
                continue
            loras = [r[run] for r in per_rank]
            assert not any("error" in lora for lora in loras), (family.name, [lora.get("error") for lora in loras])
            kinds = {next(iter({"refused", "without_ep"} & set(lora)), "ran") for lora in loras}
            assert len(kinds) == 1, (family.name, loras)
            outcomes[family.key if run == "lora" else f"{family.key} {run}"] = kind = kinds.pop()
            if kind == "refused":
                assert all(
                    "PEFT LoRA on" in lora["refused"] and "target_parameters" in lora["refused"] for lora in loras
                ), (family.name, loras)
            elif kind == "ran":
                rounds_to = per_rank[0]["rounds_to"]
                tol = TOL_ROUNDS_TO.get(rounds_to, TOL) if rounds_to else TOL
                for rank, lora in enumerate(loras):
                    assert lora["compared"] > 0 and max(lora["errors"].values()) <= tol, (family.name, rank, lora)
    # Ergo: peft itself cannot wrap both the experts' tensors and their post_expert_norm's; LoRA on its
    # projections alone is exact, on its per-expert norm alone (and the per_route_norm variant's) refused by name.
    # LongCat-Flash's own experts hold its zero-computation experts at transformers 5.6 (as the made
    # class does), its block from 5.25
    expected = {
        "gpt_oss": "refused",
        "longcat_flash+zero_experts": "refused",
        "dbrx": "without_ep",
        "llama4": "ran",
        "qwen3_moe": "ran",
        "step3p7": "ran",
        "longcat_flash": "refused" if holds_zero_experts(found()["longcat_flash"]) else "ran",
        "ergo": "without_ep",
        "ergo lora_projections": "ran",
        "ergo lora_post": "refused",
        "qwen3_moe+per_route_norm": "without_ep",
        "qwen3_moe+undecorated": "ran",
    }
    expected = {name: kind for name, kind in expected.items() if name.split("+")[0].split()[0] in found()}
    assert {name: outcomes.get(name) for name in expected} == expected, outcomes


def holds_zero_experts(family: families.Family) -> bool:
    """Whether ``family``'s own experts modules hold zero-computation experts (epmoe adopts them so)."""
    from epmoe.ep.adopt import find_experts_modules
    from epmoe.ep.recognize import zero_experts

    return any(zero_experts(m) for _, m, _ in find_experts_modules(families.build(family)))


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_shard_marks_rebuild_every_familys_unsharded_tensors():
    """What a framework that gathers by ``epmoe_shard`` gets, for every family epmoe runs, at EP 2 and EP 4
    (the families' spawns, fp64): every sharded expert tensor carries a ShardMark whose ``join`` of every
    rank's tensor is the unsharded model's (stacked rows: all ``E*I`` rows; zero-computation experts'
    never-read rows, which EP does not keep, as zeros), and ``whole_state_dict`` is the unsharded model's
    state dict on the writer; at EP 2 the same for PEFT LoRA on every per-expert tensor where it runs
    under EP (``lora_parity``: where it ran at EP 2, its factors join too; where epmoe refuses it, it is refused
    here by name). Before, DBRX's marks said ``(E, H)`` and the join raised on the writer only, and the
    zero-computation experts' said ``(E, 2I, H)``: ``whole_state_dict`` returned an incomplete tensor.
    A mark that does not give the unsharded shape (DBRX's read as one row per expert) raises at
    ``apply_expert_parallel`` on every rank, naming the module path, the parameter and both shapes."""
    joined = {}
    for world in (2, 4):
        for family in checked():
            per_rank = results(world)[family.key]
            if any("refused" in r or "error" in r for r in per_rank):
                continue  # EP itself refused (or failed: test_family_exact_or_refused_by_name says so)
            for rank, marks in enumerate(r["marks"] for r in per_rank):
                assert "error" not in marks, (world, family.key, rank, marks["error"])
                base, lora = marks["base"], marks.get("lora")
                assert base["marked"] > 0 and not base["unmarked"], (world, family.key, rank, base)
                assert not base["joined_wrong"] and not base["whole_wrong"], (world, family.key, rank, base)
                if world == 4:
                    continue  # LoRA's marks at EP 2 (joined_by_marks)
                kind = next(iter({"refused", "without_ep"} & set(lora)), "ran")
                joined.setdefault((world, family.key), set()).add(kind)
                if kind == "ran":
                    assert lora["marked"] > 0 and not lora["unmarked"], (world, family.key, rank, lora)
                    assert not lora["joined_wrong"] and not lora["whole_wrong"], (world, family.key, rank, lora)
                elif kind == "refused":
                    assert "PEFT LoRA on" in lora["refused"], (world, family.key, rank, lora)
            if world == 2 and "lora" in per_rank[0]:
                ran = next(iter({"refused", "without_ep"} & set(per_rank[0]["lora"])), "ran")
                if ran != "without_ep":  # peft's own limit may show at the forward only
                    assert joined[(world, family.key)] == {ran}, (family.key, ran, joined[(world, family.key)])
    assert {"dbrx", "longcat_flash+zero_experts", "qwen3_moe", "gpt_oss"} <= {key for _, key in joined}
    assert joined[(2, "qwen3_moe")] == {"ran"} and joined[(2, "longcat_flash+zero_experts")] == {"refused"}
    for wrong in (r["wrong_mark"] for r in results()["dbrx"]):
        assert re.search(
            r"^apply_expert_parallel: transformer\.blocks\.\d\.ffn\.experts\.mlp: the ShardMark of w1 says its "
            r"unsharded tensor is \(4, \d+\), but it was \(\d+, \d+\) before sharding$",
            wrong or "",
        ), wrong


@pytest.mark.multirank
@pytest.mark.releases
@pytest.mark.timeout(900)
def test_made_experts_classes_are_exact_or_refused_by_name():
    """Experts classes made for the purpose (experts_variants.py), whose forward does more than the
    decorated contract (a per-expert output scale, a clamp of the output, a bias added after the
    sum), as much as Ergo's per-route norm, or nothing more (a subclass that changes nothing): at EP 2
    and EP 4 (the families' spawns, fp64 and bf16), exact, or refused by name before anything
    changed, the class, its module path, what departs and the probe's difference in the message."""
    for world in (2, 4):
        for family in families.variants():
            line = verdict(family, results(world)[family.key])
            expected = experts_variants.EXPECTED[family.variant]
            assert line.startswith(expected), (world, family.key, line)
            if expected == "refused":
                cls = experts_variants.CLASSES[family.variant].__name__
                assert re.search(
                    rf"^refused: {cls} at model\.layers\.\d\.mlp\.experts \(\d modules?\): its forward "
                    rf"is overridden in {cls}.*differs from epmoe's routed MLP on a probe",
                    line,
                ), line


def family_of(directory: str) -> families.Family:
    """The family ``directory`` of the installed transformers; the test skipped, naming the release,
    where that release ships no such model (a family a later release added: nothing to refuse)."""
    from epmoe.integrations.releases import installed_transformers

    family = found().get(directory)
    if family is None:
        pytest.skip(f"transformers {installed_transformers()} has no {directory} model")
    return family


@pytest.mark.parametrize(
    "case, match",
    [
        (
            "step3p7",
            r"ScaledExperts at language_model\.layers\.\d\.mlp\.experts .*: its forward is overridden in "
            r"ScaledExperts.*differs",
        ),
        (
            "qwen3_moe",
            r"ScaledExperts at model\.layers\.\d\.mlp\.experts .*: its forward is overridden in "
            r"ScaledExperts.*differs",
        ),
        ("undecorated", r"ScaledExperts at model\.layers\.\d\.mlp\.experts .*: packed experts without"),
    ],
)
def test_decorated_subclass_overriding_forward_is_refused_not_trusted(case, match):
    """Step3p7's experts carry transformers' decorator (from 5.25), Qwen3-MoE's at every release; a
    subclass scaling their output (the decorator's forward overridden below it) is refused by name,
    nothing changed, where epmoe once trusted the decorator and ran the parent's contract silently.
    The same experts without the decorator are adopted where their own forward agrees (exact), and
    refused by name where it does not."""
    import copy

    import torch

    import epmoe

    family = variant(case) if case == "undecorated" else family_of(case)
    reference = families.build(family)
    model = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(model)
    ids = families.inputs(family, 0, 9)
    torch.testing.assert_close(model(**ids)[0], reference(**ids)[0], rtol=1e-12, atol=1e-12)

    model = families.build(family)
    cls = next(type(m) for name, m in model.named_modules() if name.endswith(".mlp.experts"))
    for module in [m for m in model.modules() if type(m) is cls]:
        module.__class__ = type("ScaledExperts", (cls,), {"forward": _scaled(cls)})
    with pytest.raises(ValueError, match=match):
        epmoe.apply_expert_parallel(model)
    assert not any(hasattr(m, "_epmoe") for m in model.modules())


def _scaled(cls: type):
    """A forward returning twice what ``cls``'s does."""

    def scaled(self, hidden_states, top_k_index, top_k_weights):
        return 2 * cls.forward(self, hidden_states, top_k_index, top_k_weights)

    return scaled


def adopted_families() -> list:
    """The families whose experts epmoe adopts (no decorator: :func:`epmoe.ep.adopt.adopt_packed_experts`)."""
    from epmoe.ep.adopt import find_experts_modules

    out = []
    for family in checked():
        if any(hasattr(m, "_epmoe_adopted") for _, m, _ in find_experts_modules(families.build(family))):
            out.append(family)
    return out


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_every_family_has_its_verdict_at_four_ranks():
    """Every family at EP 4 (fp64, bf16 as at EP 2, one spawn of 4 ranks) gets the verdict it gets at
    EP 2: exact (or exact to its own float32 rounding), or refused by name; the families epmoe adopts
    (Llama4, DBRX's stacked rows, undecorated and zero-computation experts made for the purpose) among
    them; the experts classes made for the purpose too."""
    assert {"llama4", "dbrx", "qwen3_moe+undecorated", "longcat_flash+zero_experts"} <= {
        f.key for f in adopted_families()
    }
    at_four = {f.key: verdict(f, results(4)[f.key]) for f in checked()}
    at_two = {f.key: verdict(f, results()[f.key]) for f in checked()}
    assert at_four == at_two, {name: (at_two[name], line) for name, line in at_four.items() if line != at_two[name]}


def test_stacked_rows_experts_run_as_packed_views_under_their_own_names():
    """DBRX's experts (``mlp.w1`` / ``v1`` / ``w2``, each ``(E*I, H)``) are adopted: their holder runs as
    packed experts, the parameters keep their names and 2-D shapes, outputs and gradients are the
    family's own (fp64, one process); the same module whose forward scales its output is refused by
    name, nothing changed, and so are its weights on the meta device (no forward to probe), saying so."""
    import copy

    import torch

    import epmoe
    from epmoe.ep.adopt import find_experts_modules
    from epmoe.ep.recognize import stacked_rows

    family = found()["dbrx"]
    reference = families.build(family)
    model = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(model)
    holders = [m for _, m, _ in find_experts_modules(model)]
    assert holders and all(stacked_rows(m).names == ("w1", "v1", "w2") for m in holders)
    shapes = [(n, p.shape) for n, p in reference.named_parameters()]
    assert [(n, p.shape) for n, p in model.named_parameters()] == shapes
    ids = families.inputs(family, 0, 9)
    torch.manual_seed(0)
    out = model(**ids)[0]
    torch.manual_seed(0)
    expected = reference(**ids)[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if ".experts." in name:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)

    model = families.build(family)
    experts = next(m for m in model.modules() if type(m).__name__ == "DbrxExperts")
    cls = type(experts)

    def scaled(self, hidden_states, top_k_index, top_k_weights):
        return 2 * cls.forward(self, hidden_states, top_k_index, top_k_weights)

    experts.__class__ = type("ScaledExperts", (cls,), {"forward": scaled})
    with pytest.raises(ValueError, match=r"ScaledExperts at transformer\.blocks\.\d\.ffn\.experts .*flattened to 2-D"):
        epmoe.apply_expert_parallel(model)
    assert not any(hasattr(m, "_epmoe") for m in model.modules())

    model = families.build(family).to("meta")  # epmoe.from_pretrained's start: nothing to probe with
    with pytest.raises(ValueError, match=r"DbrxExperts at .*flattened to 2-D.*meta device"):
        epmoe.apply_expert_parallel(model)


def test_zero_computation_experts_add_the_token_times_its_weight():
    """Zero-computation experts (LongCat-Flash's as transformers 5.24 wrote them: experts_variants.py)
    called with ids of zero-computation experts (``>= E``) among the real ones, under EP (one
    process, fp64): the module's own output and gradients (hidden states, routing weights, the real
    experts' weights). The
    same module whose zero experts return twice the token is refused by name, nothing changed, and so
    is the module on the meta device (no forward to probe), saying so."""
    import copy

    import torch

    import epmoe

    family = variant("zero_experts")
    reference = families.build(family)
    model = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(model)
    ref_experts, experts = (
        next(m for m in x.modules() if type(m).__name__ == "ZeroComputationExperts") for x in (reference, model)
    )
    num = experts.down_proj.shape[0]
    assert experts.gate_up_proj.shape[0] > num  # one rank: nothing sharded, the unread rows kept
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, experts.down_proj.shape[1], dtype=torch.float64, generator=g)
    index = torch.stack([torch.arange(12) % num, num + torch.arange(12) % (ref_experts.gate_up_proj.shape[0] - num)], 1)
    index[::3, 0] = index[::3, 1]  # some tokens choose only zero experts
    weights = torch.rand(12, 2, dtype=torch.float64, generator=g)
    grads = []
    for module in (experts, ref_experts):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(x, index, w)
        out.square().sum().backward()
        grads.append((out, x.grad, w.grad, module.gate_up_proj.grad[:num], module.down_proj.grad))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)

    model = families.build(family)
    cls = experts_variants.ZeroComputationExperts

    def doubled(self, hidden_states, top_k_index, top_k_weights):
        zero = (top_k_weights * (top_k_index >= self.num_routed_experts)).sum(-1, keepdim=True)
        return cls.forward(self, hidden_states, top_k_index, top_k_weights) + zero * hidden_states

    for module in [m for m in model.modules() if type(m) is cls]:
        module.__class__ = type("DoubledZeroExperts", (cls,), {"forward": doubled})
    with pytest.raises(ValueError, match=r"DoubledZeroExperts at model\.layers\.\d\.mlp\.experts .*zero-computation"):
        epmoe.apply_expert_parallel(model)
    assert not any(hasattr(m, "_epmoe") for m in model.modules())

    model = families.build(family).to("meta")  # epmoe.from_pretrained's start: nothing to probe with
    with pytest.raises(ValueError, match=r"ZeroComputationExperts at .*zero-computation experts.*meta device"):
        epmoe.apply_expert_parallel(model)


# bfloat16: EP's distance from float64 at most this factor times the distance of the run without EP
# (summed over the ranks; the runs differ by rounding order), as tests/models/test_experts_inside.py bounds it
BF16_FACTOR = 1.15


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_stacked_rows_and_zero_experts_in_bf16_and_saved(tmp_path):
    """DBRX, zero-computation experts (LongCat-Flash's as transformers 5.24 wrote them) and Ergo (a
    per-expert norm sharded with its experts) at EP 2 in bfloat16: as close to float64 (per-token
    losses, expert gradients) as the bfloat16 run without EP. Each EP model saved with
    ``save_pretrained`` on every rank writes the keys a plain save of the unsharded model writes, and
    the family's own ``from_pretrained`` (the made class: its state dict) loads every weight of the
    unsharded model bitwise (the ``gate_up_proj`` rows of zero-computation experts, never read, as
    zeros), nothing missing, the same logits (fp32, 1e-6). A DCP checkpoint of each (``epmoe.get_state_dict`` after an AdamW
    step) resumes bitwise into a fresh EP model and optimizer, and loads into the unsharded model's
    state dict with every expert under its global index. Zero-computation experts with one rank's
    tokens choosing zero experts only (that rank sends no row): the module's own output and input
    gradient on every rank. PEFT LoRA on DBRX's or the zero-computation experts raises at the first forward on every rank,
    naming the module (see :func:`test_lora_on_stacked_rows_experts_is_refused_not_left_out`). Two
    families whose checkpoint layout transformers converts: Qwen3-VL-MoE round-trips as above in it;
    Ernie-4.5-VL's (text and vision experts in one list) is refused by name, and round-trips with
    ``save_original_format=False``."""
    fams = [found()["dbrx"], variant("zero_experts"), *(found()[name] for name in ("ergo",) if name in found())]
    converted = [found()["qwen3_vl_moe"], found()["ernie4_5_vl_moe"]]
    out = start_ranks(stacked_and_zero_cases, 2, str(tmp_path), fams, converted, timeout=900)
    for family in fams:
        per_rank = [r["bf16"][family.key] for r in out]
        assert all(r["experts"] > 0 for r in per_rank)
        for metric in ("losses", "expert_grads"):
            ep, no_ep = (sum(r[metric][k] for r in per_rank) for k in ("ep", "no_ep"))
            assert ep <= BF16_FACTOR * no_ep, f"{family.name} bf16 {metric}: EP {ep:.4g}, without EP {no_ep:.4g}"
    for family in fams:
        for rank, dcp in enumerate(r["dcp"][family.key] for r in out):
            assert dcp["experts"] > 0, (family.name, rank, dcp)
            assert not dcp["resumed"] and not dcp["unsharded"], (family.name, rank, dcp)
    for family, what in (
        ("dbrx", "stacked-rows expert weights"),
        ("longcat_flash+zero_experts", "experts beside zero-computation"),
    ):
        for lora in (r["lora"][family] for r in out):
            assert lora is not None and f"PEFT LoRA on {what}" in lora and ".experts" in lora, (family, lora)
    for zero_only in (r["zero_only"] for r in out):  # the last rank's tokens chose zero experts only
        assert zero_only["output"] <= 1e-12 and zero_only["hidden_grad"] <= 1e-12, zero_only
    for by_family in (r["converted"] for r in out):
        # Qwen3-VL-MoE: transformers' Transpose(check_dims=True) compared the gathered experts with this
        # rank's shard and transposed them; the square gate_up_proj (2I == H) then loaded unchanged
        assert "refused" not in by_family["qwen3_vl_moe"], by_family["qwen3_vl_moe"]
        # Ernie-4.5-VL: text and vision experts go into one checkpoint list: refused, naming the way out
        assert "save_original_format=False" in by_family["ernie4_5_vl_moe"].get("refused", ""), by_family
    for saved in [
        *(r["saved"][f.key] for r in out for f in fams),
        *(r["converted"][f.name]["saved"] for r in out for f in converted),
    ]:
        written, plain = saved["keys"]
        assert written == plain and not saved["unequal"] and not saved["missing"], saved
        assert saved["logits"] <= 1e-6, saved


def test_input_weighted_blocks_on_the_meta_device_are_refused_with_what_to_do(tmp_path):
    """Llama4's block can only be checked on real weights: epmoe.from_pretrained (meta weights)
    refuses it by name and says to load first, then apply EP."""
    import torch

    import epmoe

    model = families.build(families._find_family("llama4"), dtype=torch.float64)
    model.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"Llama4TextMoe's weights are on the meta device .* then call "
        r"epmoe\.apply_expert_parallel",
    ):
        epmoe.from_pretrained(type(model), tmp_path, dtype=torch.float64)


@pytest.mark.parametrize("with_attention", [False, True])
def test_lora_on_stacked_rows_experts_is_refused_not_left_out(with_attention):
    """PEFT LoRA on DBRX's stacked-rows expert weights after epmoe (one process): its factors would span
    every expert and the module around the holder calls epmoe's forward, not peft's wrapper, so the
    LoRA would silently do nothing (with LoRA on attention too, training would run). The first forward,
    and epmoe.expert_parameters, raise naming the module and what to do instead."""
    peft = pytest.importorskip("peft")
    import epmoe

    family = found()["dbrx"]
    model = families.build(family)
    epmoe.apply_expert_parallel(model)
    config = peft.LoraConfig(
        r=2, target_modules=["Wqkv"] if with_attention else [], target_parameters=["w1", "v1", "w2"]
    )
    model = peft.get_peft_model(model, config)
    match = r"transformer\.blocks\.0\.ffn\.experts\.mlp: PEFT LoRA on stacked-rows expert weights \(w1, v1, w2.*target_parameters"
    with pytest.raises(ValueError, match=match):
        model(**families.inputs(family, 0, 5))
    with pytest.raises(ValueError, match=match):
        epmoe.expert_parameters(model)


def test_ergo_through_epmoe_from_pretrained_is_proved_on_meta_weights(tmp_path):
    """epmoe.from_pretrained applies EP to weights on the meta device: Ergo's experts (a forward that
    departs from the decorated contract) are proved on stand-in weights there, its per-expert norm
    loaded with the experts: the same logits as the family's own load (one process, fp64)."""
    import torch

    import epmoe

    family = family_of("ergo")
    model = families.build(family)
    model.save_pretrained(tmp_path)
    loaded, _ = epmoe.from_pretrained(type(model), tmp_path, dtype=torch.float64)
    plain = type(model).from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    ids = families.inputs(family, 0, 9)
    torch.testing.assert_close(loaded(**ids)[0], plain(**ids)[0], rtol=1e-12, atol=1e-12)
