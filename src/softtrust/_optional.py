"""Optional dependencies: which extra brings a module, and how a missing one is reported.

softtrust's core needs torch only; the trainer, the study and the integrations need the
extras of ``pyproject.toml``. Two rules, so that a missing package never crashes a run after
its work is done:

- what the user explicitly asked for (``--report-to tensorboard``, a Parquet dataset, the
  sweep's statistics, the trainer itself) is checked before any work, with a one-line error
  naming the package and the extra that brings it (``require``, ``missing_module_message``);
- what only adds a figure is skipped with a one-line notice once the work is saved: the
  plotting code calls ``pyplot()``, whose ``MissingDependency`` its caller turns into that
  notice.
"""

from __future__ import annotations

import importlib
import importlib.util

# module -> (its pip package, the extra of pyproject.toml that brings it)
PACKAGES = {
    "matplotlib": ("matplotlib", "train"),
    "scipy": ("scipy", "train"),
    "transformers": ("transformers", "train"),
    "tokenizers": ("tokenizers", "train"),
    "safetensors": ("safetensors", "train"),
    "yaml": ("pyyaml", "train"),
    "tqdm": ("tqdm", "train"),
    "numpy": ("numpy", "train"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "datasets": ("datasets", "trl"),
    "pyarrow": ("pyarrow", "trl"),
}


class MissingDependency(ImportError):
    """An optional module cannot be imported; the message is one line naming what to install."""


def install_hint(module: str) -> str:
    """``pip install -e ".[extra]"`` (softtrust installs from a clone) or the package alone."""
    package, extra = PACKAGES.get(module.split(".")[0], (module, None))
    if extra is None:
        return f"pip install {package}"
    return f'pip install -e ".[{extra}]" in the softtrust clone, or pip install {package}'


def is_installed(module: str) -> bool:
    """Whether ``module`` (a top-level name) can be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module set to None
        return False


def require(module: str, purpose: str, name: str | None = None) -> None:
    """Refuse (``ValueError``, naming the option ``name`` when there is one) unless ``module``
    is installed: the up-front check for a dependency the user asked for."""
    if not is_installed(module):
        package = PACKAGES.get(module, (module, None))[0]
        prefix = f"{name}: " if name else ""
        raise ValueError(f"{prefix}{purpose} needs {package}, which is not installed; {install_hint(module)}")


def import_optional(module: str, purpose: str):
    """``importlib.import_module(module)``, or ``MissingDependency`` with a one-line message."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependency(
            f"{purpose} needs {module.split('.')[0]} ({error}); {install_hint(module)}"
        ) from error


def pyplot(purpose: str):
    """``matplotlib.pyplot`` on the file-only Agg backend; ``MissingDependency`` without matplotlib."""
    matplotlib = import_optional("matplotlib", purpose)
    matplotlib.use("Agg")
    return import_optional("matplotlib.pyplot", purpose)


def missing_module_message(error: ModuleNotFoundError) -> str | None:
    """The one-line message for an extra's module that is not installed; None for any other module."""
    name = (error.name or "").split(".")[0]
    if name not in PACKAGES:
        return None
    return f"{PACKAGES[name][0]} is not installed; {install_hint(name)}"
