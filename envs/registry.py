"""Environments by name, from the Python entry-point group `retrosight.envs`.

The shipped environments are declared in pyproject.toml like any other; a user's package adds
its own with no change here:

    [project.entry-points."retrosight.envs"]
    my_env = "my_package.env:MyEnvironment"
"""
from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .base import Environment

GROUP = "retrosight.envs"


def available() -> dict[str, EntryPoint]:
    """Every installed environment's entry point, by name (looked up afresh: installs change)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def get(name: str) -> type[Environment]:
    """The environment class registered as `name`; KeyError listing the known names."""
    found = available()
    if name not in found:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(found)) or 'none'} (entry-point group {GROUP!r})")
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"entry point {name!r} = {found[name].value} is not an envs.base.Environment subclass")
    if cls.name != name:
        raise ValueError(f"entry point {name!r} loads {cls.__name__}, whose name is {cls.name!r}: they must agree")
    return cls


def make(name: str, options: Mapping[str, Any]) -> Environment:
    """The environment `name` with its own params validated (pydantic ValidationError naming the key)."""
    cls = get(name)
    return cls(cls.Options.model_validate(dict(options)))
