"""Whether the ``ray`` extra is installed: a leaf, so the package's lazy names and its modules share one check."""
from __future__ import annotations

import importlib.util

RAY_EXTRA = 'in the minfer checkout, run pip install -e ".[ray]"'  # minfer is installed from its checkout


def require_ray() -> None:
    """Fail with the install command, not a ModuleNotFoundError from deep inside a Ray job."""
    if importlib.util.find_spec("ray") is None:
        raise ImportError(f"minfer.ray needs Ray (the `ray` extra, ray[data,serve]): {RAY_EXTRA}")
