#!/usr/bin/env bash
# The LeRobot plugin's tests in a venv of their own (.ci/run runs this after the main suite). They cannot share the
# main venv: LeRobot needs Python >= 3.12 and caps torch below 2.12. PyPI has no CPU-only torch for Linux x86_64,
# so pip takes torch 2.11's regular build with its CUDA libraries: 5.9 GB in the venv, 2 min 7 s to install on the
# CI machine (pip's own cache warm; a cold one downloads ~3.7 GB more, ~350 MB/s here), then 28 s of tests: 2 min 35 s.
set -euo pipefail
cd "$(dirname "$0")/../.."

find_python312() {
    local candidate
    for candidate in python3.13 python3.12; do  # a pyenv shim answers only when that version is selected
        if "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            command -v "$candidate"; return
        fi
    done
    for candidate in "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3; do
        if [ -x "$candidate" ]; then echo "$candidate"; return; fi
    done
    echo "no Python >= 3.12 found (LeRobot needs it): install one, e.g. pyenv install 3.12" >&2
    return 1
}

PYTHON=$(find_python312)
VENV=.venv-lerobot
"$PYTHON" --version
# The venv is rebuilt every run, so it never outlives the run: 5.9 GB left in a clone is what filled a CI machine's
# disk once (pip: "[Errno 28] No space left on device" while installing). Say up front when the disk is that tight.
trap 'rm -rf "$VENV"' EXIT
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "$free_kb" -lt $((10 * 1024 * 1024)) ]; then
    echo "warning: $(( free_kb / 1024 )) MB free on $(df -P . | awk 'NR == 2 {print $6}'); LeRobot's venv needs ~6 GB" \
        "installed plus ~3.7 GB of wheels while pip installs them (~10 GB)" >&2
fi
"$PYTHON" -m venv --clear "$VENV"
"$VENV/bin/pip" install torch==2.11.0 -e . -e integrations/lerobot "lerobot[pusht]" pytest  # pusht: lerobot-eval's sim
"$VENV/bin/python" -m pytest -q tests/lerobot_plugin
