"""Extract the fenced code samples of a Markdown page, and run a page's samples.

Run as ``python -m tests.docs.samples PAGE WORKDIR``: every fenced block of
PAGE runs in order, as a reader would use it:

* a ``python`` block with ``title="path/file.py"`` is written to that file
  under WORKDIR (packages get their ``__init__.py``);
* any other ``python`` block is executed, all of a page's blocks in one
  namespace, in WORKDIR (on ``sys.path``, so the files written are importable);
* a ``console`` block's ``$ celery -A proj dedup …`` lines are run in WORKDIR
  and their output's first line is compared with the page's;
* once every block ran, ``test_*.py`` files written by the page are run
  with pytest in WORKDIR;
* with ``DOCS_CHECK_APPS`` set, every Celery app the page made (in its
  namespace, or in a module it wrote) then passes ``celery dedup check``
  (``check_report``), unless ``DOCS_CHECK_APPS`` is a JSON list of app
  mains the page shows failing on purpose.

``run_page`` also runs a page in the calling process (the Django session
does, for pages that need Django's test database): ``isolated`` undoes its
changes to the working directory, ``sys.path`` and ``sys.modules``.

``DOCS_SUBSTITUTIONS`` (a JSON object in the environment) maps text of the
page to text to run instead, e.g. ``redis://localhost:6379/0`` to a test
server's URL: the samples never touch a server on a standard port.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<lang>[\w+-]*)(?P<attrs>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
CELERY_COMMAND = "$ celery -A proj dedup"


class SampleFailed(AssertionError):
    """A sample of a page failed (the message names the page and the line)."""


@dataclass(frozen=True)
class Sample:
    """One fenced block of a page."""

    lang: str
    code: str
    line: int
    title: str | None = None


def samples(text: str) -> list[Sample]:
    """Every fenced block of ``text``, dedented (blocks nested in lists and admonitions)."""
    found = []
    for match in FENCE.finditer(text):
        title = TITLE.search(match["attrs"])
        found.append(Sample(
            lang=match["lang"],
            code=textwrap.dedent(match["body"]),
            line=text.count("\n", 0, match.start()) + 1,
            title=title["title"] if title else None,
        ))
    return found


def runs(sample: Sample) -> bool:
    """Whether ``run_page`` runs ``sample``: Python, or a console with a ``celery … dedup`` line."""
    if sample.lang == "python":
        return True
    return sample.lang == "console" and any(
        line.startswith(CELERY_COMMAND) for line in sample.code.splitlines()
    )


def runnable(page: Path) -> bool:
    """Whether ``page`` has a sample that ``run_page`` runs."""
    return any(map(runs, samples(page.read_text())))


def _substitute(code: str) -> str:
    for old, new in json.loads(os.environ.get("DOCS_SUBSTITUTIONS") or "{}").items():
        code = code.replace(old, new)
    return code


def _write(workdir: Path, sample: Sample) -> None:
    assert sample.title is not None
    path = workdir / sample.title
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(workdir).parents:
        if parent != Path(".") and path.suffix == ".py":
            (workdir / parent / "__init__.py").touch()
    path.write_text(_substitute(sample.code))


def _console(workdir: Path, sample: Sample, page: str) -> None:
    lines = sample.code.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(CELERY_COMMAND):
            continue
        expected = next((out for out in lines[i + 1:] if out.strip()), "")
        argv = [sys.executable, "-m", *line[2:].split()]
        done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=120,
                              check=False, env={**os.environ, "PYTHONPATH": _pythonpath(workdir),
                                                "COLUMNS": "100"})
        output = (done.stdout + done.stderr).splitlines()
        if done.returncode != 0 or not output:
            raise SampleFailed(
                f"{page}:{sample.line}: {line!r} failed:\n{done.stdout}{done.stderr}"
            )
        if expected.startswith(("Usage:", "Commands:")):
            want = [w.rstrip() for w in lines[i + 1:]]
            got = [g.rstrip() for g in output]
            start = got.index(want[0]) if want[0] in got else -1
            if got[start:start + len(want)] != want:
                raise SampleFailed(f"{page}:{sample.line}: {line!r} prints\n"
                                     + "\n".join(output))
        elif _first_line_differs(output[0], expected):
            raise SampleFailed(f"{page}:{sample.line}: {line!r} printed {output[0]!r}, "
                                 f"the page shows {expected!r}")


def _pythonpath(workdir: Path) -> str:
    """``workdir`` first, then the caller's ``PYTHONPATH`` (a checkout run without install)."""
    return os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH", "")) if p)


