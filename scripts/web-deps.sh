#!/usr/bin/env bash
# Installs the npm packages of the tests in tests/web (the openai client, playwright-core) into
# tests/web/node_modules, exactly as package-lock.json pins them; does nothing when they are
# there already. CTest runs it (test web.setup) before the tests that need them.
set -euo pipefail
cd "$(dirname "$0")/../tests/web"
stamp=node_modules/.specmesh-lock
if [ -f "$stamp" ] && cmp -s package-lock.json "$stamp"; then
  echo "tests/web: npm packages up to date"
  exit 0
fi
npm ci --no-audit --no-fund
cp package-lock.json "$stamp"
