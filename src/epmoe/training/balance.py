"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias that steers expert selection.

    router scores s (E,) per token  ->  top-k of (s + bias)  selects the experts
                                        the routing weights stay the model's own s at those experts
    after each optimizer step:          bias += update_rate * sign(mean(load) - load)

``load`` is the global load since the balancer's last step (:mod:`epmoe.ep.load`: summed over the
EP group and, on an EP x DP mesh, over the ``"dp"`` replicas), so the biases are identical on every
rank and at every EP size. With EP size 1 there is no EP group to sum over: the load is this
process's own (under plain data parallelism with EP size 1, each rank's biases follow its own batches). Where the router has a
selection bias of its own (DeepSeek-V3's ``e_score_correction_bias``) that buffer is the bias; other
routers that select ``top-k`` of ``softmax(logits)`` (Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE, Mixtral,
OLMoE) get a forward hook that re-selects with the bias, recomputing the weights exactly as the
router does (checked once, on a probe, against the router's own output with a zero bias). Other
routers raise.
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.load import global_load, replicas_load
from epmoe.ep.state import require_ep_states
from epmoe.integrations.blocks import block_router
from epmoe.training.launchers import remember, remembered

_COUNTER = "balancer"
_BALANCED = "LoadBalancer"  # a router with a balancer (one per model)


class LoadBalancer:
    """``LoadBalancer(model, update_rate=1e-3, optimizer=None)``: see the module docstring.

    ``balancer.bias``: experts module name -> ``(E,)`` float32 selection bias. Call
    :meth:`step` after every ``optimizer.step()`` on every rank, or pass ``optimizer`` to have it
    called by the optimizer's step post-hook.
    """

    def __init__(self, model: nn.Module, update_rate: float = 1e-3, optimizer: torch.optim.Optimizer | None = None):
        if isinstance(update_rate, bool) or not isinstance(update_rate, (int, float)) or not update_rate > 0:
            raise ValueError(f"LoadBalancer(update_rate): expected a number > 0, got {update_rate!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"LoadBalancer(optimizer): expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.update_rate = float(update_rate)
        self.bias: dict[str, torch.Tensor] = {}
        self._states = require_ep_states(model, "LoadBalancer")
        routers = [(name, block_router(state.model.paths[state.layer][-2])) for name, state in self._states]
        for (name, router), (_, state) in zip(routers, self._states):
            if remembered(router, _BALANCED):
                raise ValueError(f"LoadBalancer: {name} already has a LoadBalancer (one per model)")
            own = getattr(router, "e_score_correction_bias", None)
            if isinstance(own, torch.Tensor):
                self.bias[name] = own
            else:
                _check_softmax_top_k(name, router)
                self.bias[name] = torch.zeros(state.shard.num_experts, dtype=torch.float32, device=router.weight.device)
                router.register_forward_hook(_biased_selection(self.bias[name]))
            remember(router, _BALANCED)
            state.loads.add_counter(_COUNTER, routed=True)
            state.loads[_COUNTER].zero_()
        self._followers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bias, a mirror's buffer)
        self._hook = optimizer.register_step_post_hook(lambda *_: self.step()) if optimizer is not None else None

    @torch.no_grad()
    def step(self) -> None:
        """Update every bias from the global load since the last step (a collective over the EP group)."""
        for name, state in self._states:
            load = replicas_load(state, global_load(state, _COUNTER)).to(torch.float64)
            state.loads[_COUNTER].zero_()
            if load.sum() == 0:
                continue
            delta = self.update_rate * torch.sign(load.mean() - load)
            self.bias[name].add_(delta.to(self.bias[name].device, self.bias[name].dtype))
        self.sync_mirrors()

    @torch.no_grad()
    def sync_mirrors(self) -> None:
        """Copy the biases into the bias buffers of the models given to :meth:`mirror` (done by :meth:`step`)."""
        for bias, follower in self._followers:
            follower.copy_(bias)

    def mirror(self, other: nn.Module) -> None:
        """Make ``other``, an unsharded copy of the model (no EP), select experts with these same biases
        from now on (e.g. a reference or evaluation copy): hooks sharing the bias tensors, or, where the
        router has its own bias buffer, that buffer following at every :meth:`step`."""
        modules = dict(other.named_modules())
        for name, bias in self.bias.items():
            block = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
            if block is None:
                raise ValueError(
                    f"LoadBalancer.mirror(other): {type(other).__name__} has no module "
                    f"{name.rsplit('.', 1)[0]!r}: pass the unsharded model itself, unwrapped"
                )
            router = block_router(block)
            own = getattr(router, "e_score_correction_bias", None)
            if isinstance(own, torch.Tensor):
                self._followers.append((bias, own))
                with torch.no_grad():
                    own.copy_(bias)
            else:
                router.register_forward_hook(_biased_selection(bias))

    def remove(self) -> None:
        """Stop being called by the optimizer (the biases stay in force)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _select(router: nn.Module, logits: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype):
    """What a softmax-top-k router returns, with ``bias`` added to the probabilities for the choice."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    index = torch.topk(probs + bias, router.top_k, dim=-1).indices
    weights = probs.gather(-1, index)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), index


def _biased_selection(bias: torch.Tensor):
    def hook(router, _inputs, output):
        logits, weights, _ = output
        new_weights, index = _select(router, logits, bias, weights.dtype)
        return logits, new_weights, index

    return hook


def _check_softmax_top_k(name: str, router: nn.Module) -> None:
    """The router must be a ``top-k of softmax(logits)`` router that :func:`_select` reproduces exactly."""
    weight = getattr(router, "weight", None)
    if not isinstance(getattr(router, "top_k", None), int) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"LoadBalancer: the router of {name} ({type(router).__name__}) has no top_k and (E, H) "
            f"weight: cannot bias its expert selection"
        )
    probe = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        output = router(probe)
        ok = isinstance(output, tuple) and len(output) == 3
        if ok:
            logits, weights, index = output
            mine_weights, mine_index = _select(
                router, logits, torch.zeros(logits.shape[-1], device=logits.device), weights.dtype
            )
            ok = torch.equal(mine_index, index) and torch.equal(mine_weights, weights)
    if not ok:
        raise ValueError(
            f"LoadBalancer: the router of {name} ({type(router).__name__}) is not a top-k-of-softmax "
            f"router (its output differs from that rule on a probe): cannot bias its selection"
        )
