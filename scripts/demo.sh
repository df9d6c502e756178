#!/usr/bin/env bash
# Builds specmesh and generates a story with the reference model stories260K.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh specmesh_cli
refdata="${SPECMESH_REFDATA:-../shared/refdata}"
model="$refdata/gguf-models/stories260K.gguf"
if [ ! -f "$model" ]; then
  echo "No reference model at $model." >&2
  echo "Pass any llama / qwen2 / qwen3 GGUF instead: build/specmesh generate -m MODEL.gguf -p 'Hello'" >&2
  exit 1
fi
exec build/specmesh generate -m "$model" -p "${1:-Once upon a time}" -n "${2:-200}" --temp 0
