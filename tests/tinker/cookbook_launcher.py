"""Runs one of tinker-cookbook's recipes, unmodified, against a Signal server, offline (tests/tinker/test_cookbook.py).

    python -m tests.tinker.cookbook_launcher RECIPE TOKENIZER_DIR SEED key=value...

RECIPE is a module under tinker_cookbook.recipes (sl_loop, rl_loop), or a library module under tinker_cookbook whose
`main(Config)` has no command line of its own (distillation.train_off_policy: off-policy distillation, a teacher's
top-K as soft targets); the key=value pairs are its chz arguments, as on a recipe's own command line, nested and
polymorphic ones included (`dataset_configs.0.dataset_builder=module:Class`). The SDK reads TINKER_BASE_URL and
TINKER_API_KEY (`tml-` + the Signal key) from the environment. The recipe's code runs as shipped; what this launcher
swaps in is what a machine without the Hub lacks, plus the two things a test needs to be able to fail:
- the tokenizer: the recipe's model name is registered to the local tokenizer directory (tokenizer_utils'
  own registry);
- the datasets: `datasets.load_dataset` answers the recipe's Hub names with local data (the conversations file the
  cookbook wheel ships for sl_loop; generated arithmetic in GSM8K's columns for rl_loop); train_off_policy's builder
  is an argument, the cookbook's own FromConversationFileBuilder on that same file, which needs no Hub;
- rl_loop's reward: a random tiny model never answers \\boxed{n}, so every group would earn 0, every advantage would
  be 0 and rl_loop would skip every step; the reward here varies within a group (the response's length);
- the LoRA seed: create_lora_training_client sends none (so Signal picks a random one); the resume test compares
  two runs, which must start from the same weights.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import random
import sys
from importlib import resources
from typing import Any

HUB_DATASETS = {"HuggingFaceH4/no_robots": "conversations", "openai/gsm8k": "arithmetic"}
ARITHMETIC_ROWS = 64
LIBRARY_PACKAGES = ("distillation.",)  # RECIPE names under these are tinker_cookbook's library modules, not recipes


def conversations() -> Any:
    import datasets

    path = resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    return datasets.DatasetDict({"train": rows, "test": rows})  # no_robots' two splits (sl_basic evaluates on test)


def arithmetic() -> Any:
    """Sums in GSM8K's form: a question, and an answer whose last line is `#### n`."""
    import datasets

    rng = random.Random(0)
    pairs = [(rng.randint(1, 99), rng.randint(1, 99)) for _ in range(ARITHMETIC_ROWS)]
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict({
        "question": [f"What is {a} + {b}?" for a, b in pairs],
        "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a, b in pairs],
    })})


def local_datasets() -> None:
    import datasets

    hub_load = datasets.load_dataset

    def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
        if path in HUB_DATASETS:
            return {"conversations": conversations, "arithmetic": arithmetic}[HUB_DATASETS[path]]()
        return hub_load(path, *args, **kwargs)

    datasets.load_dataset = load_dataset


def length_reward(response: str, answer: str) -> float:
    """Varies within a group (responses differ in length), so rl_loop's advantages are not all zero."""
    return len(response) / 100.0


def main(argv: list[str]) -> None:
    recipe, tokenizer_dir, seed, *arguments = argv
    import chz
    import tinker
    from tinker_cookbook.tokenizer_utils import register_tokenizer
    from transformers import AutoTokenizer

    model_name = next(a.split("=", 1)[1] for a in arguments if a.startswith("model_name="))
    # Any HF tokenizer serves; the cookbook's annotation names one backend class.
    register_tokenizer(model_name, functools.cache(lambda: AutoTokenizer.from_pretrained(tokenizer_dir)))  # type: ignore[arg-type]
    local_datasets()
    # A partialmethod keeps the signature the recipe calls; mypy refuses any assignment to a method.
    tinker.ServiceClient.create_lora_training_client = functools.partialmethod(  # type: ignore[method-assign, assignment]
        tinker.ServiceClient.create_lora_training_client, seed=int(seed))
    library = recipe.startswith(LIBRARY_PACKAGES)
    module: Any = importlib.import_module(f"tinker_cookbook.{'' if library else 'recipes.'}{recipe}")
    if recipe == "rl_loop":
        module.get_reward = length_reward
    ran = chz.nested_entrypoint(module.main, argv=arguments)  # what the recipe's own `__main__` block does
    if inspect.iscoroutine(ran):  # a library's async main: chz's own advice, asyncio.run(chz.nested_entrypoint(main))
        asyncio.run(ran)


if __name__ == "__main__":
    main(sys.argv[1:])
