"""Build the sdist and wheel, install the wheel with each extra, and run it.

``python scripts/release_check.py [EXTRA ...]`` (run by ``scripts/test`` when
``CI`` is set; needs the ``dev`` extra for ``build``, ``twine`` and
``trove-classifiers``):

1. ``python -m build`` makes the sdist and the wheel; ``twine check`` and the
   list of known classifiers check the metadata an index upload needs.
2. For the wheel alone and for every extra it declares (``dev``, ``test`` and
   ``bench`` excepted), a fresh virtualenv gets ``celery_dedup-*.whl[extra]``
   from the package index, as a user's ``pip install`` would, and nothing
   from this checkout.
3. Where an extra is a deployment path (``redis``, ``postgres``, ``sql``,
   ``django``, ``memcached``), the script starts the server it needs on a
   free loopback port, then a real ``celery -A proj worker`` from that
   virtualenv, and a producer that calls a ``DedupTask`` twice: the second
   call must be deduplicated and the task body must run exactly once. The
   other extras (``mysql``, ``sqs``, ``prometheus``) import what their path
   imports.

Exits 1 if any check failed, after running all of them.
"""

from __future__ import annotations

import contextlib
import email.parser
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: extras for developing the project, not for users
NOT_USER_EXTRAS = {"dev", "test", "bench"}
#: Debian keeps some server binaries outside PATH.
EXTRA_PATHS = [
    "/usr/sbin",
    "/sbin",
    *sorted(str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")),
]
WAIT = 90.0

# A user's project: one DedupTask whose body appends its argument to a file,
# so the check counts executions, not calls. Configured from the environment.
PROJ = '''\
"""A user's project, as the release check writes it."""
import json
import os
from pathlib import Path

if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django

    django.setup()

from celery import Celery

from celery_dedup import DedupTask

RUNS = Path(os.environ["CHECK_RUNS"])
app = Celery("proj")
app.conf.update(json.loads(os.environ["CHECK_CONF"]))


# "expiry": the second call is a duplicate however fast the worker runs the first
# (under "success" a first call already done frees its key, rightly).
@app.task(base=DedupTask, unique_for=300, unique_until="expiry")
def record(name):
    with RUNS.open("a") as runs:
        runs.write(name + "\\n")
'''

PRODUCER = """\
from proj import record

first = record.delay("charge")
second = record.delay("charge")
assert first.deduplicated is False, "the first call was deduplicated"
assert second.deduplicated is True, "the second call was published"
assert second.id == first.id, (second.id, first.id)
record.delay("marker")
print("producer: second call deduplicated, holder", first.id)
"""

DJANGO_SETTINGS = """\
import os

SECRET_KEY = "release-check"
INSTALLED_APPS = ["django_celery_results", "celery_dedup.contrib.django"]
DATABASES = {"default": {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": os.environ["CHECK_DB"],
    "OPTIONS": {"timeout": 30},
}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
"""

IMPORTS = {
    "": "import celery_dedup, celery_dedup.cli, celery_dedup.stores.memory",
    "mysql": "import pymysql, sqlalchemy, celery_dedup.stores.sql; "
    "sqlalchemy.create_engine('mysql+pymysql://u@127.0.0.1:1/db')",
    "sqs": "import boto3, pycurl, kombu.transport.SQS, celery_dedup.native",
    "prometheus": "import prometheus_client, celery_dedup.prometheus",
}


class CheckFailed(Exception):
    """One check did not pass; the message says why."""


@dataclass
class Report:
    """What each check found, printed at the end."""

    lines: list[str] = field(default_factory=list)
    failed: bool = False

    def add(self, name: str, ok: bool, seconds: float, detail: str = "") -> None:
        """Record one check."""
        self.failed |= not ok
        status = "ok" if ok else "FAILED"
        self.lines.append(f"{status:8} {seconds:5.0f}s  {name}{': ' + detail if detail else ''}")


def log(message: str) -> None:
    """Print a progress line at once."""
    print(message, flush=True)


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the check with its output if it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        output = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise CheckFailed(f"{' '.join(argv)} exited {proc.returncode}:\n{output}")
    return proc


def free_port() -> int:
    """A TCP port nothing listens on right now, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def binary(name: str) -> str:
    """The path of an installed server binary."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(EXTRA_PATHS))
    if found is None:
        raise CheckFailed(f"{name} is not installed (scripts/test installs it)")
    return found


def wait_until(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll ``ready`` until it is true; fail if ``proc`` exits or the deadline passes."""
    deadline = time.monotonic() + WAIT
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise CheckFailed(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not after {WAIT:.0f}s")
        time.sleep(0.1)


def listening(port: int) -> Callable[[], bool]:
    """Whether 127.0.0.1:port accepts connections."""

    def check() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    return check


@contextlib.contextmanager
def process(argv: list[str], logfile: Path, **kwargs: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Run a process in its own group until the block ends, then stop the group."""
    with logfile.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)


def unprivileged() -> pwd.struct_passwd | None:
    """The user to run postgres and memcached as when we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise CheckFailed("running as root and neither a postgres nor a nobody user exists")


def as_user(user: pwd.struct_passwd | None, argv: list[str]) -> list[str]:
    """``argv`` run as ``user``."""
    if user is None:
        return argv
    return [
        binary("setpriv"),
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        "--",
        *argv,
    ]


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[dict[str, object]]:
    """A throwaway redis-server; the app's Redis broker and result backend."""
    port = free_port()
    argv = [
        binary("redis-server"),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp),
    ]
    with process(argv, tmp / "redis.log") as proc:
        wait_until("redis-server listening", listening(port), proc)
        url = f"redis://127.0.0.1:{port}"
        yield {"broker_url": f"{url}/0", "result_backend": f"{url}/1"}


