#!/usr/bin/env bash
# Fuzzes the input formats: builds the libFuzzer targets in fuzz/ with clang, the address and
# undefined-behaviour sanitizers (both halting) into build-fuzz/, then runs each target in turn
# for SECONDS (default 60) from its seed corpus fuzz/corpus/<target>/ (made from code alone),
# the seeds cut from the reference data (../shared/refdata or $SPECMESH_REFDATA, written to
# build-fuzz/seeds/<target>/ before the run, never committed) and what earlier runs found
# (build-fuzz/corpus/<target>/).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]    targets: gguf llama2c messages safetensors topology (default: all)
#   scripts/fuzz.sh --toolchain              only install clang and libFuzzer if missing; fails
#                                            when they cannot be had
#   scripts/fuzz.sh --seeds                  rewrite fuzz/corpus/ (the committed seeds)
#
# Fails when a target finds a crash, a sanitizer error, a leak, a hang or a broken property; the
# input is saved as build-fuzz/crashes/<target>/crash-* (reproduce: build-fuzz/fuzz_<target> FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
all_targets=(gguf llama2c messages safetensors topology)

# clang with libFuzzer's runtime (Debian: clang, libclang-rt-dev), installed when missing.
have_libfuzzer() {
  command -v clang++ >/dev/null 2>&1 || return 1
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null >/dev/null 2>&1
}
toolchain() {
  have_libfuzzer && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clang libclang-rt-dev ||
    return 1
  have_libfuzzer
}

build() {
  scripts/deps.sh
  toolchain || { echo "fuzz.sh: clang with libFuzzer is not available" >&2; exit 1; }
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DSPECMESH_FUZZ=ON -DSPECMESH_TESTS=OFF -DSPECMESH_BENCH=OFF >/dev/null
  ninja -C build-fuzz -j "$(nproc)" "$@"
}

case "${1:-}" in
  --toolchain)
    toolchain
    exit
    ;;
  --seeds)
    build fuzz_seeds
    build-fuzz/fuzz/fuzz_seeds own . fuzz/corpus
    du -sh fuzz/corpus/*
    exit
    ;;
esac

seconds="${1:-60}"
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all_targets[@]}")
build "${targets[@]/#/fuzz_}" fuzz_seeds

refdata="${SPECMESH_REFDATA:-../shared/refdata}"
if [ -f "$refdata/llama2c/tok512.bin" ]; then
  build-fuzz/fuzz/fuzz_seeds refdata "$refdata" build-fuzz/seeds
else
  echo "fuzz.sh: no reference data at $refdata (or SPECMESH_REFDATA): fuzzing from the committed seeds only" >&2
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
failed=()
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t" "build-fuzz/crashes/$t"
  dict=()
  [ -f "fuzz/$t.dict" ] && dict=("-dict=fuzz/$t.dict")
  # What earlier runs found grows with every run: past 1000 inputs it is cut down to a subset
  # with the same coverage (libFuzzer's merge), so loading it never eats the time budget.
  if [ "$(find "build-fuzz/corpus/$t" -type f | wc -l)" -gt 1000 ]; then
    rm -rf "build-fuzz/corpus/$t.min" && mkdir "build-fuzz/corpus/$t.min"
    "build-fuzz/fuzz/fuzz_$t" -merge=1 "build-fuzz/corpus/$t.min" "build-fuzz/corpus/$t" 2>"build-fuzz/fuzz_$t.merge.log"
    rm -rf "build-fuzz/corpus/$t" && mv "build-fuzz/corpus/$t.min" "build-fuzz/corpus/$t"
  fi
  echo "== fuzz_$t: ${seconds}s"
  # One process at a time: -jobs/-workers stay at 1.
  seeds=()
  [ -d "build-fuzz/seeds/$t" ] && seeds=("build-fuzz/seeds/$t")
  if "build-fuzz/fuzz/fuzz_$t" "build-fuzz/corpus/$t" "fuzz/corpus/$t" "${seeds[@]}" "${dict[@]}" \
      -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="build-fuzz/crashes/$t/" 2>"build-fuzz/fuzz_$t.log"; then
    grep -E '^Done|^stat::(average_exec_per_sec|new_units_added)' "build-fuzz/fuzz_$t.log" || true
  else
    failed+=("$t")
    tail -n 60 "build-fuzz/fuzz_$t.log" >&2
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: ${failed[*]} failed; inputs in build-fuzz/crashes/" >&2
  exit 1
fi
