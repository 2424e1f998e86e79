#!/usr/bin/env bash
# gpu_check.sh — the one device check of kvq's CUDA side (tests + benchmarks), ≤ 8 min.
#
#   benchmarks/gpu_check.sh --prepare [DIR]   on a build machine (nvcc, GoogleTest,
#       Google Benchmark; no GPU needed): builds the sm_90 binaries with static cudart,
#       static libstdc++, and stages them with libbenchmark into DIR (default
#       build-gpu/stage, a few MiB).
#   benchmarks/gpu_check.sh [DIR]             on the GPU machine: runs the host and
#       device tests, then the benchmarks, and prints a short table last. Logs and the
#       benchmark JSON go to $KVQ_GPU_CHECK_OUT (default $OUT, else /tmp)/kvq_gpu_check.
#
# Exit status: 0 when every test passed (benchmarks never fail the check).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)

if [ "${1:-}" = "--prepare" ]; then
  stage=${2:-build-gpu/stage}
  build=$(dirname "$stage")
  set -e
  mkdir -p "$build"
  cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" > "$build/configure.log"
  cmake --build "$build" -j"${JOBS:-2}" --target test_cuda_plan test_cuda_kernels bench_cuda_decode
  mkdir -p "$stage/lib"
  cp "$build/tests/cuda/test_cuda_plan" "$build/tests/cuda/test_cuda_kernels" \
     "$build/benchmarks/cuda/bench_cuda_decode" "$stage/"
  # Google Benchmark is only available as a shared library here; ship it with the C++
  # runtime it was built against (glibc itself is taken from the GPU machine).
  for lib in $(ldd "$stage/bench_cuda_decode" | awk '/libbenchmark|libstdc\+\+|libgcc_s/ {print $3}'); do
    cp -L "$lib" "$stage/lib/"
  done
  echo "staged in $stage:"; ls -la "$stage" "$stage/lib"
  exit 0
fi

stage=${1:-build-gpu/stage}
export LD_LIBRARY_PATH="$stage/lib:${LD_LIBRARY_PATH:-}"
out=${KVQ_GPU_CHECK_OUT:-${OUT:-/tmp}}/kvq_gpu_check
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || echo "nvidia-smi not available"

echo "== host-side tests"
timeout 60 "$stage/test_cuda_plan" --gtest_brief=1 || status=1
echo "== device tests"
timeout 240 "$stage/test_cuda_kernels" --gtest_brief=1 2>&1 | tee "$out/tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if grep -q "no CUDA device found" "$out/tests.log"; then echo "!! device tests skipped: no CUDA device found"; status=1; fi

echo "== benchmarks"
timeout 220 "$stage/bench_cuda_decode" --benchmark_min_time=0.1 --benchmark_counters_tabular=true \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json 2>&1 | tee "$out/bench.txt" | tail -60

echo "== summary (one run: compare the ratios inside it, not absolutes across runs)"
if command -v python3 > /dev/null && [ -s "$out/bench.json" ]; then
  python3 - "$out/bench.json" << 'PY'
import json, sys, collections
runs = [b for b in json.load(open(sys.argv[1]))["benchmarks"] if b.get("run_type", "iteration") == "iteration" and "error_occurred" not in b]
copy = max((b["GB/s"] for b in runs if b["name"].startswith("BM_Copy")), default=float("nan"))
print(f"device copy (read+write): {copy:8.0f} GB/s")
dec = collections.OrderedDict()
for b in runs:
    n = b["name"]
    if n.startswith("BM_Decode"):
        head, rest = n.split("/", 1)
        if head in ("BM_DecodeFP16", "BM_DecodeFP16TC"):  # the 16-bit baselines
            kind, shape = ("FP16" if head == "BM_DecodeFP16" else "TC FP16"), rest
        else:  # BM_Decode/<policy>/... (CUDA cores) or BM_DecodeTC/<policy>/... (tensor cores)
            kind, shape = rest.split("/", 1)
            if head == "BM_DecodeTC":
                kind = "TC " + kind
        shape = shape.replace("/manual_time", "")
        dec.setdefault(shape, {})[kind.replace("_d128_half", "")] = b
kinds = []
for s in dec.values():
    for k in s:
        if k not in kinds: kinds.append(k)
# xFP16: speed over the 16-bit baseline of the same kernel kind (CUDA cores vs CUDA
# cores, tensor cores vs tensor cores), i.e. equal engineering.
hdr = f"{'batch/ctx':<22}" + "".join(f"{k+' GB/s':>14}{'%copy':>7}{'xFP16':>7}" for k in kinds)
print(hdr)
for shape, s in dec.items():
    line = f"{shape:<22}"
    for k in kinds:
        b = s.get(k)
        if not b:
            line += f"{'-':>14}{'':>7}{'':>7}"; continue
        bf = s.get("TC FP16" if k.startswith("TC ") else "FP16")
        gbs = b["GB/s"]
        speed = bf["real_time"] / b["real_time"] if bf else float("nan")
        line += f"{gbs:14.0f}{100*gbs/copy:6.0f}%{speed:7.2f}"
    print(line)
for b in runs:
    if b["name"].startswith("BM_Append"):
        print(f"{b['name'].replace('/manual_time',''):<40} {b['real_time']:9.1f} us  {b['Mtok/s']:8.2f} Mtok/s")
PY
else
  echo "(python3 missing or no benchmark JSON; raw output in $out/bench.txt)"
fi
echo "gpu_check: tests $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
