"""Rollout routing replay in TRL's ``GRPOTrainer``: each completion trained through the experts that generated it.

:func:`replay_rollout_routing` makes a ``GRPOTrainer`` (with or without EP) record the routes of its
own ``generate`` (:func:`epmoe.record_routing`) and replay them in the training forward and backward
of each micro-batch (:func:`epmoe.replay_routing`)::

    _generate_single_turn            generate under record_routing: per position of the padded
                                     prompts and the completions, the K expert ids of every layer
    _generate_and_score_completions  the routes laid out as the batch TRL builds: (B, L, P + C, K),
                                     prompt positions (padding included) then completion positions,
                                     -1 where no forward of generate saw the token (the last generated one)
                                     a per-sample field, so TRL's shuffle and split carry it along
    training_step                    forward and backward of the micro-batch inside replay_routing
      _compute_loss                  (the replay opens here, where the micro-batch's routes are)

Only the training step replays: forwards TRL runs inside ``_generate_and_score_completions`` (old and
reference log-probabilities) and evaluation route as usual. Generation by vLLM or transformers'
continuous batching, and tool calls (several generations per batch), raise ``ValueError``: their
forwards are not this model's or not one batch position after position.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

import torch

from epmoe.training.launchers import GRPO_SINCE, TABLE, differs, remember, remembered, replace
from epmoe.training.replay import RoutingRecord, record_routing, replay_routing

_REPLAYING = "rollout routing replay"


def replay_rollout_routing(trainer: Any) -> Any:
    """Make ``trainer`` (TRL's ``GRPOTrainer``) replay each rollout's routes in its training step; returns it.

    Call once, after building the trainer (and :func:`epmoe.prepare_trainer` on an EP model), before
    ``trainer.train()``. Idempotent.
    """
    if not callable(getattr(trainer, "_generate_and_score_completions", None)) or not hasattr(trainer, "model"):
        raise TypeError(f"replay_rollout_routing(trainer): expected TRL's GRPOTrainer, got {type(trainer).__name__}")
    for flag, why in (
        ("use_vllm", "vLLM generates: convert its routed experts with epmoe.routes_from_vllm"),
        ("use_transformers_continuous_batching", "continuous batching does not run the batch position after position"),
        ("tools", "tool calls generate several times per batch"),
    ):
        if getattr(trainer, flag, None):
            raise ValueError(f"replay_rollout_routing(trainer): {flag} is set: {why}")
    differ = [entry.method for entry in TABLE if entry.owner == "trl.GRPOTrainer" and differs(entry)]
    if differ:
        raise ValueError(
            f"replay_rollout_routing(trainer): trl {importlib.metadata.version('trl')}'s GRPOTrainer differs in "
            f"{differ} from the trl epmoe replays in: use trl >= {GRPO_SINCE}"
        )
    if remembered(trainer, _REPLAYING):
        return trainer
    remember(trainer, _REPLAYING)
    _install(trainer)
    return trainer


def _install(trainer: Any) -> None:
    generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions
    training_step, compute_loss = trainer.training_step, trainer._compute_loss
    rollout: dict[str, Any] = {}  # "record": the last generation's; "stack": the training step's replay

    def recorded_generate(*args, **kwargs):
        if "record" in rollout:
            raise ValueError("replay_rollout_routing: two generations for one batch (tool calls?) cannot be replayed")
        with record_routing(trainer.model) as record:
            completions = generate(*args, **kwargs)
        rollout["record"] = record
        return completions

    def scored(inputs):
        try:
            output = score(inputs)
            record = rollout.pop("record", None)
        finally:  # a failed scoring leaves no record to the next batch
            rollout.pop("record", None)
        if record is None:
            raise ValueError(
                "replay_rollout_routing: the batch was scored without a generation by this model's "
                "generate (GRPOTrainer._generate_single_turn): there are no routes to replay"
            )
        output["routes"] = rollout_routes(record, output["prompt_ids"], output["completion_ids"])
        return output

    def replayed_training_step(model, inputs, num_items_in_batch):
        with contextlib.ExitStack() as stack:
            rollout["stack"] = stack
            try:
                return training_step(model, inputs, num_items_in_batch)
            finally:
                del rollout["stack"]

    def replayed_compute_loss(model, inputs):
        routes = inputs.get("routes")
        if "stack" in rollout and routes is not None:  # (B, L, S, K) -> (L, B, S, K)
            rollout["stack"].enter_context(replay_routing(model, routes.transpose(0, 1)))
        return compute_loss(model, inputs)

    replace(trainer, "_generate_single_turn", recorded_generate)
    replace(trainer, "_generate_and_score_completions", scored)
    replace(trainer, "training_step", replayed_training_step)
    replace(trainer, "_compute_loss", replayed_compute_loss)


def rollout_routes(record: RoutingRecord, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L, P + C, K)`` int64: the routes ``record`` holds for the sequences ``[prompt_ids, completion_ids]``
    (``(B, P)`` left-padded as generate saw them, ``(B, C)``), ``-1`` at positions no forward saw."""
    by_position = record.routes_by_position()  # (L, B, S, K): the prompt, then one position per step
    layers, batch, seen, top_k = by_position.shape
    prompt = record.calls[0][1]
    if (batch, prompt) != tuple(prompt_ids.shape):
        raise ValueError(
            f"replay_rollout_routing: generate ran {batch} prompts of {prompt} positions, the batch "
            f"holds {tuple(prompt_ids.shape)}: the routes cannot be placed"
        )
    length = prompt + completion_ids.shape[1]
    routes = by_position.new_full((layers, batch, length, top_k), -1)
    routes[:, :, : min(seen, length)] = by_position[:, :, :length]
    return routes.transpose(0, 1).contiguous().to(prompt_ids.device)
