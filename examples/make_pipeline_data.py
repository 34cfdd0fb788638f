"""Write the data of examples/pipeline.yaml from the *training* split of the 2-digit addition task
(the held-out problems the pipeline is scored on are never in it):

    python examples/make_pipeline_data.py      # -> examples/pipeline_sft.jsonl, pipeline_pairs.jsonl

SFT rows answer "a + b = sum."; DPO pairs prefer the right sum over a near miss (off by 1-10).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlvr.config import ArithmeticConfig
from rlvr.tasks import arithmetic_tasks

HERE = Path(__file__).resolve().parent


def main(num_sft: int = 256, num_pairs: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    train = list(arithmetic_tasks(ArithmeticConfig(digits=2, prompt="What is {a} + {b}?")).train)
    rng.shuffle(train)
    sft, pairs = [], []
    for task in train[:num_sft]:
        question = task.messages[-1]["content"]
        a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
        answer = f"{a} + {b} = {task.fields['answer']}."
        sft.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    for task in train[num_sft : num_sft + num_pairs]:
        question = task.messages[-1]["content"]
        a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
        right = int(task.fields["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        pairs.append(
            {
                "prompt": question,
                "chosen": f"{a} + {b} = {right}.",
                "rejected": f"{a} + {b} = {wrong}.",
            }
        )
    for name, rows in (("pipeline_sft.jsonl", sft), ("pipeline_pairs.jsonl", pairs)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
