"""The study's predefined grids (``softtrust sweep --preset NAME``) and their shared settings."""

from __future__ import annotations

# The first setup (short completions): 3-digit addition (`aaa+bbb=` -> 4 digits + eos), the
# embedded 801,280-parameter Qwen2, G = 8, m = 32, AdamW 3e-4 (the trainer's defaults), 128
# optimizer steps for every N, and a warm start of 620 supervised steps, which puts seed 0 at
# 22 % held-out accuracy (the supervised curve is steep there: 550 steps give 7 %, 680 give 45 %).
# 256 held-out problems (standard error of one evaluation at most 0.031). Kept as
# `--preset addition` and for the learning-rate view, whose documented results used it.
ADDITION_SETUP = {"max_steps": 128, "sft_steps": 620, "sft_target_accuracy": None, "eval_size": 256}

# The study's default setup (long completions): 3-digit addition with a written carry
# scratchpad (`123+459=` -> `3+9=12,2+5+1=8,1+4=5|0582`, ~26 tokens + eos; only the answer
# after `|` is graded), every seed warm-started to 30 % validation accuracy, 256 optimizer
# steps for every N (N = 64 is 4 rollouts), AdamW lr 1e-4 (at 3e-4 the first Adam step alone
# moves the sampled sequences by ~6 nats of log-probability, and VESPO's weights vanish at
# N = 64 before any staleness question arises), 2,000 held-out problems evaluated every 16
# steps (standard error of one evaluation at most 0.011).
STUDY_SETUP = {
    "task": "scratchpad",
    "max_new_tokens": 40,
    "lr": 1e-4,
    "max_steps": 256,
    "sft_steps": 3000,
    "sft_target_accuracy": 0.3,
    "eval_size": 2000,
    "eval_every": 16,
}

# The real-model pilot (issue 34): SmolLM2-135M-Instruct on the recipe's task (examples/
# smollm2_addition.yaml: "What is a + b?", a, b < 30, 300 held out, the `math` reward), no
# supervised warm start (the pretrained model starts at 30 % held-out), the recipe's G = 8 x m = 8,
# 32 new tokens and lr 5e-6, but 24 optimizer steps instead of 30 (at N = 8 that is three whole
# rollouts) and an evaluation every 8 steps (at each rollout's end). The model and dataset are
# the user's files: `--model` and `--dataset` are required (examples/real_model.py pilot fills them).
PILOT_SETUP = {
    "reward": "math",
    "group_size": 8,
    "prompts_per_step": 8,
    "max_new_tokens": 32,
    "temperature": 1.0,
    "lr": 5e-6,
    "max_steps": 24,
    "sft_steps": 0,
    "sft_target_accuracy": None,
    "eval_size": 300,
    "eval_every": 8,
}

REGISTERED_SEEDS = tuple(range(5, 15))  # the confirmation study's fresh seeds (docs/preregistration.md)
CONFIRM_SEEDS = ",".join(map(str, REGISTERED_SEEDS))  # the same, as a --seeds list

