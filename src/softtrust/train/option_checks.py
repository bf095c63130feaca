"""Checks of options beyond a field's declared type and range (``values.check_field_value``):
the directories a run will create, ``--reward`` specs, the size of a rollout and
``--overlong-penalty`` against ``--max-new-tokens``.

``TrainConfig.validate`` calls them before any work, and the sweep checks its own directory with
``check_directory_option``; each raises ``ValueError`` naming the option. The upper bounds of the
sizes that take memory live here too (``config`` declares them on its fields, the sweep reads
``MAX_SEED`` and ``MAX_SEEDS``), so the limits are stated once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig

# Upper bounds of sizes that take memory or threads (each said in its option's --help).
MAX_SEED = 2**32 - 1  # a seed of torch, random and numpy alike
MAX_NEW_TOKENS = 32_768  # the draws alone are [rows, max_new_tokens] float64
MAX_THREADS = 1024  # torch creates them all at once
MAX_ROLLOUT_ROWS = 2**20  # completions in one rollout: N x m x G (sync), (K + 1) x m x G (async)
MAX_SFT_BATCH = 65_536  # warm-start problems per step
MAX_EVAL_SIZE = 65_536  # held-out problems (drawn, then evaluated greedily at every evaluation)
MAX_SEEDS = 1000  # seeds of one sweep (--seeds S)

_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_directory_option(path: str | Path, name: str) -> None:
    """``path`` is a directory, or can become one: its nearest existing ancestor is a directory
    this process may write into. Refuses a file (``/dev/null``), a path under a file and a
    read-only parent, naming ``name`` (``output_dir``, ``cache_dir``), before anything is created."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{name}: {str(path)!r} exists and is not a directory (a file or a device)")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(
            f"{name}: {str(path)!r} lies under {str(ancestor)!r}, which is a file, not a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot create {str(path)!r}: {str(ancestor)!r} is not writable")


def check_reward_spec(spec: str | None) -> None:
    """Each ``module:function`` of ``--reward`` names an absolute module and a function
    (``.rel:f``, ``:f`` and ``mod:`` cannot be imported); the names without ``:`` (built-in rewards,
    a task's own) are checked when the task loads them."""
    for part in (part.strip() for part in (spec or "").split(",")):
        module, colon, function = part.partition(":")
        if colon and not (_DOTTED_NAME.fullmatch(module) and function.isidentifier()):
            raise ValueError(
                f"reward: {part!r} is not module:function with a module's full dotted name and a function's "
                "name (a relative or empty module cannot be imported; put the module's directory on "
                f"PYTHONPATH and name it in full, e.g. 'my_rewards:score') (got {spec!r})"
            )


def check_rollout_size(config: TrainConfig) -> None:
    """The completions one rollout holds, ``staleness x prompts_per_step x group_size`` in sync
    mode (``(max_lag + 1) x ...`` in async mode, the rollouts in flight), at most
    ``MAX_ROLLOUT_ROWS``: beyond it the rollout's tensors would not fit in memory."""
    if config.mode == "sync":
        factor, names = config.staleness, ("staleness", "N")
    else:
        factor, names = config.max_lag + 1, ("max_lag", "(K + 1)")
    rows = factor * config.prompts_per_step * config.group_size
    if rows > MAX_ROLLOUT_ROWS:
        raise ValueError(
            f"{names[0]}, prompts_per_step, group_size: a rollout of {names[1]} x m x G = {factor} x "
            f"{config.prompts_per_step} x {config.group_size} = {rows} completions is more than the most, "
            f"2^20 = {MAX_ROLLOUT_ROWS}; lower them"
        )


def check_options(config: TrainConfig) -> None:
    """The checks of this module on ``config``: its ``output_dir`` and ``cache_dir`` (when given),
    its ``reward`` and its rollout's size."""
    for name in ("output_dir", "cache_dir"):
        if getattr(config, name) is not None:
            check_directory_option(getattr(config, name), name)
    check_reward_spec(config.reward)
    check_rollout_size(config)


def check_overlong_penalty(config: TrainConfig) -> None:
    """``--overlong-penalty L_cache,penalty``: two numbers, ``L_cache`` a whole number of tokens
    in ``[1, --max-new-tokens]`` (verl asserts both bounds), ``penalty > 0``."""
    values = config.overlong_penalty
    if not values:
        return
    limit = config.effective_max_new_tokens
    cache_ok = len(values) == 2 and float(values[0]).is_integer() and 1 <= values[0] <= limit
    if not (cache_ok and values[1] > 0):
        raise ValueError(
            f"overlong_penalty: expected L_cache,penalty with L_cache a whole number of tokens in "
            f"[1, --max-new-tokens = {limit}] and penalty > 0 (got {values!r})"
        )
