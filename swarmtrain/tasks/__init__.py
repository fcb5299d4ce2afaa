"""Tasks: what to train (model factory, loss, data, evaluation), independent of distribution.

Built-in tasks are ``digits`` and ``textlm``; a user task is named by an import path
``package.module:factory`` and loaded with :func:`load_task`.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from swarmtrain.errors import TaskError
from swarmtrain.tasks.base import (
    Dataset,
    Shard,
    Task,
    TaskData,
    TensorPairDataset,
    evaluation_mode,
    seeded_module,
)
from swarmtrain.tasks.digits import DigitsTask
from swarmtrain.tasks.jsonl import read_jsonl
from swarmtrain.tasks.textlm import TextLM, TextLMConfig, TextLMTask

__all__ = [
    "BUILTIN_TASKS",
    "Dataset",
    "DigitsTask",
    "Shard",
    "Task",
    "TaskData",
    "TensorPairDataset",
    "TextLM",
    "TextLMConfig",
    "TextLMTask",
    "evaluation_mode",
    "load_task",
    "read_jsonl",
    "seeded_module",
]

BUILTIN_TASKS: dict[str, Callable[[], Task]] = {
    "digits": DigitsTask,
    "textlm": TextLMTask,
}


def load_task(spec: str) -> Task:
    """Find a task by built-in name or import path.

    Args:
        spec: ``"digits"``, ``"textlm"``, or ``"package.module:attr"`` where ``attr`` is a
            :class:`Task` instance, a :class:`Task` subclass (instantiated without
            arguments), or a factory callable returning a :class:`Task`.

    Returns:
        The task.

    Raises:
        TaskError: the name is unknown, the module cannot be imported, the attribute is
            missing, or it does not give a :class:`Task`; the message names ``spec``.
    """
    builtins = ", ".join(sorted(BUILTIN_TASKS))
    usage = f"built-in tasks: {builtins}; a user task is given as 'package.module:factory'"
    spec = spec.strip()
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]()
    module_name, sep, attr_path = spec.partition(":")
    if not sep:
        raise TaskError(f"unknown task {spec!r} ({usage})")
    if not module_name or not attr_path:
        raise TaskError(f"task {spec!r} is malformed: need both module and attribute ({usage})")
    _working_directory_importable()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise TaskError(f"task {spec!r}: module {module_name!r} not found ({usage})") from e
        raise TaskError(f"task {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise TaskError(
            f"task {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    obj: object = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return _as_task(spec, obj)


def _working_directory_importable() -> None:
    """Let ``package.module`` name a module under the working directory, as ``python -m``
    does, also for the installed ``swarmtrain`` command (whose path starts at its bin
    directory). Appended, so it never shadows an installed package."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)


def _as_task(spec: str, obj: object) -> Task:
    if isinstance(obj, Task):
        return obj
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise TaskError(f"task {spec!r}: class {obj.__name__} is not a subclass of Task")
    if not callable(obj):
        raise TaskError(
            f"task {spec!r} is a {type(obj).__name__}, not a Task, Task subclass or factory"
        )
    try:
        task = obj()
    except Exception as e:
        raise TaskError(f"task {spec!r}: calling the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r}: the factory returned a {type(task).__name__}, not a Task")
    return task
