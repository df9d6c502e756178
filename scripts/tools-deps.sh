#!/usr/bin/env bash
# Installs the Debian (bookworm) packages the Python tools in tools/ need (not the build's:
# scripts/deps.sh). tools/dflash_drafter.py: PyTorch. Needs root (or sudo).
set -euo pipefail
pkgs=(python3 python3-torch)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
