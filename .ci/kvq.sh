#!/usr/bin/env bash
# kvq developer entry point; the README's two commands call it.
#
#   .ci/kvq.sh main   the main job: policy comparison on a synthetic layer (quickstart), then
#                     rotations vs OptR on the committed real SmolLM2 activations (calib_compare;
#                     markdown, CSV and SVG in build/report/)
#   .ci/kvq.sh test   build everything (CUDA when nvcc is found) and run the whole test suite
#   .ci/kvq.sh asan   CPU tests and the CUDA kernels' host emulator under ASan+UBSan
#   .ci/kvq.sh fuzz   bounded libFuzzer runs of the file readers, safetensors and GGUF (needs clang)
#   .ci/kvq.sh clang  the CPU and attention tests (portable, AVX-512, AVX2) built with clang
#
# Missing Debian packages are installed first (as root, via apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${KVQ_JOBS:-$(nproc)}

deps() {
  local pkgs=(build-essential cmake pkg-config libgtest-dev libgmock-dev libbenchmark-dev libeigen3-dev
              nlohmann-json3-dev libfmt-dev libcli11-dev libpcre2-dev clang libclang-rt-dev python3 unzip)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    echo "kvq: installing ${missing[*]}"
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
  fi
  # nvcc is optional; make a toolkit in the usual place visible.
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
}

build() {  # build <preset> [targets...]; presets are initial caches in cmake/presets/
  local preset=$1; shift
  cmake -S . -B "build/$preset" -C "cmake/presets/$preset.cmake" >/dev/null
  if (($#)); then cmake --build "build/$preset" -j "$JOBS" --target "$@"
  else cmake --build "build/$preset" -j "$JOBS"; fi
}

case "${1:-}" in
  main)
    deps
    build cpu kvq_quickstart calib_compare
    ./build/cpu/examples/kvq_quickstart "${@:2}"
    mkdir -p build/report
    ./build/cpu/benchmarks/calib/calib_compare tests/data/smollm2/activations_l2_15_28.safetensors build/report
    ;;
  test)
    deps
    build default
    ctest --test-dir build/default --output-on-failure -j "$JOBS"
    ;;
  asan)
    deps
    build asan
    # Left out: the package test (it builds consumers, nothing sanitized) and the three longest
    # quality runs (123–175 s each under ASan on 2 cores); the OptR and SmolLM2 tests beside
    # them drive the same code under ASan.
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --test-dir build/asan --output-on-failure -j "$JOBS" \
        -E '^package\.|^OptRReal\.LowersHeldOutLossesOnSmolLM2$|^OptRSynthetic\.VStepsZeroLearnsKeysOnly$|^SmolLM2Forward\.K8V8CacheKeepsNextTokenKLTiny$'
    ;;
  fuzz)
    deps
    build cpu kvq_fuzz_gguf kvq_fuzz_safetensors
    secs=${KVQ_FUZZ_SECONDS:-60}
    # reader:seed corpus (GGUF is the SmolLM2 example's format, tested in tests/model)
    for entry in gguf:tests/model/fuzz_gguf_seeds safetensors:tests/io/fuzz_safetensors_seeds; do
      reader=${entry%%:*}
      mkdir -p "build/fuzz/$reader"
      "./build/cpu/fuzz/kvq_fuzz_$reader" -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048 -timeout=10 \
        "build/fuzz/$reader" "${entry#*:}"
    done
    ;;
  clang)
    deps
    cpu_tests=(test_cpu test_cpu_native test_cpu_avx2 test_attention test_attention_native test_attention_avx2)
    build clang "${cpu_tests[@]}"
    for t in "${cpu_tests[@]}"; do
      bin=$(find build/clang/tests -name "$t" -type f -perm -u+x | head -n1)
      if [ -z "$bin" ]; then echo "kvq: $t was not built (compiler flag missing?)"; continue; fi
      "$bin" --gtest_brief=1
    done
    ctest --test-dir build/clang --output-on-failure -R '^cpu\.prefetch_emitted\.'
    ;;
  *)
    sed -n '2,11p' "$0"
    exit 2
    ;;
esac
