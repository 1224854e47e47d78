"""minfer on Ray (the ``ray`` extra): ``LLMPredictor`` for Ray Data batch jobs, ``serve_app`` for Ray Serve.

Ray is a large optional dependency, so nothing here imports it until a name is used: ``import minfer`` and
``import minfer.ray`` never need it, and using a name without Ray installed is an ImportError that says how to
install the extra (minfer is installed from its checkout, not from PyPI).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minfer.ray.extra import RAY_EXTRA, require_ray

if TYPE_CHECKING:
    from minfer.ray.data import LLMPredictor
    from minfer.ray.serve import app_builder, serve_app

__all__ = ["LLMPredictor", "serve_app", "app_builder", "require_ray", "RAY_EXTRA"]


def __getattr__(name: str) -> Any:
    if name == "LLMPredictor":
        require_ray()
        from minfer.ray.data import LLMPredictor

        return LLMPredictor
    if name in ("serve_app", "app_builder"):
        require_ray()
        from minfer.ray import serve

        return getattr(serve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
