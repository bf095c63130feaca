"""The supervised warm start: teach the task's targets briefly, cache the result.

RL from a random tiny model never sees a reward; a short supervised phase brings it to
a modest accuracy first. The supervised curve of 3-digit addition has a sharp jump (from
~1 % to ~40 % within ~50 steps) whose position moves by hundreds of steps with the seed and
with the CPU's float path (``ATEN_CPU_CAPABILITY``), so a fixed step count lands on either
side of it: the embedded default stops on a validation accuracy target instead.

The result is cached under ``<cache>/warmstart/<hash>.safetensors``, keyed by everything that
determines it (the model, seed, task, steps, learning rate, batch size, target, and the float
path: torch version, CPU kernel set, thread count), written atomically and trained by one
process at a time (a lock beside the entry: concurrent runs of one seed wait and load it).
Files enter the key by their content (``content_fingerprint``), never by their path: an edited
dataset or new weights saved into a ``--model`` directory are another entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_model, save_model

from softtrust._runfiles import PLAIN_FILE_MODE

from .rollout import encode_prompts
from .tiny import TinyModelConfig

EVAL_SEED = 1_234_567  # the held-out set does not depend on the training seed
VALIDATION_SEED, VALIDATION_SIZE = 7_654_321, 256  # --sft-target-accuracy's stopping set

WARMSTART_VERSION = 2  # bump when the warm-start recipe changes (2: the float path in the key)


class WarmStart(NamedTuple):
    """What ``warm_start`` did.

    ``accuracy``: the validation accuracy where it stopped (``None`` without a target);
    ``reached``: whether it reached ``target`` (``True`` without one)."""

    cache_file: Path | None
    cached: bool
    steps: int
    accuracy: float | None = None
    target: float | None = None

    @property
    def reached(self) -> bool:
        return self.target is None or (self.accuracy is not None and self.accuracy >= self.target)


def float_path() -> dict:
    """What decides the float results of a CPU computation besides the code: the torch version,
    the CPU kernel set PyTorch dispatches to (``ATEN_CPU_CAPABILITY`` picks it; ``default``,
    ``avx2``, ``avx512``, ...) and the intra-op thread count."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def cache_root(cache_dir: str | None = None) -> Path:
    """``cache_dir``, else ``$SOFTTRUST_CACHE``, else ``~/.cache/softtrust``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("SOFTTRUST_CACHE"):
        return Path(os.environ["SOFTTRUST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "softtrust"


FULL_HASH_BYTES = 8 << 20  # files up to this size are hashed whole
EDGE_BYTES = 1 << 20  # of a larger file: its size, mtime and a hash of its first and last MiB


def file_fingerprint(path: Path) -> str:
    """A file's content in a few words: ``sha256:<hex>`` of the whole file up to
    ``FULL_HASH_BYTES``; for a larger one (model weights) its size, modification time and the
    hash of its first and last ``EDGE_BYTES`` (re-saved weights change the time, an edit the hash)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(EDGE_BYTES), b""):
                digest.update(block)
            return f"sha256:{digest.hexdigest()}"
        digest.update(handle.read(EDGE_BYTES))
        handle.seek(-EDGE_BYTES, os.SEEK_END)
        digest.update(handle.read(EDGE_BYTES))
    return f"{size}:{path.stat().st_mtime_ns}:{digest.hexdigest()}"


