"""A user-defined task module, imported by tests/test_tasks.py through load_task's import path."""

from __future__ import annotations

from swarmtrain.tasks import DigitsTask, Task

__all__ = ["TinyDigitsTask", "bad_factory", "broken_factory", "factory", "instance", "not_a_task"]


class TinyDigitsTask(DigitsTask):
    """The digits task under a user's name, as a user would subclass a built-in."""

    name = "tiny-digits"


def factory() -> Task:
    """The usual form: a function returning a Task."""
    return TinyDigitsTask()


instance = TinyDigitsTask()
not_a_task = 42


def bad_factory() -> object:
    """A factory that returns something other than a Task."""
    return "not a task"


def broken_factory() -> Task:
    """A factory that fails."""
    raise RuntimeError("dataset server unreachable")
