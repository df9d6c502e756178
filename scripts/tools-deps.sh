#!/usr/bin/env bash
# Installs the Debian (bookworm) packages the Python tools in tools/ need, which the build does
# not (scripts/deps.sh): tools/dflash_drafter.py needs PyTorch, the bench plots (bench/*.py)
# matplotlib. Needs root (or sudo).
set -euo pipefail
exec "$(dirname "$0")/deps.sh" python3 python3-torch python3-matplotlib
