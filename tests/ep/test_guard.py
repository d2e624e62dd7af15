"""The step guard's one-factor rule on one process: each rank's verdict on its expert gradients, and the
check of every rank's verdicts (the multi-rank idioms are in tests/training/test_accelerate.py)."""

import pytest
import torch
from torch import nn

from epmoe.ep.guard import CHANGED, NO_EVIDENCE, SCALED, UNCHANGED, StepGuard, check


def recorded(*grads):
    """A guard whose last backward left ``grads`` as the expert gradients."""
    root = nn.Module()
    for i, grad in enumerate(grads):
        root.register_parameter(f"p{i}", nn.Parameter(torch.zeros_like(grad)))
        getattr(root, f"p{i}").grad = grad
    guard = StepGuard(lambda p: True)
    guard._record(root)
    return guard, root


def verdict(guard, root):
    verdict, factor_bits, tolerance_bits, _ = guard.payload(root, torch.device("cpu")).tolist()
    as_float = lambda bits: torch.tensor(bits, dtype=torch.int64).view(torch.float64).item()  # noqa: E731
    return verdict, as_float(factor_bits), as_float(tolerance_bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_division_by_the_token_count_is_one_factor(dtype):
    grads = [torch.randn(4, 6, 5, dtype=dtype), torch.randn(4, 5, 3, dtype=dtype)]
    guard, root = recorded(*grads)
    for grad in grads:
        grad.div_(37)
    kind, factor, tolerance = verdict(guard, root)
    assert kind == SCALED and factor == pytest.approx(1 / 37, rel=tolerance)
    assert tolerance == 4 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_two_factors_on_one_rank_are_no_single_factor(dtype):
    grads = [torch.randn(4, 6, 5, dtype=dtype), torch.randn(4, 5, 3, dtype=dtype)]
    guard, root = recorded(*grads)
    grads[0].mul_(0.5)
    grads[1].mul_(0.55)
    assert verdict(guard, root)[0] == CHANGED


def test_unchanged_zeroed_and_empty():
    grads = [torch.randn(3, 4), torch.randn(3, 4)]
    guard, root = recorded(*grads)
    assert verdict(guard, root)[:2] == (UNCHANGED, 1.0)
    guard, root = recorded(*grads)
    grads[0].zero_()  # zero_grad(set_to_none=False): not a change
    assert verdict(guard, root)[0] == UNCHANGED
    guard, root = recorded(torch.zeros(3, 4))  # an expert that got no tokens: nothing to judge
    assert verdict(guard, root)[0] == NO_EVIDENCE


def values(kind, factor, tolerance=1e-15, fingerprint=7):
    bits = lambda x: torch.tensor(x, dtype=torch.float64).view(torch.int64).item()  # noqa: E731
    return [kind, bits(factor), bits(tolerance), fingerprint]


def test_check_passes_one_factor_and_raises_on_factors_per_rank():
    check([values(SCALED, 1 / 37), values(SCALED, 1 / 37), values(NO_EVIDENCE, 1.0)], "here")
    with pytest.raises(RuntimeError, match=r"a different factor on each rank \(rank 0: 0.5, rank 1: 0.75\)"):
        check([values(SCALED, 0.5), values(SCALED, 0.75)], "here")
    with pytest.raises(RuntimeError, match="a different factor on each rank"):
        check([values(SCALED, 0.5), values(UNCHANGED, 1.0)], "here")  # one rank clipped, the other not
    with pytest.raises(RuntimeError, match="a multiply by 1.0 on every rank"):
        check([values(SCALED, 1.0), values(SCALED, 1.0)], "here")
    with pytest.raises(RuntimeError, match=r"on EP rank\(s\) \[1\], by something that is no single factor"):
        check([values(SCALED, 0.5), values(CHANGED, 0.5)], "here")
    with pytest.raises(RuntimeError, match="replicated .non-expert. parameters differ"):
        check([values(UNCHANGED, 1.0, fingerprint=1), values(UNCHANGED, 1.0, fingerprint=2)], "here")
