# Sourced by scripts/demo and scripts/test: sets PYTHON to an interpreter
# pip may install into. Inside a virtualenv (or with PYTHON set) that one is
# used; a system Python that refuses pip installs (PEP 668, as on Debian and
# Ubuntu) gets a project virtualenv in .venv instead.
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -z "${VIRTUAL_ENV:-}" ] && "$PYTHON" - <<'PY'
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)
PY
    then
        if [ ! -x .venv/bin/python ]; then
            if ! "$PYTHON" -m venv .venv 2>/dev/null; then
                SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
                $SUDO apt-get update -qq
                DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv
                "$PYTHON" -m venv .venv
            fi
        fi
        PYTHON=.venv/bin/python
    fi
fi
export PYTHON
