"""One name -> implementation registry, shared by the RL registries (policy losses, environments,
rollout backends), so that each has the same duplicate check and the same error for an unknown name."""
from __future__ import annotations

from typing import Callable


class Registry(dict):
    """A dict of `kind`s by name. `register(name)` is a decorator; a second entry of a name raises.
    With `set_name`, the registered class gets `.name = name`."""

    def __init__(self, kind: str, *, set_name: bool = False):
        super().__init__()
        self.kind, self.set_name = kind, set_name

    def register(self, name: str) -> Callable:
        def add(obj):
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered (by "
                                 f"{getattr(self[name], '__qualname__', self[name])}); register yours under "
                                 "another name")
            if self.set_name:
                obj.name = name
            self[name] = obj
            return obj

        return add

    def get_entry(self, name: str):
        """The entry `name`; ValueError listing the registered names otherwise."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(sorted(self))}")
        return self[name]
