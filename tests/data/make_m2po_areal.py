"""Record AReaL 1.0.4's M2PO mask on fixed inputs, as a peer oracle for tests/test_selection.py.

Regenerate (needs AReaL's source, not its dependencies)::

    pip install areal==1.0.4 --no-deps
    python tests/data/make_m2po_areal.py   # writes tests/data/m2po_areal.json

``areal.trainer.ppo.actor`` cannot be imported without AReaL's service dependencies, so
this script reads that installed file, compiles only its two mask functions
(``_apply_m2po_masking``, ``_get_m2po_loss_mask``, module-level, torch-only) and calls
them: the peer's own code runs, nothing of it is copied into softtrust.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch

NAMES = ("_apply_m2po_masking", "_get_m2po_loss_mask")
CASES = [  # (seed, batch, length, spread, tau): spreads from "nothing masked" to "most masked"
    (1, 4, 9, 0.05, 0.04),
    (2, 6, 11, 0.2, 0.04),
    (3, 8, 16, 0.4, 0.04),
    (4, 5, 7, 0.3, 0.01),
    (5, 3, 30, 1.0, 0.04),
]


def areal_mask_functions() -> dict:
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("areal is not installed: pip install areal==1.0.4 --no-deps")
    source_path = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "ppo" / "actor.py"
    tree = ast.parse(source_path.read_text())
    nodes = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in NAMES]
    if len(nodes) != len(NAMES):
        raise SystemExit(f"{source_path}: expected functions {NAMES}")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(source_path), "exec"), namespace)
    return namespace


def main() -> None:
    functions = areal_mask_functions()
    records = []
    for seed, batch, length, spread, tau in CASES:
        gen = torch.Generator().manual_seed(seed)
        prox = -3 * torch.rand(batch, length, generator=gen, dtype=torch.float64)
        old = prox + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
        mask = torch.rand(batch, length, generator=gen) < 0.75
        mask[:, 0] = True
        areal = functions["_apply_m2po_masking"](old, prox, mask, tau)
        records.append(
            {
                "seed": seed,
                "tau": tau,
                "old": old.tolist(),
                "prox": prox.tolist(),
                "mask": mask.tolist(),
                "areal_keep": areal.tolist(),
            }
        )
    out = Path(__file__).with_name("m2po_areal.json")
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as handle:
        json.dump({"peer": "areal==1.0.4", "cases": records}, handle)
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, out)  # atomic: never a half-written file
    print(f"wrote {out} ({len(records)} cases)")


if __name__ == "__main__":
    main()
