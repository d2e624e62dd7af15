"""epmoe.from_pretrained's conversions, in one process: MergeConcatenate gives what transformers'
MergeModulelist then Concatenate give, and only the load's copy of the converters uses it."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter  # noqa: E402

from epmoe.checkpoint.load import MergeConcatenate, one_copy_conversions, restore_conversions  # noqa: E402

SOURCES = ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]


def chain(pieces, dim):
    """transformers' own ops on a copy of ``pieces``."""
    merged = MergeModulelist(dim=0).convert(copy.copy(pieces), SOURCES, ["gate_up"])
    return Concatenate(dim=dim).convert(merged, SOURCES, ["gate_up"])["gate_up"]


@pytest.mark.parametrize("dim", [1, 2, -1, -2])
def test_merge_concatenate_equals_transformers_ops(dim):
    """Random pieces (3 experts; the gate wider than the up along the concatenated axis; one piece a
    non-contiguous view, as a memory-mapped slice may be): the same tensor, dtype and shape, bitwise;
    the pieces are popped from the input as transformers' ops pop them."""
    g = torch.Generator().manual_seed(abs(dim))
    axis = dim - 1 if dim > 0 else dim  # the pieces' axis that is concatenated
    gate_shape, up_shape = [5, 4], [5, 4]
    gate_shape[axis] = 6
    pieces = {
        SOURCES[0]: [torch.randn(gate_shape, generator=g, dtype=torch.float64) for _ in range(3)],
        SOURCES[1]: [torch.randn(up_shape[::-1], generator=g, dtype=torch.float64).t() for _ in range(3)],
    }
    want = chain(pieces, dim)
    got = MergeConcatenate(dim).convert(pieces, SOURCES, ["gate_up"])["gate_up"]
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert pieces == {}


def test_merge_concatenate_promotes_like_cat_and_refuses_what_does_not_fit():
    """Pieces of two dtypes: torch.cat's promotion. A missing piece or a shape that differs outside the
    concatenated axis: ValueError (transformers' loader records it as a conversion error)."""
    half = {SOURCES[0]: [torch.ones(2, 3, dtype=torch.float16)] * 2, SOURCES[1]: [torch.ones(2, 3)] * 2}
    assert MergeConcatenate(1).convert(dict(half), SOURCES, ["t"])["t"].dtype == chain(half, 1).dtype == torch.float32
    short = {SOURCES[0]: [torch.ones(2, 3)] * 2, SOURCES[1]: [torch.ones(2, 3)]}
    with pytest.raises(ValueError, match="do not stack then concatenate"):
        MergeConcatenate(1).convert(short, SOURCES, ["t"])
    wide = {SOURCES[0]: [torch.ones(2, 3)] * 2, SOURCES[1]: [torch.ones(2, 4)] * 2}
    with pytest.raises(ValueError, match="do not stack then concatenate"):
        MergeConcatenate(1).convert(wide, SOURCES, ["t"])
    ragged = {SOURCES[0]: [torch.ones(2, 3), torch.ones(3, 3)], SOURCES[1]: [torch.ones(2, 3)] * 2}
    with pytest.raises(ValueError, match="do not stack then concatenate"):
        MergeConcatenate(1).convert(ragged, SOURCES, ["t"])


def test_merge_concatenate_stacks_alone_and_casts_to_the_target_parameter():
    """dim=None: MergeModulelist alone (one source pattern; two refused). With the model and the target's
    name, as transformers' loader passes them: the packed tensor in the target parameter's dtype, equal
    to transformers' ops then a cast."""
    g = torch.Generator().manual_seed(0)
    down = {"down": [torch.randn(4, 3, generator=g).to(torch.bfloat16) for _ in range(2)]}
    want = MergeModulelist(dim=0).convert(copy.copy(down), ["down"], ["t"])["t"]
    assert torch.equal(MergeConcatenate(None).convert(copy.copy(down), ["down"], ["t"])["t"], want)
    with pytest.raises(ValueError, match="expected pieces for one target"):
        MergeConcatenate(None).convert({"a": down["down"], "b": down["down"]}, ["a", "b"], ["t"])
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.down_proj = torch.nn.Parameter(torch.empty(2, 4, 3, device="meta"))
    got = MergeConcatenate(None).convert(down, ["down"], ["t"], model=model, full_layer_name="experts.down_proj")
    assert got["t"].dtype == torch.float32 and torch.equal(got["t"], want.float())
    pieces = {SOURCES[0]: [torch.ones(2, 3, dtype=torch.bfloat16)] * 2, SOURCES[1]: [torch.ones(2, 3)] * 2}
    got = MergeConcatenate(1).convert(pieces, SOURCES, ["t"], model=model, full_layer_name="experts.down_proj")
    assert got["t"].dtype == torch.float32 and got["t"].shape == (2, 4, 3)


def test_one_copy_conversions_replaces_only_stacking_converters():
    """The load's copy swaps MergeModulelist + Concatenate, and MergeModulelist alone, for
    MergeConcatenate and leaves other converters alone; its dtype plan reads the expert keys uncast
    (None), except one the model's plan names (kept) and under a quantizer (none added); the caller's
    config is untouched; restore_conversions gives the model its own converters back, which reverse
    (for saving) as before."""
    from transformers.core_model_loading import Transpose, WeightRenaming
    from transformers.modeling_utils import LoadStateDictConfig

    gate_up = WeightConverter(list(SOURCES), "mlp.experts.gate_up_proj", [MergeModulelist(0), Concatenate(1)])
    down = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(0)])
    other = WeightConverter("attn.qkv", "attn.q", [Transpose(0, 1)])
    rename = WeightRenaming("block_sparse_moe", "mlp")
    keys = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.float32,
        "model.layers.1.mlp.experts.down_proj": torch.float32,
    }
    config = LoadStateDictConfig(
        weight_mapping=[gate_up, down, other, rename], dtype_plan={"layers.1.mlp.experts": torch.float32}
    )
    loading, originals = one_copy_conversions(config, keys)
    assert config.weight_mapping == [gate_up, down, other, rename] and loading is not config
    assert config.dtype_plan == {"layers.1.mlp.experts": torch.float32}
    assert loading.dtype_plan == {
        "layers.1.mlp.experts": torch.float32,
        r"^model\.layers\.0\.mlp\.experts\.gate_up_proj$": None,
    }
    one_copy, stack, *kept = loading.weight_mapping
    assert kept == [other, rename]
    assert [type(op) for op in one_copy.operations + stack.operations] == [MergeConcatenate, MergeConcatenate]
    assert one_copy.operations[0].dim == 1 and stack.operations[0].dim is None
    assert one_copy.source_patterns == gate_up.source_patterns and one_copy.target_patterns == gate_up.target_patterns
    assert originals == {id(one_copy): gate_up, id(stack): down}

    class Quantizer:
        pass

    quantized, _ = one_copy_conversions(LoadStateDictConfig(weight_mapping=[down], hf_quantizer=Quantizer()), keys)
    assert quantized.dtype_plan == {}

    model = torch.nn.Module()
    model._weight_conversions = [one_copy, stack, rename]
    restore_conversions(model, originals)
    assert model._weight_conversions == [gate_up, down, rename]
    reverse = model._weight_conversions[0].reverse_transform()
    assert [type(op).__name__ for op in reverse.operations] == ["Chunk", "SplitModulelist"]
