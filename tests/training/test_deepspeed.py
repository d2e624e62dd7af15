"""DeepSpeed ZeRO on an EP model (2 gloo ranks, CPU, one spawn for every case): ZeRO 1 and 2 through
``deepspeed.initialize`` (``epmoe.prepare_deepspeed``), through ``Trainer(TrainingArguments(deepspeed=...))``
(``epmoe.prepare_trainer``) and through accelerate's DeepSpeed plugin (``epmoe.prepare_accelerator``) equal
the same recipe without EP (every rank holding all experts, DeepSpeed's plain data parallelism): losses,
gradient norms (clipping active at every step), every parameter after 3 steps (experts: the reference's slice
for the rank), and ``trainer.save_model``'s file. Without the preparation, DeepSpeed is refused at the first
forward; an optimizer whose param groups were not split into DeepSpeed's MoE groups raises epmoe's error
naming the fix; prepare_accelerator after accelerator.prepare is refused.

ZeRO 3 (float32: DeepSpeed partitions no float64 parameter; every parameter partitioned): through
``deepspeed.initialize``, Trainer and accelerate, EP over both ranks, and (4 ranks) an EP 2 x DP 2 mesh,
equal the same ZeRO-3 run without EP: losses, norms, every parameter gathered with
``deepspeed.zero.GatheredParameters``; the experts partitioned by DeepSpeed over their expert-data-parallel
group (the "dp" replicas), the rest over all ranks; ``save_pretrained`` / ``trainer.save_model`` reloaded by
plain transformers equal the plain run's parameters; the same with parameter or optimizer offload to "cpu".
Offload to NVMe is refused before the first step, naming the option, and so is a PEFT model; an
unprepared EP model is refused at its first forward.

Tolerances: the model is float64 (ZeRO 3: float32), but ZeRO keeps float32 master weights, optimizer state and gradient
partitions and compute the norm in float32, and transformers computes the loss from float32-upcast logits.
Losses and norms: 1e-6 (a few float32 ulps). Parameters: with SGD (lr 0.5) 1e-6; with AdamW 5e-5: Adam
divides by sqrt(v) + eps, so a float32-level absolute gradient difference d on an element whose gradient is
near eps (1e-8) moves it by up to lr * d / eps (measured: 6.4e-6 relative, the same for a ZeRO run without
EP whose float32 gradients differ in their last bit). A wrong expert scale or a double reduction is off by
a factor of 2 in the norm (and, with SGD, in every expert update); the unprepared run's experts differ by O(1).
ZeRO 3 in float32: losses 1e-5, norms 1e-5, parameters with SGD 1e-6 (float32 rounding); with AdamW 3e-4
(measured 1.5e-4 relative to each tensor's largest element, the same lr * d / eps effect in float32 weights).
"""

import pytest
from ranks import start_ranks

pytestmark = pytest.mark.multirank

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from deepspeed_workers import run_all, run_zero3_mesh  # noqa: E402

EXACT_CASES = {  # case: parameter tolerance
    "initialize_zero1_sgd": 1e-6,
    "initialize_zero2_adamw": 5e-5,
    "trainer_zero2_ds_optimizer": 5e-5,
    "trainer_zero1_trainer_optimizer": 5e-5,
    "accelerate_zero2_ds_optimizer": 5e-5,
    "accelerate_zero1_torch_optimizer": 5e-5,
}
FP32 = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return start_ranks(run_all, 2, str(tmp_path_factory.mktemp("ds")), timeout=900)


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_zero_1_and_2_equal_the_recipe_without_ep(results, case):
    for rank, by_case in enumerate(results):
        got = by_case[case]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["compared"] == 25 and got["expert_params"] == 4, f"rank {rank}: compared {got}"
        assert got["loss"] <= FP32, f"rank {rank} {case}: loss {got['loss']:.3g}"
        assert got["grad_norm"] <= FP32, f"rank {rank} {case}: grad_norm {got['grad_norm']:.3g}"
        assert got["params"] <= EXACT_CASES[case], f"rank {rank} {case}: params {got['params']:.3g}"
        if case.startswith("accelerate"):  # the expert parameters in DeepSpeed's MoE param group
            assert got["moe_groups"] == 1, f"rank {rank} {case}: {got}"
        if case.startswith("trainer") and rank == 0:
            assert got["saved_compared"] == 69, got  # every tensor of the checkpoint, all 8 experts
            assert got["saved"] <= EXACT_CASES[case], f"{case}: save_model {got['saved']:.3g}"


def test_without_preparation_deepspeed_is_refused_before_a_step(results):
    for by_case in results:
        assert "epmoe.prepare_deepspeed(model)" in by_case["unprepared_initialize"], by_case["unprepared_initialize"]
        message, steps = by_case["unprepared_trainer"]
        assert "epmoe.prepare_trainer(trainer)" in message and steps == 0, (message, steps)


