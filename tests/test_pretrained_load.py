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
    pieces = {SOURCES[0]: [torch.randn(gate_shape, generator=g, dtype=torch.float64) for _ in range(3)],
              SOURCES[1]: [torch.randn(up_shape[::-1], generator=g, dtype=torch.float64).t() for _ in range(3)]}
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


def test_one_copy_conversions_replaces_only_stack_then_concatenate():
    """The load's copy swaps MergeModulelist + Concatenate for MergeConcatenate (later ops kept) and
    leaves other converters alone; the caller's config is untouched; restore_conversions gives the model
    its own converters back, which reverse (for saving) as before."""
    from transformers.modeling_utils import LoadStateDictConfig

    gate_up = WeightConverter(list(SOURCES), "mlp.experts.gate_up_proj", [MergeModulelist(0), Concatenate(1)])
    down = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(0)])
    config = LoadStateDictConfig(weight_mapping=[gate_up, down])
    loading, originals = one_copy_conversions(config)
    assert config.weight_mapping == [gate_up, down] and loading is not config
    one_copy, kept = loading.weight_mapping
    assert kept is down and [type(op) for op in one_copy.operations] == [MergeConcatenate]
    assert one_copy.operations[0].dim == 1 and one_copy.source_patterns == gate_up.source_patterns
    assert one_copy.target_patterns == gate_up.target_patterns and originals == {id(one_copy): gate_up}

    model = torch.nn.Module()
    model._weight_conversions = [one_copy, down]
    restore_conversions(model, originals)
    assert model._weight_conversions == [gate_up, down]
    reverse = model._weight_conversions[0].reverse_transform()
    assert [type(op).__name__ for op in reverse.operations] == ["Chunk", "SplitModulelist"]