PRESETS = {
    # The paper's comparison (its Table 2: GRPO-style clip, GSPO, SAPO, VESPO) at N = 4, 16
    # and 64: 60 cells of 256 steps, 9-15 min a cell on one core (measured), so ~6.5 h on 2 cores
    # (resumable). CISPO, PSPO and the on-policy N = 1 are one flag away
    # (--methods ...,cispo,pspo --staleness 1,4,16,64: 120 cells).
    "full": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,16,64",
        "seeds": "5",
        "overrides": STUDY_SETUP,
    },
    # The paper's central contrast, clipping against VESPO, at its two extremes of staleness,
    # seed 0, 128 steps: the first half of 4 runs of the full study (every other setting is
    # the same, and nothing before step 128 depends on the step budget), 16 min 12 s
    # on 2 CPU cores with --jobs 2, from an empty warm-start cache (measured).
    "quick": {
        "methods": "clip,vespo",
        "staleness": "4,64",
        "seeds": "0,",
        "overrides": {**STUDY_SETUP, "max_steps": 128},
    },
    # The first, short-completion setup (docs/results.md, "Short completions").
    "addition": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,16,64",
        "seeds": "1",
        "overrides": ADDITION_SETUP,
    },
    # The learning-rate view: the largest stable lr of each method at N = 1 (on-policy: the lr
    # effect alone), 16 and 64, from a short sweep (64 steps; at N = 64 that is one rollout)
    # on the short-completion setup. 48 cells, about 25 minutes on 2 CPU cores with --jobs 2.
    "lr-stability": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "1,16,64",
        "seeds": "1",
        "lrs": [3e-4, 6e-4, 1e-3, 2e-3],
        "overrides": {**ADDITION_SETUP, "max_steps": 64},
    },
    # The learning-rate view on the long-completion setup: N = 4 against N = 64 (64 steps: at
    # N = 64 one rollout from the warm start, the purest staleness test), lr from the study's
    # 1e-4 up to 6e-4, 500 held-out problems (standard error at most 0.022, well inside the
    # collapse criterion's 0.10). 32 cells: 55 min on 2 cores with --jobs 2 (measured; docs/results.md).
    "lr-stability-long": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,64",
        "seeds": "1",
        "lrs": [1e-4, 2e-4, 3e-4, 6e-4],
        "overrides": {**STUDY_SETUP, "max_steps": 64, "eval_size": 500},
    },
    # The paper's VESPO ablations: length normalisation (sequence-mean level) and symmetric kernels.
    "vespo-ablations": {
        "methods": "vespo,vespo[level=sequence-mean],vespo[k_neg=2,lambda_neg=3],vespo[k_pos=3,lambda_pos=2]",
        "staleness": "4,16,64",
        "seeds": "3",
        "overrides": STUDY_SETUP,
    },
    # ---- issue 24's runs: every cell records its code (summary.json "provenance"), so they are
    # not paired with the old runs above. Wall times are estimates from the full study's
    # measured 6.7 min a cell with --jobs 2 (9-14.5 min alone on one core); measure and state
    # the real figures. Run each in its own directory (docs/results.md, "What the next runs are").
    # The headline and its controls: clip, VESPO, REINFORCE (no trust region, no weight: the
    # control for "a trust region helps") and clip with the paper's eps_high = 0.28 (DAPO's, the
    # paper's GRPO baseline), N = 4 and 64, 5 seeds. 40 cells, ~4.5 h on 2 cores.
    "controls": {
        "methods": "clip,vespo,reinforce,clip[eps_high=0.28]",
        "staleness": "4,64",
        "seeds": "5",
        "overrides": STUDY_SETUP,
    },
    # The on-policy ceiling: N = 1, where every method is the same algorithm (ratio 1, phi 1;
    # tests/test_sweep.py), so one cell per seed serves every method. 5 cells, ~35 min.
    "ceiling": {
        "methods": "clip",
        "staleness": "1",
        "seeds": "5",
        "overrides": STUDY_SETUP,
    },
    # The head-to-head: M2PO and DPPO, which claim staleness robustness of their own, against
    # the same clip and VESPO cells (run it in the controls' directory: those cells are skipped).
    # 20 new cells, ~2.2 h; --staleness 4,64,256 adds N = 256 for the four (~+2.5 h).
    "head-to-head": {
        "methods": "clip,vespo,m2po,dppo",
        "staleness": "4,64",
        "seeds": "5",
        "overrides": STUDY_SETUP,
    },
    # Asynchronous training: the concurrent rollout worker lagging by at most K in {1, 16},
    # one cell at a time (jobs 1: the worker's thread and the learner share the two cores, and
    # throughput must not be confounded by a second cell). Measured: 4.1-5.1 min a cell alone.
    # First run with 3 seeds (the budget), extended to 5 when clip's fall at K = 16 came
    # out the study's largest among methods with a trust region: 30 cells, 2.2 h of cell time.
    "async": {
        "methods": "clip,vespo,m2po",
        "staleness": "1,16",
        "seeds": "5",
        "jobs": 1,
        "overrides": {**STUDY_SETUP, "mode": "async"},
    },
    # Train/inference mismatch alone: on-policy (N = 1), rollouts scored under bf16 autocast,
    # the learner in fp32. No correction / token TIS (cap 2) / VESPO with TIS folded into W /
    # sequence-level masked IS (MIS: weight rho, masked outside [0.5, 2]; the rejection variant). 12 cells, 39 min measured.
    "mismatch": {
        "methods": "clip,clip[correction=tis],vespo[correction=tis],clip[correction=mis]",
        "reference": "clip",  # the question: does a correction beat none? (each test: clip - correction)
        "staleness": "1",
        "seeds": "3",
        "overrides": {**STUDY_SETUP, "mismatch": "bf16"},
    },
    # The mismatch pilot: how far bf16 scoring moves the behaviour log-probs, read from the
    # correction's weights (loss/is_weight/{mean,min,max} in metrics.jsonl; a cap of 1e6
    # leaves rho untruncated). One seed, 32 steps: ~5 min.
    "mismatch-pilot": {
        "methods": "clip[correction=tis:cap=1000000]",
        "staleness": "1",
        "seeds": "0,",
        "overrides": {**STUDY_SETUP, "mismatch": "bf16", "max_steps": 32},
    },
    # The first result on a pretrained language model (issue 34): clip and VESPO, on-policy and
    # N = 8, seeds 0-2, on SmolLM2-135M-Instruct. 12 cells of 24 steps, 19-34 min a cell on one
    # core beside another job (measured, evaluation included; N = 8 the slower), ~5.2 h in all.
    "pilot-smollm2": {
        "methods": "clip,vespo",
        "staleness": "1,8",
        "seeds": "3",
        "reference": "vespo",
        "requires": ("model", "dataset"),
        "requires_hint": "python examples/real_model.py pilot gives both",
        "overrides": PILOT_SETUP,
    },
    # The confirmation study (issue 36), registered in docs/preregistration.md before any of its
    # cells ran: fresh seeds 5-14, the long-completion setup, lr 1e-4. The presets share one
    # output directory per mode, so a cell two presets name (clip at N = 64, clip at K = 16) runs once.
    "confirm-sync": {
        "methods": "clip,vespo,dppo",
        "staleness": "4,64",
        "seeds": CONFIRM_SEEDS,
        "reference": "vespo",
        "overrides": STUDY_SETUP,
    },
    "confirm-ceiling": {
        "methods": "clip",
        "staleness": "1",
        "seeds": CONFIRM_SEEDS,
        "overrides": STUDY_SETUP,
    },
    "confirm-eps": {
        "methods": "clip,clip[eps_high=0.28]",
        "staleness": "64",
        "seeds": CONFIRM_SEEDS,
        "reference": "clip[eps_high=0.28]",
        "overrides": STUDY_SETUP,
    },
    "confirm-async": {
        "methods": "clip,vespo",
        "staleness": "1,16",
        "seeds": CONFIRM_SEEDS,
        "reference": "vespo",
        "jobs": 1,
        "overrides": {**STUDY_SETUP, "mode": "async"},
    },
    "confirm-decoupled": {
        "methods": "clip,clip[proximal=held,proximal_every=16]",
        "staleness": "16",
        "seeds": CONFIRM_SEEDS,
        "reference": "clip[proximal=held,proximal_every=16]",
        "jobs": 1,
        "overrides": {**STUDY_SETUP, "mode": "async"},
    },
    "confirm-lr": {
        "methods": "clip,vespo",
        "staleness": "64",
        "seeds": "5,6,7,8,9",
        "reference": "vespo",
        "lrs": [5e-5, 2e-4],
        "overrides": STUDY_SETUP,
    },
}