def _first_line_differs(got: str, shown: str) -> bool:
    """A table's header must match the page's in full; another line by its first word."""
    if shown.upper() == shown:
        return got.split() != shown.split()
    return got.split()[:1] != shown.split()[:1]


@contextlib.contextmanager
def isolated(workdir: Path) -> Iterator[None]:
    """Run in ``workdir``, importable; then restore the cwd, ``sys.path`` and ``sys.modules``."""
    cwd, path, modules = os.getcwd(), list(sys.path), set(sys.modules)
    sys.path.insert(0, str(workdir))
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            del sys.modules[name]


def run_page(page: Path, workdir: Path) -> None:
    """Run every sample of ``page`` in ``workdir`` (see the module docstring).

    Raises ``SampleFailed`` for the first sample that fails.
    """
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    with isolated(workdir):
        for sample in samples(page.read_text()):
            if sample.lang == "python" and sample.title:
                _write(workdir, sample)
            elif sample.lang == "python":
                code = compile(_substitute(sample.code), f"{page.name}:{sample.line}", "exec")
                try:
                    exec(code, namespace)
                except Exception as exc:
                    traceback.print_exc()
                    raise SampleFailed(
                        f"{page.name}: the sample at line {sample.line} failed: {exc!r}"
                    ) from exc
            elif sample.lang == "console":
                _console(workdir, sample, page.name)
        if os.environ.get("DOCS_CHECK_APPS"):
            check_apps(page.name, namespace, workdir)
    tests = sorted(workdir.glob("**/test_*.py"))
    if tests:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django",
             "--rootdir", str(workdir), *map(str, tests)],
            cwd=workdir, env={**os.environ, "PYTHONPATH": str(workdir)}, check=False,
        )
        if done.returncode != 0:
            raise SampleFailed(f"{page.name}: the page's tests failed")


def page_apps(namespace: dict[str, object], workdir: Path) -> list[object]:
    """Every Celery app of a page: in its namespace, or in a module it wrote."""
    from celery import Celery

    found: dict[int, object] = {}
    scopes = [namespace]
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and Path(origin).resolve().is_relative_to(workdir):
            scopes.append(vars(module))
    for scope in scopes:
        for value in list(scope.values()):
            if isinstance(value, Celery):
                found.setdefault(id(value), value)
    return list(found.values())


def check_apps(page: str, namespace: dict[str, object], workdir: Path) -> None:
    """``celery dedup check`` passes on every app of the page (``DOCS_CHECK_APPS``)."""
    from celery_dedup.cli import check_lines, check_report

    expected = os.environ["DOCS_CHECK_APPS"]
    failing_on_purpose = set(json.loads(expected)) if expected.startswith("[") else set()
    for app in page_apps(namespace, workdir):
        main = str(getattr(app, "main", ""))
        ok, report = check_report(app, timeout=20)
        if ok is (main in failing_on_purpose):
            lines = "\n".join(check_lines(ok, report))
            raise SampleFailed(
                f"{page}: celery dedup check on the app {main!r} "
                f"{'passes, but the page shows it failing' if ok else 'fails'}:\n{lines}"
            )


if __name__ == "__main__":
    try:
        run_page(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
    except SampleFailed as failed:
        raise SystemExit(str(failed)) from None
