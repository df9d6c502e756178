#!/usr/bin/env bash
# Configures and builds specmesh into build/ (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Paths under the checkout hash as relative ones, so another clone on this machine (CI, a second
# work tree) reuses the compiled objects through ccache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build -j "$(nproc)" "$@"
