"""Hugging Face's Trainer on TorchDistributor's processes, its curve and checkpoints reported (docs/frameworks.md).

python hf_trainer.py OUTPUT_DIR
"""

import sys

from airflow_provider_hvd import TorchDistributor


def train(output_dir: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from airflow_provider_hvd.integrations.transformers import ReportCallback, last_checkpoint_path

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 128, (256, 32), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=output_dir,  # on a cluster: storage that every host reads (a retry resumes from it)
        use_cpu=not torch.cuda.is_available(),  # without it, on a host without GPUs, each process trains alone
        max_steps=20,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        logging_steps=5,
        save_steps=10,
        report_to="none",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": ids, "labels": ids} for ids in tokens],
        callbacks=[ReportCallback()],  # the curve and each checkpoint-N folder, to the driver
    )
    trainer.train(resume_from_checkpoint=last_checkpoint_path())  # None: from the start
    return {"steps": trainer.state.global_step, "processes": args.world_size}


if __name__ == "__main__":
    runner = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    print(runner.run(train, sys.argv[1]))  # {'steps': 20, 'processes': 2}
    print("loss by step:", runner.metrics["loss"])
    print("last checkpoint:", runner.checkpoint["path"])  # .../checkpoint-20
