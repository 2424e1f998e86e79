#!/usr/bin/env bash
# Bounded libFuzzer run of the GGUF reader under ASan+UBSan.
#   tests/io/run_fuzz_gguf.sh <cmake-build-dir> [seconds=60]
# Builds the kvq_fuzz_gguf target (needs clang++), then fuzzes from the committed seeds
# with a scratch corpus. Exit status is non-zero on any crash, leak or sanitizer report.
set -euo pipefail
BUILD="${1:?usage: run_fuzz_gguf.sh <build-dir> [seconds]}"
SECS="${2:-60}"
HERE="$(cd "$(dirname "$0")" && pwd)"
cmake --build "${BUILD}" --target kvq_fuzz_gguf
BIN="$(find "${BUILD}" -name kvq_fuzz_gguf -type f -perm -u+x | head -n1)"
[[ -n "${BIN}" ]] || { echo "kvq_fuzz_gguf not built (is clang++ available?)" >&2; exit 1; }
CORPUS="$(mktemp -d)"
trap 'rm -rf "${CORPUS}"' EXIT
"${BIN}" -max_total_time="${SECS}" -max_len=4096 -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 "${CORPUS}" "${HERE}/fuzz_gguf_seeds"
