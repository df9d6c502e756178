#!/usr/bin/env bash
# Installs the Debian (bookworm) packages specmesh builds against, or the packages named as
# arguments (scripts/tools-deps.sh). Needs root (or sudo).
set -euo pipefail
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || pkgs=(build-essential cmake ninja-build pkg-config
      libcaf-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libspdlog-dev
      libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libicu-dev libcpp-httplib-dev libjemalloc-dev
      libgtest-dev libbenchmark-dev ccache
      chromium)  # the chat page's test in headless Chromium (tests/web)
# Node.js and npm for the tests from real clients (tests/web); a machine may have them from
# elsewhere than Debian, so only their absence asks for Debian's.
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