def test_unsplit_optimizer_groups_raise_epmoe_error_naming_the_fix(results):
    """A torch optimizer over every parameter (no MoE param groups) given to deepspeed.initialize after
    prepare_deepspeed: epmoe's ValueError naming the fix, not DeepSpeed's assertion."""
    for by_case in results:
        message = by_case["unsplit_optimizer_initialize"]
        assert message.startswith("ValueError: "), message
        assert "epmoe.prepare_deepspeed(model)" in message, message
        assert "split_params_into_different_moe_groups_for_optimizer" in message, message


ZERO3_CASES = {  # case: parameter tolerance
    "zero3_initialize_sgd": 1e-6,
    "zero3_offload_param_initialize": 1e-6,
    "zero3_offload_optimizer_initialize": 1e-6,
    "zero3_trainer_ds_optimizer_sgd": 1e-6,
    # AdamW divides each update by its gradient's running RMS: an entry whose gradient is near zero moves by up
    # to lr whatever float32 rounding the reduction order gave it (4.0e-4 measured on CI's machine, under 3e-4
    # on others); the SGD cases above are the ones that catch a mis-scaled gradient (1e-6)
    "zero3_trainer_trainer_optimizer": 1e-3,
    "zero3_accelerate_ds_optimizer": 1e-3,
}
ZERO3 = 1e-5  # losses and norms


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    return start_ranks(run_zero3_mesh, 4, str(tmp_path_factory.mktemp("ds-mesh")), timeout=900)


def check_zero3(by_rank, case, tolerance, ep_world):
    for rank, by_case in enumerate(by_rank):
        got = by_case[case]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["compared"] == 25 and got["expert_params"] == 4, f"rank {rank}: compared {got}"
        assert got["loss"] <= ZERO3, f"rank {rank} {case}: loss {got['loss']:.3g}"
        assert got["grad_norm"] <= ZERO3, f"rank {rank} {case}: grad_norm {got['grad_norm']:.3g}"
        assert got["params"] <= tolerance, f"rank {rank} {case}: params {got['params']:.3g}"
        if "marker" in got:  # DeepSpeed's own expert placement: the experts over their "dp" replicas only
            world = len(by_rank)
            replicas = world // ep_world  # the expert-data-parallel group's size
            assert got["marker"] == "AutoEPMoELayer", got
            assert got["expert_partition"] == [replicas, 16384 // replicas, 16384, 0], got
            assert got["other_partition"] == [world, 16384 // world, 16384], got
        if rank == 0 and not case.startswith("zero3_accelerate"):  # save_pretrained / save_model, reloaded
            assert got["reloaded_compared"] == 25, got  # every parameter, all 8 experts
            assert got["reloaded"] <= tolerance, f"{case}: reloaded checkpoint {got['reloaded']:.3g}"


@pytest.mark.parametrize("case", sorted(ZERO3_CASES))
def test_zero3_equals_the_recipe_without_ep(results, case):
    check_zero3(results, case, ZERO3_CASES[case], ep_world=2)


@pytest.mark.parametrize("case", ["zero3_initialize_sgd", "zero3_trainer_ds_optimizer_sgd"])
def test_zero3_on_an_ep_by_dp_mesh_equals_the_recipe_without_ep(mesh_results, case):
    check_zero3(mesh_results, case, ZERO3_CASES[case], ep_world=2)


def test_zero3_nvme_offload_is_refused_before_a_step_naming_the_option(results):
    for by_case in results:
        for case, caller in (
            ("zero3_nvme_param_initialize", "deepspeed.initialize"),
            ("zero3_nvme_optimizer_initialize", "deepspeed.initialize"),
            ("zero3_nvme_param_trainer", "prepare_trainer(trainer)"),
            ("zero3_nvme_optimizer_trainer", "prepare_trainer(trainer)"),
            ("zero3_nvme_optimizer_accelerate", "prepare_accelerator(accelerator)"),
        ):
            got = by_case[case]
            message, steps = got if isinstance(got, (tuple, list)) else (got, 0)
            option = "offload_param" if "_param_" in case else "offload_optimizer"
            assert caller in message and f"zero_optimization.{option} (device 'nvme')" in message, (case, message)
            assert steps == 0, (case, steps)


def test_zero3_with_peft_is_refused_inside_initialize(results):
    for by_case in results:
        for case in ("zero3_expert_lora_initialize", "zero3_attention_lora_initialize"):
            message = by_case[case]
            assert "ZeRO stage 3 with a PEFT model (LoRA)" in message, (case, message)


def test_zero3_without_preparation_is_refused_at_the_first_forward(results):
    for by_case in results:
        message, steps = by_case["zero3_unprepared_initialize"]
        assert "epmoe.prepare_deepspeed(model)" in message and "ZeRO stage 3" in message, message
        assert steps == 0


def test_prepare_accelerator_after_the_engine_is_built_is_refused(results):
    for by_case in results:
        message = by_case["accelerate_after_prepare"]
        assert "before accelerator.prepare" in message, message
