# Sourced by scripts/demo: sets PYTHON to the interpreter pip installs into,
# and says which. PYTHON set by the caller, or an active virtualenv, is used
# as it is. Otherwise the project virtualenv .venv (made from python3 on
# first use) is: never a global interpreter, whether a Debian system Python
# (PEP 668), pyenv's, conda's or a container's.
if [ -n "${PYTHON:-}" ]; then
    echo "Installing into $PYTHON (set by PYTHON)."
elif python3 -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null; then
    PYTHON=python3
    echo "Installing into the active virtualenv $(python3 -c 'import sys; print(sys.prefix)')."
else
    if [ ! -x .venv/bin/python ]; then
        echo "Creating the project virtualenv .venv from $(command -v python3) ($(python3 -c 'import sys; print(sys.version.split()[0])'))."
        if ! python3 -m venv .venv 2>/dev/null; then
            rm -rf .venv
            SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
            echo "python3 cannot make a virtualenv (no ensurepip): apt-get will install python3-venv."
            $SUDO apt-get update -qq
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv
            python3 -m venv .venv
        fi
    fi
    PYTHON=.venv/bin/python
    echo "Installing into the project virtualenv .venv, not into $(command -v python3)."
    echo "To use it in your shell afterwards: . .venv/bin/activate"
fi
export PYTHON
