import sys
from pathlib import Path

import torch

# tests/ holds shared helpers (helpers.py, trl_oracle.py) imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
