#!/usr/bin/env bash
# The GPU check's inputs, gathered here into .gpu-check/ (git-ignored) as bundles of one
# device call each, and the device calls to make (gpu_check/prepare.py; CONTRIBUTING.md,
# "Running the GPU check").
# usage: scripts/gpu_check/prepare.sh [--wheel PATH] [--stages build,install,test,bench]
#                                     [--module DIR ...] [--allow-unusable-wheel]
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m gpu_check.prepare "$@"
