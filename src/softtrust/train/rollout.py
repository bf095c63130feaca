"""Rollouts: sample G completions per prompt, record behaviour log-probs, score rewards.

Generation is a plain KV-cache sampling loop (faster than ``model.generate`` for a tiny
model on CPU). The trainer's random draws are keyed by (seed, rollout index, global group
index) (``group_uniforms``): a rollout is the same whichever process samples which group,
so ``torchrun`` with P processes samples what one process does, and a resume needs no
sampler state. A reward is checked the same way in RL and in evaluation (``RewardScorer``).
Each sampled token's log-prob is recorded with the same temperature scaling the learner
uses, so a rollout's ``rollout_logprobs`` are the behaviour policy's own numbers.
Everything after a completion's first end-of-sequence token is masked; the end-of-sequence
token itself is a completion token.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from softtrust._shared_prompt import cache_argument
from softtrust.truncation import sample_truncated, truncated_log_softmax, truncates

from .problem import Problem
from .rewards import RewardScorer


@dataclass
class RolloutBatch:
    """Prompts x G completions, as the learner consumes them. Groups are consecutive rows.

    Attributes:
        input_ids: ``[B, P + T]`` left-padded prompt, then the completion (pad after EOS).
        attention_mask: ``[B, P + T]`` 1 on real prompt tokens and completion tokens.
        completion_mask: ``[B, T]`` 1 on completion tokens up to and including the first EOS
            (the tokens the loss reads; ``--mask-truncated`` zeroes a cut completion's row, while
            ``attention_mask`` keeps its tokens).
        rollout_logprobs: ``[B, T]`` log-probs of the sampled tokens under the generating
            weights and numerics, recorded at generation time.
        rewards: ``[B]`` float.
        policy_version: the learner step whose weights generated the batch.
        sampling: what dynamic sampling (``--filter-groups``, ``dapo.GroupFilter``) did to make
            this rollout (passes, groups drawn, dropped, filled); empty otherwise and in a slice.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    policy_version: int = 0
    completions: list[str] = field(default_factory=list)
    sampling: dict[str, int] = field(default_factory=dict)

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Rows ``[start, stop)`` (a mini-batch)."""
        return RolloutBatch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            completion_mask=self.completion_mask[start:stop],
            rollout_logprobs=self.rollout_logprobs[start:stop],
            rewards=self.rewards[start:stop],
            policy_version=self.policy_version,
            completions=self.completions[start:stop],
        )

    def tensors(self) -> dict:
        """The batch as plain tensors and ints (what a checkpoint stores)."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "completions"}
        state["completions"] = list(self.completions)
        return state

    @classmethod
    def from_tensors(cls, state: dict) -> RolloutBatch:
        return cls(**state)

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Rows of several batches (e.g. every rank's share of a mini-batch), in order.

        Prompts are re-padded on the left and completions on the right to the widest;
        padding holds token 0 under a zero mask, so it never reaches a log-prob.
        """
        if len(batches) == 1:
            return batches[0]
        prompt_width = max(b.input_ids.shape[1] - b.completion_length for b in batches)
        completion_width = max(b.completion_length for b in batches)

        def pad(tensor: torch.Tensor, left: int, right: int) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (left, right), value=0)

        pieces: dict[str, list[torch.Tensor]] = {
            name: [] for name in ("ids", "attention", "completion", "logprobs")
        }
        for b in batches:
            left = prompt_width - (b.input_ids.shape[1] - b.completion_length)
            right = completion_width - b.completion_length
            prompt_part = slice(0, b.input_ids.shape[1] - b.completion_length)
            completion_part = slice(b.input_ids.shape[1] - b.completion_length, None)
            pieces["ids"].append(
                torch.cat(
                    [
                        pad(b.input_ids[:, prompt_part], left, 0),
                        pad(b.input_ids[:, completion_part], 0, right),
                    ],
                    1,
                )
            )
            pieces["attention"].append(
                torch.cat(
                    [
                        pad(b.attention_mask[:, prompt_part], left, 0),
                        pad(b.attention_mask[:, completion_part], 0, right),
                    ],
                    1,
                )
            )
            pieces["completion"].append(pad(b.completion_mask, 0, right))
            pieces["logprobs"].append(pad(b.rollout_logprobs, 0, right))
        return cls(
            input_ids=torch.cat(pieces["ids"]),
            attention_mask=torch.cat(pieces["attention"]),
            completion_mask=torch.cat(pieces["completion"]),
            rollout_logprobs=torch.cat(pieces["logprobs"]),
            rewards=torch.cat([b.rewards for b in batches]),
            policy_version=batches[0].policy_version,
            completions=[text for b in batches for text in b.completions],
        )


def cache_argument_name(model) -> str:
    """``cache`` (transformers >= 5) or ``past_key_values`` (older), whichever forward takes."""
    if getattr(model, "wraps_causal_lm", False):  # distributed.PolicyForward: look inside
        model = model.model
    return cache_argument(model)


def _forward_parameters(model):
    if getattr(model, "wraps_causal_lm", False):  # distributed.PolicyForward: look inside
        model = model.model
    return inspect.signature(model.forward).parameters


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token. ``[B, L]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prompt_texts(tokenizer, prompts: Sequence) -> tuple[list[str], bool]:
    """The text fed to the model for each prompt, and whether it came from the chat template.

    A plain string is fed as it is. A conversation (``Problem.prompt`` as ``(role, content)``
    pairs) is rendered with the tokenizer's chat template and ``add_generation_prompt=True``
    (its special tokens are in the text, so it is tokenized without adding more). A tokenizer
    without a chat template is a ``ValueError`` naming ``model``.
    """
    conversations = [not isinstance(prompt, str) for prompt in prompts]
    if not any(conversations):
        return list(prompts), False
    if not all(conversations):
        raise ValueError("prompts: a batch mixes plain strings and conversations")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "model: the dataset holds conversations but the tokenizer has no chat template "
            "(set tokenizer.chat_template and save it with the model, or write the prompts as plain strings)"
        )
    texts = [
        tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in prompt],
            tokenize=False,
            add_generation_prompt=True,
        )
        for prompt in prompts
    ]
    return texts, True


def end_token_ids(tokenizer) -> list[int]:
    """Tokens that end a completion: the tokenizer's end of sequence and, with a chat template,
    the token that closes an assistant turn (found by rendering one: the first special token
    after the assistant's text, e.g. ``<|im_end|>``)."""
    ids = [tokenizer.eos_token_id]
    if getattr(tokenizer, "chat_template", None):
        marker = "softtrust-end-of-turn-probe"
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], tokenize=False
            )
        except Exception:  # a template that refuses this conversation: keep the EOS only
            text = ""
        tail = text.partition(marker)[2]
        special = set(tokenizer.all_special_ids)
        for token in tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []:
            if token in special:
                if token not in ids:
                    ids.append(token)
                break
    return ids


