"""What the shims share with the package: exceptions that survive the trip back, lazy import.

An exception raised inside a task reaches the caller through the result
backend: pickled, or (JSON) rebuilt as ``type(exc)(*exc.args)``. Every
exception class of the package must come back with its type and fields.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

import celery_dedup
from celery_dedup import exceptions as core
from celery_dedup.cli import CommandFailed
from celery_dedup.compat import celery_once, celery_singleton
from celery_dedup.lint_calls import DedupLintWarning
from celery_dedup.options import DedupConfigWarning
from tests.compat.conftest import AppFactory, worker

#: One instance of every exception class of the package, by class.
SAMPLES: dict[type[BaseException], Callable[[], BaseException]] = {
    core.DedupError: lambda: core.DedupError("no lock store"),
    core.InvalidOptionError: lambda: core.InvalidOptionError("unique_for", -1, "seconds > 0"),
    core.OptionCombinationError: lambda: core.OptionCombinationError(
        "cancel_wait", 5, "on_duplicate", "cancel_running", "existing", "tasks.sync"
    ),
    core.DedupKeyError: lambda: core.DedupKeyError("a set", argument="tags", task_name="t.sync"),
    core.MissingDeduplicationKey: lambda: core.MissingDeduplicationKey(task_name="t.sync"),
    core.DuplicateTaskError: lambda: core.DuplicateTaskError(
        task_name="t.sync", key="celery-dedup:t.sync:ab", existing_task_id="id-1", ttl=12.5
    ),
    core.KeyReuseError: lambda: core.KeyReuseError(
        task_name="t.sync", key="celery-dedup:t.sync:ab", existing_task_id="id-1", ttl=12.5
    ),
    core.KeyReuseWarning: lambda: core.KeyReuseWarning("key reused"),
    core.CancelTimeout: lambda: core.CancelTimeout(
        task_name="t.sync", key="celery-dedup:t.sync:ab", existing_task_id="id-1", waited=10.0
    ),
    core.CancelOwnRunError: lambda: core.CancelOwnRunError(
        task_name="t.sync", key="celery-dedup:t.sync:ab", task_id="id-1"
    ),
    core.RateLimited: lambda: core.RateLimited(
        task_name="t.sync", key="celery-dedup:t.sync:ab", retry_after=1.5, existing_task_id="id-1"
    ),
    core.LimitsNotSupported: lambda: core.LimitsNotSupported(
        task_name="t.sync", option="concurrency_limit", store="memcached"
    ),
    core.ResultLost: lambda: core.ResultLost(task_name="t.sync", task_id="id-1", outcome="success"),
    core.FencingNotSupported: lambda: core.FencingNotSupported(task_name="t.sync", store="sql"),
    core.NoFenceError: lambda: core.NoFenceError("no lock", task_name="t.sync"),
    core.DeduplicationUnavailable: lambda: core.DeduplicationUnavailable(
        "store down", task_name="t.sync", reason="unavailable"
    ),
    core.MalformedHeader: lambda: core.MalformedHeader("until", "'bogus'", "a UniqueUntil"),
    core.StoreUnavailable: lambda: core.StoreUnavailable("refused", store="redis"),
    core.StoreContention: lambda: core.StoreContention("deadlocks", store="sql"),
    core.StoreError: lambda: core.StoreError("failed", store="redis"),
    core.StoreRefused: lambda: core.StoreRefused("READONLY", store="redis"),
    core.StorePermissionDenied: lambda: core.StorePermissionDenied("NOPERM", store="redis"),
    core.ScanNotSupported: lambda: core.ScanNotSupported("no scan", store="memcached"),
    core.ImproperlyConfigured: lambda: core.ImproperlyConfigured("unknown scheme"),
    CommandFailed: lambda: CommandFailed("no such lock"),
    DedupConfigWarning: lambda: DedupConfigWarning("unknown setting"),
    DedupLintWarning: lambda: DedupLintWarning("celery-dedup W101 (task t): … Fix: …."),
    celery_once.AlreadyQueued: lambda: celery_once.AlreadyQueued(
        30.5, task_name="t.sync", key="k", existing_task_id="id-1"
    ),
    celery_singleton.CelerySingletonException: lambda: celery_singleton.CelerySingletonException(
        "singleton"
    ),
    celery_singleton.DuplicateTaskError: lambda: celery_singleton.DuplicateTaskError(
        "duplicate", "id-1", "t.sync", "k", 3.0
    ),
}

#: The one class whose ``args`` are upstream's alone: JSON keeps only ``countdown``.
ARGS_ARE_UPSTREAMS = {celery_once.AlreadyQueued}


def package_exception_classes() -> set[type[BaseException]]:
    """Every public exception class defined in the package (Django's contrib aside)."""
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(celery_dedup.__path__, "celery_dedup."):
        if info.name.startswith("celery_dedup.contrib"):
            continue  # needs configured Django settings; covered by the Django suite
        module = importlib.import_module(info.name)
        found.update(
            value
            for name, value in vars(module).items()
            if inspect.isclass(value)
            and issubclass(value, BaseException)
            and value.__module__ == module.__name__
            and not name.startswith("_")
        )
    return found


def fields(exc: BaseException) -> dict[str, Any]:
    """Type, message, ``args`` and attributes: what must survive the trip."""
    return {"type": type(exc), "str": str(exc), "args": exc.args, **vars(exc)}


def test_every_exception_class_has_a_sample() -> None:
    """A new exception class is covered by the tests below once it has a sample."""
    assert package_exception_classes() == set(SAMPLES)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda cls: cls.__qualname__)
def test_pickle_and_args_rebuild_the_exception(cls: type[BaseException]) -> None:
    """pickle round trip and ``type(exc)(*exc.args)`` give the same type and fields."""
    exc = SAMPLES[cls]()
    assert type(exc) is cls
    assert fields(pickle.loads(pickle.dumps(exc))) == fields(exc)
    rebuilt = cls(*exc.args)
    if cls in ARGS_ARE_UPSTREAMS:
        assert (type(rebuilt), str(rebuilt), rebuilt.args) == (cls, str(exc), exc.args)
    else:
        assert fields(rebuilt) == fields(exc)


@pytest.mark.redis
@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_raised_in_a_task_they_reach_the_caller(make_app: AppFactory, serializer: str) -> None:
    """Raised by a task on a real worker, each exception comes back through the result backend."""
    app: Celery = make_app(
        result_serializer=serializer, result_accept_content=["json", "pickle"]
    )
    names = {cls.__qualname__ + cls.__module__: cls for cls in SAMPLES}

    @app.task(shared=False)
    def raise_sample(name: str) -> None:
        raise SAMPLES[names[name]]()

    with worker(app):
        results = {name: raise_sample.delay(name) for name in names}
        for name, result in results.items():
            result.get(timeout=10, propagate=False)
            expected = SAMPLES[names[name]]()
            if names[name] in ARGS_ARE_UPSTREAMS and serializer == "json":
                expected = type(expected)(*expected.args)
            assert fields(result.result) == fields(expected), name


def test_shims_are_not_imported_by_the_package() -> None:
    """``import celery_dedup`` leaves the compat modules unimported."""
    code = (
        "import sys, celery_dedup; "
        "print(sorted(m for m in sys.modules if m.startswith('celery_dedup.compat')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
