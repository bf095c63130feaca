"""The prompts against the policy, checked before any run directory exists (``tasks.task_and_held_out``).

Two things fail only once a run has started otherwise: a prompt longer than the model's context
(a 400,000-character prompt asks the sampler for ~160 GB) and a chat template that refuses a
conversation (one that raises on a system message, with ``--system-prompt``). Each is a
``ValueError`` naming the dataset record (or ``system_prompt`` / ``model``).

Counting every prompt's tokens would tokenize the whole dataset at start; a prompt is counted
only when a cheap upper bound on its tokens exceeds the context: a tokenizer gives at most one
token per UTF-8 byte of the text it reads, plus a few (a word-start marker, BOS/EOS), and a
chat template adds what it added to the first conversation plus a margin per message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .rollout import prompt_texts

if TYPE_CHECKING:
    from .config import TrainConfig

#: config attributes that hold a model's context length, read in this order
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
#: tokens a tokenizer may give a text beyond one per UTF-8 byte (a word-start marker, BOS/EOS)
TOKEN_SLACK = 8
#: bytes a chat template may add to a message beyond what it added to the first conversation
TEMPLATE_SLACK = 256


def check_prompts(config: TrainConfig, task, eval_problems: list) -> None:
    """Raise a one-line ``ValueError`` unless the chat template renders the first conversation
    (naming ``system_prompt`` when only the system message is refused) and no prompt is longer
    than the model's context (naming the dataset record, or ``task`` for a generated problem).

    A dataset's every record is checked (``DatasetTask.sources`` names them); a generated task's
    held-out problems stand for its prompts. Without a known context length (no field of
    :data:`CONTEXT_FIELDS` in the model's config) only the template is checked.
    """
    tokenizer, context, model = policy_tokenizer(config)
    field = "dataset" if hasattr(task, "sources") else "task"
    if field == "dataset":
        named = [(where, problem.prompt) for where, problem in zip(task.sources, task.problems, strict=True)]
    else:
        named = [(f"{task.name} held-out problem {i}", p.prompt) for i, p in enumerate(eval_problems, 1)]
    conversations = [(where, prompt) for where, prompt in named if not isinstance(prompt, str)]
    overhead = check_template(tokenizer, *conversations[0], config, model) if conversations else 0
    if context is None:
        return
    for where, prompt in named:
        if token_bound(prompt, overhead) <= context:
            continue
        count = token_count(tokenizer, prompt)
        if count > context:
            raise ValueError(
                f"{field}: {where}: the prompt is {count} tokens, longer than the context of {model} ({context} "
                "tokens); shorten or drop it"
            )


def policy_tokenizer(config: TrainConfig) -> tuple[object, int | None, str]:
    """The tokenizer, the context length (None when the config names none) and a name for the model."""
    if config.uses_embedded_model:
        from .tiny import TinyModelConfig, build_char_tokenizer

        return build_char_tokenizer(), TinyModelConfig().max_position_embeddings, "the embedded model"
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    model_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
    context = next(
        (value for name in CONTEXT_FIELDS if isinstance(value := getattr(model_config, name, None), int)),
        None,
    )
    return tokenizer, context, f"--model {config.model!r}"


def check_template(tokenizer, where: str, prompt: tuple, config: TrainConfig, model: str) -> int:
    """Render ``prompt`` (a conversation) with the chat template; return the bytes the template
    added to its contents. A template that raises is a ``ValueError`` naming ``system_prompt``
    when the same conversation without ``--system-prompt``'s message renders, else ``model``."""
    try:
        text = prompt_texts(tokenizer, [prompt])[0][0]
    except ValueError:  # no chat template at all: already a message naming model
        raise
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        with_system = config.system_prompt is not None and prompt[0] == ("system", config.system_prompt)
        if with_system and len(prompt) > 1 and renders(tokenizer, prompt[1:]):
            raise ValueError(
                f"system_prompt: the chat template of {model} refuses a system message ({reason}); "
                "drop --system-prompt, or write the instructions into the user message"
            ) from error
        raise ValueError(
            f"model: the chat template of {model} fails on the prompt of {where} ({reason})"
        ) from error
    return max(0, len(text.encode()) - content_bytes(prompt))


def renders(tokenizer, prompt: tuple) -> bool:
    """Whether the chat template renders ``prompt`` without raising."""
    try:
        prompt_texts(tokenizer, [prompt])
    except Exception:
        return False
    return True


def content_bytes(prompt: tuple) -> int:
    """UTF-8 bytes of a conversation's roles and contents."""
    return sum(len(role.encode()) + len(content.encode()) for role, content in prompt)


def token_bound(prompt: str | tuple, overhead: int) -> int:
    """An upper bound on ``prompt``'s tokens (see the module docstring), without tokenizing it."""
    if isinstance(prompt, str):
        return len(prompt.encode()) + TOKEN_SLACK
    return content_bytes(prompt) + overhead + TEMPLATE_SLACK * len(prompt) + TOKEN_SLACK


def token_count(tokenizer, prompt: str | tuple) -> int:
    """``prompt``'s tokens as the sampler encodes it (``rollout.encode_prompts``)."""
    texts, templated = prompt_texts(tokenizer, [prompt])
    return len(tokenizer(texts[0], add_special_tokens=not templated)["input_ids"])
