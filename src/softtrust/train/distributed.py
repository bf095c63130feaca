"""Data-parallel training on PyTorch's own distributed engine (``torchrun``, DDP, FSDP2).

``softtrust train`` runs as one process, or as ``P`` processes under ``torchrun``
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set). This module
holds all of the machinery, so that the loop in ``trainer.py`` reads the same either way:

- ``World``: this process's rank, the world size and device, with collectives that are
  no-ops in a single process (``sum``, ``gather``, ``all_true``, ``broadcast``, ...).
- The data layout: a rollout's groups of ``G`` completions are never split across ranks.
  Mini-batch ``k`` of a rollout holds the global groups ``[k m, (k + 1) m)``; rank ``r``
  owns the consecutive ``m / P`` of them starting at ``k m + r m / P``
  (``World.local_groups``). Rewards are gathered in global order, so advantages (even
  ``--advantage-scale batch``) are those of the whole rollout.
- ``PolicyForward``: the one module DDP or FSDP2 wraps. Both the learner's log-probs and,
  under FSDP2, every generation step go through its ``forward``, so the wrapper's hooks
  (gradient all-reduce, parameter all-gather) always run.
- Checkpoint helpers: the full (unsharded) model and optimizer state, identical in
  layout to a single process's, so a run resumes with any number of processes.

Gradient convention: every rank's loss uses the **global** normalisers (``num_tokens``,
``num_sequences``, summed over ranks), so the sum over ranks of the local losses is the
loss of the whole mini-batch. DDP and FSDP2 *average* gradients over ranks, so each rank's
loss is multiplied by the world size ``P`` before ``backward``: the averaged gradient is
then exactly the gradient of the whole mini-batch's loss, as in one process.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from softtrust._metrics import reduction_of

from .scoring import UNTRUNCATED, Scoring, completion_logprobs_of


@dataclass
class World:
    """This process's place among ``size`` data-parallel processes (``size == 1``: alone).

    Attributes:
        rank: global rank (0 writes logs and checkpoints).
        size: world size ``P``.
        local_rank: rank on this machine (picks the GPU under NCCL).
        device: where the learner runs: ``cuda:LOCAL_RANK`` under NCCL, else the CPU.
        fsdp: the model is sharded with FSDP2 (``--fsdp``).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp: bool = False

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes the run directory."""
        return self.rank == 0

    # ------------------------------------------------------------------ data layout
    def local_groups(self, num_groups: int, groups_per_step: int, rank: int | None = None) -> list[int]:
        """The global group indices this rank (or ``rank``) owns in a rollout of ``num_groups`` groups.

        Mini-batch ``k`` holds groups ``[k m, (k + 1) m)`` (``m = groups_per_step``); this
        rank takes ``m / P`` consecutive ones of each, so its local mini-batch ``k`` is
        rows ``[k m/P G, (k + 1) m/P G)`` of its local rollout.
        """
        share = groups_per_step // self.size
        rank = self.rank if rank is None else rank
        return [
            start + rank * share + offset
            for start in range(0, num_groups, groups_per_step)
            for offset in range(share)
        ]

    def check_divides(self, prompts_per_step: int) -> None:
        """Groups are never split: ``m`` must be a multiple of the world size."""
        if prompts_per_step % self.size:
            raise ValueError(
                f"prompts_per_step: m must be a multiple of the number of processes ({self.size}) "
                f"so that every rank gets whole groups (got {prompts_per_step})"
            )

    # ------------------------------------------------------------------ collectives
    def sum(self, value: float | torch.Tensor) -> float:
        """Sum of a number over ranks (float64 on the wire)."""
        if not self.distributed:
            return float(value)
        tensor = torch.tensor(float(value), dtype=torch.float64, device=self._wire)
        dist.all_reduce(tensor)
        return float(tensor)

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (everyone skips or everyone updates)."""
        if not self.distributed:
            return bool(flag)
        tensor = torch.tensor(int(bool(flag)), device=self._wire)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return bool(tensor)

    def gather_rows(self, local: torch.Tensor, global_rows: Sequence[int], total: int) -> torch.Tensor:
        """Assemble per-rank rows into one ``[total, ...]`` tensor in global row order.

        Args:
            local: ``[b, ...]`` this rank's rows (every rank has the same ``b``).
            global_rows: ``[b]`` each local row's global index (this rank's layout).
            total: the number of global rows (``b P``).
        """
        if not self.distributed:
            return local
        index = torch.as_tensor(list(global_rows), dtype=torch.long)
        pieces = self.gather_objects((index, local.detach().cpu()))
        result = torch.empty((total, *local.shape[1:]), dtype=local.dtype)
        for rank_index, rank_rows in pieces:
            result[rank_index] = rank_rows
        return result

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj, source: int = 0):
        """Rank ``source``'s ``obj`` (picklable) on every rank."""
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=source)
        return holder[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def reduce_metrics(self, metrics: dict, weight: float = 1.0) -> dict:
        """Metrics of the whole mini-batch from each rank's: ``.../max`` by max, ``.../min`` by
        min, everything else (means, fractions, ESS) by the ``weight``-weighted mean over
        ranks (pass the local token count)."""
        if not self.distributed:
            return metrics
        names = sorted(name for name, value in metrics.items() if isinstance(value, (int, float)))
        ops = {name: reduction_of(name) for name in names}
        values = torch.tensor(
            [metrics[name] * (weight if ops[name] == "mean" else 1.0) for name in names] + [weight],
            dtype=torch.float64,
            device=self._wire,
        )
        summed, maxed, minned = values.clone(), values.clone(), values.clone()
        dist.all_reduce(summed)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        dist.all_reduce(minned, op=dist.ReduceOp.MIN)
        total_weight = float(summed[-1]) or 1.0
        reduced = dict(metrics)
        for position, name in enumerate(names):
            op = ops[name]
            if op == "max":
                reduced[name] = float(maxed[position])
            elif op == "min":
                reduced[name] = float(minned[position])
            else:
                reduced[name] = float(summed[position]) / total_weight
        return reduced

    @property
    def _wire(self) -> torch.device:
        """Collectives run on the GPU under NCCL, on the CPU under gloo."""
        return self.device


# ---------------------------------------------------------------------- start and stop
def init_world(fsdp: bool = False, device: torch.device | str = "cpu") -> World:
    """Join the process group that ``torchrun`` describes, or return a single-process world.

    ``WORLD_SIZE`` > 1 (set by ``torchrun``): NCCL with ``cuda:LOCAL_RANK`` when CUDA is
    available, else gloo on the CPU. Otherwise one process on ``device`` (FSDP2 is
    refused: there is nothing to shard over).
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        if fsdp:
            raise ValueError(
                "fsdp: FSDP2 shards over several processes; launch with torchrun --nproc_per_node P"
            )
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # kernels that launch on the current device (Triton) use it
        return World(device=device)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return World(rank=rank, size=size, local_rank=local_rank, device=device, fsdp=fsdp)


def close_world(world: World, wait: bool = True) -> None:
    """Leave the process group; with ``wait``, after a barrier (rank 0 finishes writing first)."""
    if world.distributed and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------- wrapping the model
class PolicyForward(torch.nn.Module):
    """The module that DDP or FSDP2 wraps around a causal LM.

    ``forward(input_ids, attention_mask, completion_length=K)`` returns the learner's
    ``[B, K]`` completion log-probs (``scoring.completion_logprobs_of``); without
    ``completion_length`` it is the causal LM's own forward (a generation step).
    """

    wraps_causal_lm = True  # rollout.cache_argument_name looks inside

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_length: int | None = None,
        scoring: Scoring = UNTRUNCATED,
        with_entropy: bool = False,
        **step_kwargs,
    ):
        if completion_length is not None:
            return completion_logprobs_of(
                self.model, input_ids, attention_mask, completion_length, scoring, with_entropy
            )
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **step_kwargs)


def wrap_policy(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """The learner's forward module: ``PolicyForward(model)`` under DDP or FSDP2 when
    distributed; in one process, ``model`` itself.

    DDP keeps a full replica per rank and all-reduces (averages) gradients. FSDP2
    (``fully_shard``) shards each decoder layer (the classes the model names in
    ``_no_split_modules``), then the rest at the root; the parameters of ``model`` become
    ``DTensor`` shards, so build the optimizer after this call.
    """
    model.to(world.device)
    if not world.distributed:
        return (
            model  # one process: the causal LM itself (``scoring.completion_logprobs_of`` calls it plainly)
        )
    policy = PolicyForward(model)
    if world.fsdp:
        from torch.distributed.fsdp import fully_shard

        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module)
        fully_shard(policy)
        return policy
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [world.local_rank] if world.device.type == "cuda" else None
    return DistributedDataParallel(policy, device_ids=device_ids)


def generation_model(policy: torch.nn.Module, model: torch.nn.Module, world: World) -> torch.nn.Module:
    """What samples rollouts: the plain model (a full replica), or under FSDP2 the sharded
    ``PolicyForward``, whose forward gathers the parameters (every rank must call it)."""
    return policy if world.fsdp else model


def save_kept_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names ``safetensors.save_model`` writes (tied weights once). Call
    before sharding; FSDP2 checkpoints write the same names, so every checkpoint has one layout."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    removed = {name for group in _remove_duplicate_names(state).values() for name in group}
    return sorted(set(state) - removed)


def pretrained_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names ``save_pretrained`` writes: of each group of tied (shared)
    weights, the one that is not a tied target (``_tied_weights_keys``). Call before sharding."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    tied = getattr(model, "_tied_weights_keys", None) or ()
    targets = set(tied.keys() if isinstance(tied, dict) else tied)
    dropped = set()
    for kept, removed in _remove_duplicate_names(state).items():
        group = [kept, *removed]
        keep = next((name for name in group if name not in targets), kept)
        dropped.update(name for name in group if name != keep)
    return sorted(set(state) - dropped)


def full_model_state(policy: torch.nn.Module, world: World) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on the CPU (FSDP2: gathered; every rank must call this).
    Names are the causal LM's own (no wrapper prefix)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(policy, options=options)
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


def load_full_model_state(policy: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) causal-LM state dict into a sharded ``PolicyForward``;
    a tied weight missing from the file is taken from its twin."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    wanted = {name.removeprefix("model.") for name in policy.state_dict()}
    inner = policy.model
    full = dict(state)
    for name in wanted - set(full):
        twin = _tied_twin(inner, name, full)
        if twin is not None:
            full[name] = full[twin]
    prefixed = {f"model.{name}": tensor for name, tensor in full.items()}
    set_model_state_dict(policy, prefixed, options=StateDictOptions(full_state_dict=True, strict=False))


def _tied_twin(model: torch.nn.Module, name: str, state: dict) -> str | None:
    """The name in ``state`` of the parameter that ``name`` shares storage with (tied weights)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    if name not in named:
        return None
    for other, parameter in named.items():
        if other != name and other in state and parameter is named[name]:
            return other
    return None


def parameter_names(policy: torch.nn.Module) -> list[str]:
    """The optimizer's parameter order as causal-LM names (what ``model.parameters()`` yields)."""
    return [name.removeprefix("model.") for name, _ in policy.named_parameters()]


def full_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> dict:
    """The optimizer state of the whole model in ``optimizer.state_dict()``'s own layout
    (keyed by parameter position), gathered under FSDP2; every rank must call this."""
    if not world.fsdp:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    by_name = get_optimizer_state_dict(policy, optimizer, options=options)
    if not world.is_main:
        return {}
    names = [f"model.{name}" for name in parameter_names(policy)]
    position = {name: index for index, name in enumerate(names)}
    groups = []
    for group in by_name["param_groups"]:
        groups.append({**group, "params": [position[name] for name in group["params"]]})
    return {
        "state": {position[name]: value for name, value in by_name["state"].items()},
        "param_groups": groups,
    }


def load_full_optimizer_state(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, world: World
) -> None:
    """Load an ``optimizer.state_dict()``-layout state (from any world size) into ``optimizer``."""
    if not world.fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [f"model.{name}" for name in parameter_names(policy)]
    by_name = {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(index)] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(
        policy, optimizer, by_name, options=StateDictOptions(full_state_dict=True, strict=False)
    )


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a ``DTensor`` (FSDP2's gradient norm), else ``value`` itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
