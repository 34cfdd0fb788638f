"""The TRL side of docs/coming_from_trl.md: a GRPOTrainer script whose rlvr equivalent is
examples/from_trl.yaml (same data, same reward functions, same settings).

    pip install trl && python examples/from_trl_grpo.py --model PATH_OR_HUB_ID
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import load_dataset
from from_trl_rewards import correct_answer, digit_reward
from trl import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--max-steps", type=int, default=30)
parser.add_argument("--output-dir", default="runs/from_trl_trl")
cli = parser.parse_args()

dataset = load_dataset("json", data_files=str(HERE / "from_trl_prompts.jsonl"), split="train")
split = dataset.train_test_split(test_size=0.1, seed=0)
args = GRPOConfig(
    output_dir=cli.output_dir,
    num_generations=8,
    generation_batch_size=32,
    per_device_train_batch_size=32,
    max_completion_length=16,
    temperature=1.0,
    beta=0.0,
    epsilon=0.2,
    loss_type="dapo",
    scale_rewards="group",
    max_steps=cli.max_steps,
    learning_rate=3e-3,
    lr_scheduler_type="linear",
    adam_beta2=0.999,
    reward_weights=[1.0, 0.0],
    report_to=[],
    use_cpu=True,
)
trainer = GRPOTrainer(
    model=cli.model,
    reward_funcs=[digit_reward, correct_answer],
    args=args,
    train_dataset=split["train"],
)
trainer.train()