def content_fingerprint(path: str | Path) -> str:
    """What a warm-start key holds for a file or a directory (a model, a ``save_to_disk``
    dataset): ``file_fingerprint`` of the file, or a hash over every file under the directory
    (relative path and fingerprint; hidden ones, such as a download cache, left out)."""
    path = Path(path)
    if path.is_file():
        return file_fingerprint(path)
    if not path.is_dir():
        return f"missing:{path}"
    files = {}
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if file.is_file() and not any(part.startswith(".") for part in relative.parts):
            files[relative.as_posix()] = file_fingerprint(file)
    return "dir:" + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def warmstart_key(**recipe) -> str:
    text = json.dumps({"version": WARMSTART_VERSION, **recipe}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def supervised_batch(tokenizer, task, problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + target + EOS, left-padded; labels are -100 on the prompt and padding."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [problem.prompt for problem in problems])
    targets = [
        tokenizer(task.target(problem), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for problem in problems
    ]
    width = max(len(target) for target in targets)
    target_ids = torch.full((len(problems), width), tokenizer.pad_token_id, dtype=torch.long)
    target_mask = torch.zeros((len(problems), width), dtype=torch.long)
    for row, target in enumerate(targets):
        target_ids[row, : len(target)] = torch.tensor(target)
        target_mask[row, : len(target)] = 1
    input_ids = torch.cat([prompt_ids, target_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, target_mask], dim=1)
    labels = torch.cat(
        [torch.full_like(prompt_ids, -100), target_ids.masked_fill(target_mask == 0, -100)], dim=1
    )
    return input_ids, attention_mask, labels


def supervised_finetune(
    model,
    tokenizer,
    task,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    exclude=(),
    progress=None,
    reached=None,
    check_every: int = 10,
) -> int:
    """At most ``steps`` AdamW steps of cross-entropy on the task's targets (in place).

    ``reached``: optional ``f(model) -> bool`` called every ``check_every`` steps (and not
    before the first); training stops as soon as it returns True. Returns the steps taken.
    """
    from .rollout import ProblemSampler, position_ids_from_mask

    sampler = ProblemSampler(task, seed=seed + 1_000_003, exclude=exclude)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        input_ids, attention_mask, labels = supervised_batch(tokenizer, task, sampler.draw(batch_size))
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
        ).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if progress is not None:
            progress(step, float(loss.detach()))
        if reached is not None and (step + 1) % check_every == 0 and reached(model):
            model.eval()
            return step + 1
    model.eval()
    return steps


def warm_start(
    model,
    tokenizer,
    task,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    key_extra: dict,
    cache_dir: str | None,
    exclude=(),
    progress=None,
    target: tuple[float, Callable[[torch.nn.Module], float]] | None = None,
) -> WarmStart:
    """Load the cached warm start for this recipe, or train it and cache it atomically.

    ``target``: ``(accuracy, accuracy_of)``: stop once ``accuracy_of(model) >= accuracy``
    (checked every 10 steps; ``steps`` is then the maximum). The steps taken and the accuracy
    reached are stored next to the weights, so a cached entry reports them too.
    ``progress(step, loss)`` is called after each supervised step (never for a cached entry).

    Returns:
        a ``WarmStart``; ``WarmStart(None, False, 0)`` when ``steps == 0``.
    """
    if steps == 0:
        return WarmStart(None, False, 0)
    recipe = dict(
        task=task.name, steps=steps, lr=lr, batch_size=batch_size, seed=seed, **key_extra, **float_path()
    )
    if target is not None:
        recipe["target_accuracy"] = target[0]
    cache_file = cache_root(cache_dir) / "warmstart" / f"{warmstart_key(**recipe)}.safetensors"
    goal = None if target is None else target[0]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_file.with_suffix(".lock")):  # one trainer per entry; the others load it
        if cache_file.is_file():
            try:
                load_model(model, str(cache_file))
                model.eval()
                taken, accuracy = _stored(cache_file, steps)
                return WarmStart(cache_file, True, taken, accuracy, goal)
            except Exception:
                cache_file.unlink(missing_ok=True)  # a corrupt cache entry: retrain
        taken, accuracy = _train(
            model, tokenizer, task, steps, lr, batch_size, seed, exclude, progress, target
        )
        _save_atomically(model, cache_file, taken, accuracy)
    return WarmStart(cache_file, False, taken, accuracy, goal)


def _train(model, tokenizer, task, steps, lr, batch_size, seed, exclude, progress, target):
    """``supervised_finetune`` from ``seed`` (the caller's random state kept); returns the steps
    taken and, with a target, the validation accuracy where it stopped."""
    random_state = random.getstate(), torch.get_rng_state()
    torch.manual_seed(seed)
    measured: list[float] = []
    reached = None
    if target is not None:
        goal, accuracy_of = target

        def reached(trained) -> bool:
            measured.append(accuracy_of(trained))
            return measured[-1] >= goal

    try:
        taken = supervised_finetune(
            model,
            tokenizer,
            task,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
            exclude=exclude,
            progress=progress,
            reached=reached,
        )
    finally:
        random.setstate(random_state[0])
        torch.set_rng_state(random_state[1])
    bad = [name for name, tensor in model.state_dict().items() if not torch.isfinite(tensor).all()]
    if bad:  # never cache (and reuse) a diverged warm start
        raise ValueError(
            f"sft_lr: the warm start diverged (non-finite weights in {bad[:3]}) with sft_lr={lr}; "
            "nothing was cached: lower --sft-lr"
        )
    if target is not None and (not measured or (taken == steps and steps % 10)):
        measured.append(target[1](model))  # the cap fell between two checks: measure where it ended
    return taken, (measured[-1] if measured else None)


def _save_atomically(model, cache_file: Path, taken: int, accuracy: float | None) -> None:
    metadata = {"steps_taken": str(taken)}
    if accuracy is not None:
        metadata["accuracy"] = repr(float(accuracy))
    descriptor, temporary = tempfile.mkstemp(dir=cache_file.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(descriptor)
    try:
        save_model(model, temporary, metadata=metadata)
        os.chmod(temporary, PLAIN_FILE_MODE)  # mkstemp's 0600 would survive the rename
        os.replace(temporary, cache_file)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (released by the kernel if the process dies,
    so a killed trainer never leaves it stuck); a no-op where ``fcntl`` is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stored(cache_file: Path, default_steps: int) -> tuple[int, float | None]:
    """The supervised steps a cached warm start took and the validation accuracy it stopped at."""
    from safetensors import safe_open

    with safe_open(str(cache_file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    accuracy = metadata.get("accuracy")
    return int(metadata.get("steps_taken", default_steps)), None if accuracy is None else float(accuracy)


def warmstart_recipe(config, with_target: bool) -> dict:
    """What the warm start's cache key holds besides its own arguments (``warmstart.warm_start``):
    the model and the dataset by content (``content_fingerprint``: an edited file or new weights
    in the ``--model`` directory are another entry), the weights' dtype, the dataset's columns and
    system prompt, the held-out set it avoids; with a target, the stopping rule's validation set,
    decoding length and rewards (the correctness reward decides what counts as right)."""
    recipe = {
        "model": TinyModelConfig().__repr__() if config.model is None else content_fingerprint(config.model),
        "eval": (EVAL_SEED, config.eval_size),
        "dataset": None if config.dataset is None else content_fingerprint(config.dataset),
    }
    if config.dtype != "fp32":  # absent for fp32: the embedded default keeps the key it had
        recipe["dtype"] = config.dtype
    if config.dataset is not None:
        recipe["columns"] = (config.prompt_column, config.answer_column, config.system_prompt)
    elif config.system_prompt is not None:  # a chat prompt's system message changes the problems
        recipe["system_prompt"] = config.system_prompt
    if config.task_config:  # a generator's options (reasoning-gym) change the problems
        recipe["task_config"] = config.task_config
    if with_target:
        recipe["validation"] = (VALIDATION_SEED, VALIDATION_SIZE, config.effective_max_new_tokens)
        if config.dataset is not None:
            recipe["rewards"] = (
                config.reward,
                list(config.reward_weights),
                config.correctness_reward,
                config.strict_reward,
                [reward_source(name) for name in config.reward.split(",")],
            )
    return recipe


def reward_source(name: str) -> str | None:
    """The content of a ``module:function`` reward's source file (``content_fingerprint``); None
    for a built-in reward or a module without a file."""
    import importlib.util

    module, colon, _ = name.strip().partition(":")
    try:
        spec = importlib.util.find_spec(module) if colon else None
    except (ImportError, ValueError):  # loading the rewards reports a module that cannot be found
        spec = None
    origin = getattr(spec, "origin", None)
    return content_fingerprint(origin) if origin and origin.endswith(".py") else None
