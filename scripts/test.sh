#!/usr/bin/env bash
# Builds specmesh and runs the whole test suite. Tests find the reference models in
# ../shared/refdata (or $SPECMESH_REFDATA) and skip loudly when they are absent.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh specmesh_tests specmesh_cli
ctest --test-dir build --output-on-failure -j 2 "$@"