@contextlib.contextmanager
def postgres_server(tmp: Path) -> Iterator[dict[str, object]]:
    """A throwaway PostgreSQL cluster; the app's result backend (and so the lock store)."""
    user = unprivileged()
    directory = Path(tempfile.mkdtemp(prefix="release-check-pg-"))  # postgres's user must own it
    try:
        if user is not None:
            os.chown(directory, user.pw_uid, user.pw_gid)
        env = {**os.environ, "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
        run(
            as_user(
                user,
                [
                    binary("initdb"),
                    "-D",
                    str(directory / "data"),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ],
            ),
            env=env,
            cwd=directory,
        )
        port = free_port()
        argv = as_user(
            user,
            [
                binary("postgres"),
                "-D",
                str(directory / "data"),
                "-k",
                str(directory),
                "-p",
                str(port),
                "-h",
                "127.0.0.1",
                "-c",
                "fsync=off",
            ],
        )
        with process(argv, tmp / "postgres.log", env=env) as proc:
            ready = [
                binary("pg_isready"),
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
            ]
            wait_until(
                "postgres ready", lambda: subprocess.run(ready, check=False).returncode == 0, proc
            )
            yield {
                **filesystem_broker(tmp),
                "result_backend": f"db+postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
            }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def memcached_server(tmp: Path) -> Iterator[dict[str, object]]:
    """A throwaway memcached, named as the lock store (Celery has no result backend on it here)."""
    port = free_port()
    argv = [binary("memcached"), "-l", "127.0.0.1", "-p", str(port), "-U", "0"]
    if os.geteuid() == 0:
        argv += ["-u", "nobody"]
    with process(argv, tmp / "memcached.log") as proc:
        wait_until("memcached listening", listening(port), proc)
        yield {**filesystem_broker(tmp), "dedup_store": f"memcached://127.0.0.1:{port}"}


@contextlib.contextmanager
def sqlite_backend(tmp: Path) -> Iterator[dict[str, object]]:
    """Celery's database result backend on an SQLite file (and so the SQL lock store)."""
    yield {**filesystem_broker(tmp), "result_backend": f"db+sqlite:///{tmp / 'results.sqlite3'}"}


@contextlib.contextmanager
def django_project(tmp: Path) -> Iterator[dict[str, object]]:
    """A Django project on SQLite: django-celery-results and the django-db lock store."""
    (tmp / "check_settings.py").write_text(DJANGO_SETTINGS)
    yield {**filesystem_broker(tmp), "result_backend": "django-db"}


def filesystem_broker(tmp: Path) -> dict[str, object]:
    """kombu's ``filesystem://`` transport in ``tmp`` (no broker server to start)."""
    queue, control = tmp / "broker" / "queue", tmp / "broker" / "control"
    queue.mkdir(parents=True, exist_ok=True)
    control.mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": "filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "control_folder": str(control),
            "polling_interval": 0.1,
        },
    }


WORKER_PATHS = {
    "redis": redis_server,
    "postgres": postgres_server,
    "sql": sqlite_backend,
    "django": django_project,
    "memcached": memcached_server,
}


def build(out: Path) -> tuple[Path, Path]:
    """Build the sdist and wheel into ``out``; check their metadata."""
    run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    wheel, sdist = next(out.glob("*.whl")), next(out.glob("*.tar.gz"))
    run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    from trove_classifiers import classifiers as known

    metadata = wheel_metadata(wheel)
    unknown = [c for c in metadata.get_all("Classifier") or [] if c not in known]
    if unknown:
        raise CheckFailed(f"unknown classifiers: {unknown}")
    for name in ("License-File", "Requires-Python", "Description-Content-Type"):
        if not metadata.get(name):
            raise CheckFailed(f"the wheel's metadata has no {name}")
    return wheel, sdist