def encode_prompts(tokenizer, prompts: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, ``[B, P]`` each (``prompt_texts`` renders
    conversations with the chat template)."""
    texts, templated = prompt_texts(tokenizer, prompts)
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not templated)
    finally:
        tokenizer.padding_side = previous_side
    return encoded["input_ids"], encoded["attention_mask"]


@torch.no_grad()
def sample_completions(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float,
    dtype: torch.dtype | None = None,
    logit_noise: tuple[float, int] | None = None,
    uniforms: torch.Tensor | None = None,
    all_finished: Callable[[bool], bool] | None = None,
    group_size: int = 1,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample (or, at ``temperature == 0``, greedily decode) completions with a KV cache.

    Args:
        model: a Hugging Face causal LM (put in eval mode by the caller).
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        eos_token_id: the token, or tokens (``end_token_ids``), that end a completion.
        temperature: logits are divided by it before the softmax (the learner does the
            same); 0 means greedy, with log-probs taken at temperature 1.
        dtype: run the forward under ``torch.autocast`` in this dtype (a rollout engine
            whose numerics differ from the learner's); ``None`` keeps the model's own.
        logit_noise: ``(σ, seed)``: a perturbed sampler, ``ε ~ N(0, σ²)`` drawn once per
            vocabulary entry from ``seed`` and added to every logit before sampling, so the
            recorded log-probs are the perturbed policy's (``--mismatch logit-noise:σ``).
        uniforms: ``[B, max_new_tokens]`` float64 uniform draws in [0, 1), one per row and
            position (``group_uniforms``), required when sampling (``temperature > 0``): token
            ``t`` of row ``b`` is the inverse CDF of its distribution at ``uniforms[b, t]``, so
            each row's draw depends only on its own numbers, never on the batch it is sampled in.
        all_finished: given this process's "every row has ended", says whether every process
            has (FSDP2: all ranks must run the same number of forwards); default: this one.
        group_size: rows come in groups of this many copies of one prompt (a rollout's G):
            the prompt is prefilled once per group (checked; otherwise every row is prefilled).
        top_k, top_p: sample from the truncated policy (``softtrust.truncation``); the
            recorded log-probs are its renormalised ones, as the learner scores them.

    Returns:
        ``completion_ids [B, T]`` (pad after EOS), ``completion_mask [B, T]`` (up to and
        including the first EOS), ``logprobs [B, T]`` float32 of the chosen tokens (0 where masked).
    """
    batch_size = prompt_ids.shape[0]
    if temperature > 0 and uniforms is None:
        raise ValueError("uniforms: sampling (temperature > 0) needs its uniform draws (group_uniforms)")
    cache_name = cache_argument_name(model)
    device = next(model.parameters()).device
    attention_mask = prompt_mask.to(device)
    step_input = prompt_ids.to(device)
    position_ids = position_ids_from_mask(attention_mask)
    cache = None
    # Only the last position's logits are used: the prefill skips the LM head everywhere else
    # (for a 49k vocabulary it is most of the prefill's cost).
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(model) else {}
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    stop = torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device
    )
    tokens, masks, logprobs, noise = [], [], [], None
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    # G completions of one prompt are consecutive rows with the same prompt: the prefill runs
    # once per prompt and its KV cache is repeated G times (G x less prefill compute).
    shared = group_size > 1 and batch_size % group_size == 0 and all_finished is None
    shared = shared and torch.equal(step_input, step_input[::group_size].repeat_interleave(group_size, 0))
    for position in range(max_new_tokens):
        prefill_shared = shared and position == 0
        rows = slice(None, None, group_size) if prefill_shared else slice(None)
        with autocast:
            output = model(
                input_ids=step_input[rows],
                attention_mask=attention_mask[rows],
                position_ids=position_ids[rows],
                use_cache=True,
                **{cache_name: cache},
                **last_only,
            )
        cache = getattr(output, cache_name)
        logits = output.logits[:, -1, :].float()  # [B, V]
        if prefill_shared:
            cache.batch_repeat_interleave(group_size)
            logits = logits.repeat_interleave(group_size, 0)
        if logit_noise is not None:  # the same [V] draw at every position and call: one perturbed sampler
            if noise is None:
                generator = torch.Generator().manual_seed(logit_noise[1])
                noise = (logit_noise[0] * torch.randn(logits.shape[-1], generator=generator)).to(logits)
            logits = logits + noise
        uniform = None if temperature == 0 else uniforms[:, position].to(device)
        token, log_probs = next_token(logits, temperature, top_k, top_p, uniform)  # [B], [B, V]
        active = ~finished
        token = torch.where(active, token, torch.full_like(token, pad_token_id))
        chosen = log_probs.gather(1, token.unsqueeze(1)).squeeze(1)  # [B]
        tokens.append(token)
        masks.append(active)
        # Masked positions hold 0, never the (possibly -inf) log-prob of a pad token.
        logprobs.append(torch.where(active, chosen, torch.zeros_like(chosen)))
        finished = finished | torch.isin(token, stop)
        done = bool(finished.all())
        if all_finished(done) if all_finished is not None else done:
            break
        attention_mask = torch.cat([attention_mask, active.long().unsqueeze(1)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        step_input = token.unsqueeze(1)
    return (
        torch.stack(tokens, 1).cpu(),
        torch.stack(masks, 1).long().cpu(),
        torch.stack(logprobs, 1).cpu(),
    )


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    uniform: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: the ``[B]`` tokens chosen from ``[B, V]`` float32 ``logits`` and the
    ``[B, V]`` log-probs they were drawn from (the truncated, renormalised policy under
    ``top_k``/``top_p``). ``temperature > 0``: the inverse CDF at ``uniform`` (``[B]``);
    0: greedy, with log-probs at temperature 1."""
    if temperature > 0 and truncates(top_k, top_p, logits.shape[-1]):
        log_probs = truncated_log_softmax(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        token, _ = sample_truncated(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform
        )
        return token, log_probs
    if temperature > 0:
        log_probs = torch.log_softmax(logits / temperature, dim=-1)  # [B, V]
        return inverse_cdf_sample(log_probs, uniform), log_probs
    return logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1)


def inverse_cdf_sample(log_probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverting its CDF at a given uniform draw.

    Args:
        log_probs: ``[B, V]`` log-probabilities.
        uniform: ``[B]`` draws in [0, 1).

    Returns:
        ``[B]`` token ids: the first ``v`` with ``cdf[v] > u``. The CDF is summed in float32
        (float64 doubled the cost per token for a change below 1e-6 in each token's probability)
        and the index clamped to ``V - 1`` (rounding can leave ``cdf[-1]`` a hair under 1).
    """
    cdf = log_probs.float().exp().cumsum(dim=-1)  # [B, V]
    token = (cdf <= uniform.to(cdf.dtype).unsqueeze(1)).sum(dim=-1)  # [B]
    return token.clamp(max=log_probs.shape[-1] - 1)


def group_seed(seed: int, rollout_index: int, group_index: int) -> int:
    """A 63-bit seed for one group's sampling stream, from (run seed, rollout, global group).

    Keyed by the group's place in the global batch, never by the process that samples it,
    so P processes draw the same completions as one.
    """
    digest = hashlib.blake2b(f"{seed}:{rollout_index}:{group_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def group_uniforms(
    seed: int, rollout_index: int, group_indices: Sequence[int], group_size: int, max_new_tokens: int
) -> torch.Tensor:
    """``[len(group_indices) x G, max_new_tokens]`` float64 uniforms, rows grouped as in a rollout."""
    draws = [
        torch.rand(
            group_size,
            max_new_tokens,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(group_seed(seed, rollout_index, group)),
        )
        for group in group_indices
    ]
    return torch.cat(draws) if draws else torch.zeros(0, max_new_tokens, dtype=torch.float64)


class ProblemSampler:
    """Draws training problems from a task with its own seeded ``random.Random``.

    Problems in the held-out set are skipped, so evaluation stays unseen (``tasks.check_training_pool``
    makes sure some problem is left to draw).
    """

    def __init__(self, task, seed: int, exclude: Sequence[Problem] = ()):
        self.task = task
        self.rng = random.Random(seed)
        self.excluded = {problem.prompt for problem in exclude}

    def draw(self, count: int) -> list[Problem]:
        problems = []
        while len(problems) < count:
            problem = self.task.sample(self.rng)
            if problem.prompt not in self.excluded:
                problems.append(problem)
        return problems


def sampled_lengths(batch: RolloutBatch) -> torch.Tensor:
    """``[B]`` tokens sampled per completion, its end token included: the attention mask over the
    completion (the completion mask, unless ``--mask-truncated`` zeroed it)."""
    return batch.attention_mask[:, -batch.completion_length :].sum(dim=1)  # [B]


def truncated_rows(batch: RolloutBatch, end_ids: Sequence[int], max_new_tokens: int) -> torch.Tensor:
    """``[B]`` bool: the completions cut at ``max_new_tokens``, as long as the limit without an end
    token (``end_token_ids``) among their sampled tokens. The sampler stops a row only at an end
    token, so these are the rows it stopped at the limit."""
    if batch.completion_length < max_new_tokens:  # every completion ended before the limit
        return torch.zeros(batch.input_ids.shape[0], dtype=torch.bool)
    sampled = batch.attention_mask[:, -batch.completion_length :].bool()  # [B, T]
    ids = batch.input_ids[:, -batch.completion_length :]  # [B, T]
    ended = (torch.isin(ids, torch.tensor(list(end_ids), dtype=ids.dtype)) & sampled).any(dim=1)  # [B]
    return (sampled_lengths(batch) == max_new_tokens) & ~ended


def cut_fraction(batch: RolloutBatch, end_ids: Sequence[int], max_new_tokens: int) -> float:
    """The share of ``batch``'s completions cut at ``max_new_tokens`` (``truncated_rows``). A cut
    completion rarely holds a whole answer, so it usually scores 0: when most are cut, reward and
    gradient vanish."""
    if batch.input_ids.shape[0] == 0:
        return 0.0
    return float(truncated_rows(batch, end_ids, max_new_tokens).float().mean())


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Completion text up to (not including) the first end token, without special tokens."""
    texts, ends = [], set(end_token_ids(tokenizer))
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist(), strict=True):
        kept = [t for t, m in zip(ids, mask, strict=True) if m and t not in ends]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts


def completion_token_ids(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[list[int]]:
    """Each completion's token ids up to and including its end token (the padding cut off): what a
    TRL-style batched reward receives as ``completion_ids``, the same in RL and in evaluation."""
    return [
        ids[: int(mask.sum())] for ids, mask in zip(completion_ids.tolist(), completion_mask, strict=True)
    ]


def generate_rollout(
    model,
    tokenizer,
    problems: Sequence[Problem],
    scorer: RewardScorer,
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    policy_version: int = 0,
    dtype: torch.dtype | None = None,
    logit_noise: tuple[float, int] | None = None,
    uniforms: torch.Tensor | None = None,
    all_finished: Callable[[bool], bool] | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> RolloutBatch:
    """G sampled completions per problem (consecutive rows), scored by ``scorer``.

    The random draws come from ``uniforms`` (``group_uniforms``, keyed by each group's global index).
    """
    repeated = [problem for problem in problems for _ in range(group_size)]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [problem.prompt for problem in repeated])
    was_training = model.training
    model.eval()
    completion_ids, completion_mask, logprobs = sample_completions(
        model,
        prompt_ids,
        prompt_mask,
        eos_token_id=end_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        dtype=dtype,
        logit_noise=logit_noise,
        uniforms=uniforms,
        all_finished=all_finished,
        group_size=group_size,
        top_k=top_k,
        top_p=top_p,
    )
    model.train(was_training)
    completions = decode_completions(tokenizer, completion_ids, completion_mask)
    rewards, _, _ = scorer.score(repeated, completions, completion_token_ids(completion_ids, completion_mask))
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        rollout_logprobs=logprobs,
        rewards=rewards,
        policy_version=policy_version,
        completions=completions,
    )


class Evaluation(NamedTuple):
    """Held-out greedy results: ``accuracy``, the share of problems whose correctness reward is
    >= 1, and ``score``, that reward's mean (a failing or ``None`` value counts 0): a reward with
    partial credit (a reasoning-gym verifier) moves the score before the accuracy."""

    accuracy: float
    score: float


def greedy_accuracy(
    model, tokenizer, task, problems: Sequence[Problem], max_new_tokens: int, **options
) -> float:
    """``greedy_evaluation``'s accuracy alone."""
    return greedy_evaluation(model, tokenizer, task, problems, max_new_tokens, **options).accuracy


@torch.no_grad()
def greedy_evaluation(
    model,
    tokenizer,
    task,
    problems: Sequence[Problem],
    max_new_tokens: int,
    batch_size: int = 256,
    all_finished: Callable[[bool], bool] | None = None,
    strict: bool = False,
    samples: list | None = None,
    num_samples: int = 4,
) -> Evaluation:
    """Accuracy and mean correctness reward of ``problems``' greedy completions (``Evaluation``),
    scored as in RL (``RewardScorer``): a failing or invalid reward counts as wrong and scores 0
    (``strict``: raises).

    ``samples``: a list that receives the first ``num_samples`` problems' prompt as fed to the
    model, completion and rewards (what ``samples.jsonl`` records)."""
    scorer = RewardScorer(task, strict=strict)
    was_training = model.training
    model.eval()
    correct, score = 0, 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [problem.prompt for problem in chunk])
        completion_ids, completion_mask, _ = sample_completions(
            model,
            prompt_ids,
            prompt_mask,
            eos_token_id=end_token_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            all_finished=all_finished,
        )
        texts = decode_completions(tokenizer, completion_ids, completion_mask)
        totals, right, parts = scorer.score(
            chunk, texts, completion_token_ids(completion_ids, completion_mask)
        )
        correct += sum(right)
        score += sum(value or 0.0 for value in parts[scorer.rewards.correctness_name])
        if samples is not None:
            for index in range(min(len(chunk), num_samples - len(samples))):
                samples.append(
                    {
                        "prompt": prompt_texts(tokenizer, [chunk[index].prompt])[0][0],
                        "completion": texts[index],
                        "answer": chunk[index].answer,
                        "reward": float(totals[index]),
                        "rewards": {name: values[index] for name, values in parts.items()},
                        "correct": right[index],
                    }
                )
    model.train(was_training)
    return Evaluation(correct / max(len(problems), 1), score / max(len(problems), 1))
