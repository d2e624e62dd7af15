"""A user's own fine-tune, as ``epmoe run`` finds it: plain transformers, nothing of epmoe.

``python run_script.py MODEL_DIR OUT_DIR`` (under torchrun: one Trainer per rank, DDP) loads the model
with ``AutoModelForCausalLM.from_pretrained``, trains a few steps of fixed batches with gradient
clipping, writes each step's loss and grad norm to ``OUT_DIR/log.json`` (rank 0) and saves the model
with ``trainer.save_model()``. tests/training/test_run.py runs it with and without ``epmoe run``.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ, SAMPLES = 128, 16, 32


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


class Record(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"loss": float(logs["loss"]), "grad_norm": float(logs["grad_norm"])})


def main(model_dir: str, out_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_grad_norm=0.05,  # below every step's norm: each step clips
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    record = Record()
    trainer = Trainer(model=model, args=args, train_dataset=Batches(), callbacks=[record])
    trainer.train()
    trainer.save_model()
    if trainer.args.process_index == 0:
        Path(out_dir, "log.json").write_text(json.dumps(record.steps))


if __name__ == "__main__":
    main(*sys.argv[1:3])