def wheel_metadata(wheel: Path) -> email.message.Message:
    """The METADATA of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def install(wheel: Path, extra: str, venv: Path) -> Path:
    """A fresh virtualenv with ``wheel[extra]``; returns its bin directory."""
    run([sys.executable, "-m", "venv", str(venv)])
    bindir = venv / "bin"
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    run(
        [
            str(bindir / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            target,
        ]
    )
    run([str(bindir / "python"), "-m", "pip", "check"])
    return bindir


def check_worker(extra: str, bindir: Path, tmp: Path) -> str:
    """A real worker and a producer from the virtualenv: two calls, one run."""
    (tmp / "proj.py").write_text(PROJ)
    (tmp / "producer.py").write_text(PRODUCER)
    runs = tmp / "runs.txt"
    with WORKER_PATHS[extra](tmp) as conf:
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
        env |= {
            "PYTHONPATH": str(tmp),
            "CHECK_RUNS": str(runs),
            "CHECK_CONF": json.dumps(conf),
            "CHECK_DB": str(tmp / "db.sqlite3"),
        }
        if extra == "django":
            env["DJANGO_SETTINGS_MODULE"] = "check_settings"
            run(
                [
                    str(bindir / "python"),
                    "-c",
                    "import proj; from django.core.management import call_command; "
                    "call_command('migrate', verbosity=0)",
                ],
                cwd=tmp,
                env=env,
            )
        worker = [
            str(bindir / "celery"),
            "-A",
            "proj",
            "worker",
            "--pool=solo",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with process(worker, tmp / "worker.log", cwd=tmp, env=env) as proc:
            try:
                produced = run(
                    [str(bindir / "python"), "producer.py"], cwd=tmp, env=env
                ).stdout.strip()
                # The worker takes messages in order: once "marker" ran, a
                # published duplicate would have run before it.
                wait_until(
                    "the worker ran the marker task",
                    lambda: runs.exists() and "marker" in runs.read_text().split(),
                    proc,
                )
                charges = runs.read_text().split().count("charge")
                if charges != 1:
                    raise CheckFailed(f"the deduplicated task ran {charges} times, not once")
            except CheckFailed as exc:
                raise CheckFailed(
                    f"{exc}\nworker log:\n{(tmp / 'worker.log').read_text()[-4000:]}"
                ) from exc
    return f"{produced}; the body ran once"


def check(extra: str, wheel: Path, work: Path, report: Report) -> None:
    """Install ``wheel[extra]`` into a new virtualenv and prove its path works."""
    name = f"wheel[{extra}]" if extra else "wheel"
    log(f"--- {name}: a new virtualenv, pip install {name}")
    started = time.monotonic()
    tmp = work / (extra or "base")
    tmp.mkdir()
    try:
        bindir = install(wheel, extra, tmp / "venv")
        run([str(bindir / "python"), "-c", IMPORTS.get(extra, IMPORTS[""])], cwd=tmp)
        run([str(bindir / "celery"), "dedup", "--help"], cwd=tmp)
        detail = check_worker(extra, bindir, tmp) if extra in WORKER_PATHS else "imports its path"
    except CheckFailed as exc:
        log(str(exc))
        report.add(name, False, time.monotonic() - started, str(exc).splitlines()[0])
    else:
        log(f"{name}: {detail}")
        report.add(name, True, time.monotonic() - started, detail)


def main(argv: list[str]) -> int:
    """Build, then check the wheel with every extra (or the ones named)."""
    report = Report()
    with tempfile.TemporaryDirectory(prefix="release-check-") as directory:
        work = Path(directory)
        started = time.monotonic()
        log("--- python -m build: sdist and wheel")
        try:
            wheel, sdist = build(work / "dist")
        except CheckFailed as exc:
            log(str(exc))
            report.add("build", False, time.monotonic() - started, str(exc).splitlines()[0])
            print("\n".join(report.lines))
            return 1
        report.add("build", True, time.monotonic() - started, f"{sdist.name}, {wheel.name}")
        declared = wheel_metadata(wheel).get_all("Provides-Extra") or []
        extras = argv or ["", *(e for e in declared if e not in NOT_USER_EXTRAS)]
        log(f"extras to check: {', '.join(e or '(none)' for e in extras)}")
        for extra in extras:
            check(extra, wheel, work, report)
    print("\n=== release check", *report.lines, sep="\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
