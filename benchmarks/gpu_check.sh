#!/usr/bin/env bash
# gpu_check.sh — the one device check of kvq's CUDA side: tests, sanitizers, benchmarks and
# the PyTorch peer in one run (90–110 s of command on an H200 on 2026-12-04; BM_Step, the
# pipeline and split sweeps, the page-16 runs, the engine example and a third profile were
# added since, unmeasured: allow ~5 minutes; give the device command its 600 s, the script keeps to
# KVQ_GPU_CHECK_BUDGET below).
#
#   benchmarks/gpu_check.sh --prepare [DIR]   on a build machine (nvcc, GoogleTest,
#       Google Benchmark; no GPU needed): builds the sm_90 binaries with static cudart and
#       static libstdc++, writes the ptxas table of every kernel they instantiate
#       (registers, spills, shared memory; with `cuobjdump`, the static SASS size of each
#       tensor-core decode kernel's token loop) to DIR/ptxas.txt, and stages the binaries,
#       libbenchmark and ../shared/bench/torch_sdpa_peer.py into DIR (default
#       build-gpu/stage, ~40 MiB).
#   benchmarks/gpu_check.sh [DIR]             on the GPU machine: host and device tests, the
#       engine example (examples/cuda, which checks itself against the CPU),
#       bench_cuda_decode, the torch peer, three Nsight Compute profiles (sections and stall
#       reasons; K4V2 and fp16 pages at 16 x 32K, K4V2 at 1 x 32K), one table per shape (µs,
#       GB/s on packed bytes, % of the device copy, × over torch's BF16 SDPA, all from this
#       run; appends as % of a decode step, append + decode steps with and without
#       programmatic dependent launch and slot_mapping, the pipeline and split sweeps; the
#       token loops' static SASS size from ptxas.txt beside them), then
#       compute-sanitizer memcheck and racecheck on a subset, and the table again. Logs, JSON
#       and the profiles go to $KVQ_GPU_CHECK_OUT (default $OUT, else /tmp)/kvq_gpu_check:
#       summary.txt, bench.json, peer.json, ptxas.txt and tests.log as files, everything else
#       (bench.txt, peer.txt, sanitizer logs, Nsight Compute output) in extras.tgz.
#       KVQ_GPU_CHECK_SASS=1 adds ncu's per-SASS-instruction stall samples of the
#       profiled kernels (src_*.csv; to read against `cuobjdump -sass` of the same binary).
#
# KVQ_GPU_CHECK_BUDGET (seconds, default 540: the device tool stops a command at 600) bounds
# the run after the tests: each later step's timeout is cut to what is left, the
# benchmarks, the peer and the profiles leave the last 200 s to the two sanitizer runs
# (memcheck leaves at least 70 of them to racecheck), and a step without its time is skipped and
# says so (a skipped example or sanitizer run fails the check, a skipped benchmark does not).
# Only bench_cuda_decode runs with the staged lib/ on LD_LIBRARY_PATH (its libbenchmark and
# the C++ runtime that was built against): python3, ncu and compute-sanitizer keep the
# device machine's own.
#
# Exit status: 0 when every test and sanitizer run passed (benchmarks never fail the check).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)

if [ "${1:-}" = "--prepare" ]; then
  stage=${2:-build-gpu/stage}
  build=$(dirname "$stage")
  set -eo pipefail
  mkdir -p "$build"
  cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_CUDA_FLAGS="-Xptxas=-v" \
        -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" > "$build/configure.log"
  # -Xptxas=-v prints every kernel's resources while compiling: rebuild the CUDA objects
  # so that the log holds all of them.
  find "$build" -path '*CMakeFiles*' -name '*.cu.o' -delete
  rc=0
  cmake --build "$build" -j"${JOBS:-2}" --target test_cuda_plan test_cuda_kernels bench_cuda_decode kvq_cuda_engine \
    > "$build/build.log" 2>&1 || rc=$?
  grep -v -e "ptxas info" -e "bytes stack frame" "$build/build.log" | tail -15
  [ $rc -eq 0 ] || { echo "gpu_check --prepare: build failed (log: $build/build.log)"; exit 1; }
  mkdir -p "$stage/lib"
  cp "$build/tests/cuda/test_cuda_plan" "$build/tests/cuda/test_cuda_kernels" \
     "$build/benchmarks/cuda/bench_cuda_decode" "$build/examples/cuda/kvq_cuda_engine" "$stage/"
  peer="$here/../shared/bench/torch_sdpa_peer.py"
  if [ -f "$peer" ]; then cp "$peer" "$stage/"; else echo "!! $peer not found: the run will have no torch peer"; fi
  # Google Benchmark is only available as a shared library here; ship it with the C++
  # runtime it was built against (glibc itself is taken from the GPU machine).
  for lib in $(ldd "$stage/bench_cuda_decode" | awk '/libbenchmark|libstdc\+\+|libgcc_s/ {print $3}'); do
    cp -L "$lib" "$stage/lib/"
  done
  # ptxas table: one line per sm_90 kernel (demangled), deduplicated over translation units;
  # with `cuobjdump` and `nvdisasm` ($CUDA_BIN or PATH; the PyPI wheels nvidia-cuda-cuobjdump
  # and nvidia-cuda-nvdisasm have them) also the static SASS of each tensor-core decode
  # kernel's token loop in bench_cuda_decode: the smallest backward branch around all its
  # MMAs, one iteration per warp 32-token tile; its size, per token (÷ 32), its compute
  # part (what follows the next tile's issue: the target of the loop's first forward branch
  # that skips a third of it), its spill instructions, and its instruction mix below the
  # table. A static count includes the in-line paths most tiles skip (partial tiles,
  # rescales, masks; blocks placed after the loop are not counted): a proxy for the
  # executed count.
  export PATH="${CUDA_BIN:+$CUDA_BIN:}$PATH"
  sass=""
  if command -v cuobjdump > /dev/null && command -v nvdisasm > /dev/null; then
    if cuobjdump -sass "$stage/bench_cuda_decode" > "$build/sass.raw"; then sass="$build/sass.raw"
    else echo "!! cuobjdump -sass failed: the ptxas table has no token-loop SASS"; fi
  else
    echo "!! cuobjdump/nvdisasm not found: the ptxas table has no token-loop SASS"
  fi
  python3 - "$build/build.log" "$sass" > "$stage/ptxas.txt" << 'PY'
import collections, re, subprocess, sys
rows, name = {}, None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Compiling entry function '(\S+)' for 'sm_90'", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name:
        rows.setdefault(name, {}).update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
    m = re.search(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", line)
    if m and name:
        rows.setdefault(name, {}).update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
        name = None
# Token loops of the tensor-core decode kernels, by mangled name.
loops, compute, code, name = {}, {}, {}, None
def opcode(text): return re.sub(r"^@!?U?P\w+ ", "", text).split()[0].split(".")[0]
def target(text):  # a branch's target address, or None
    m = re.search(r"\bBRA(?:\.U)? (?:!?U?P\w+, )?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None
try:  # the table below stands without these columns
    for line in open(sys.argv[2], errors="replace") if sys.argv[2] else []:
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1) if "decode_mma_kernel" in m.group(1) else None
            if name: code[name] = []
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m and name: code[name].append((int(m.group(1), 16), m.group(2)))
    for n, ins in code.items():
        mma = [a for a, t in ins if "HMMA" in t]
        edges = [(a, b) for a, t in ins for b in [target(t)] if b is not None and mma and b <= min(mma) and a >= max(mma)]
        if not edges: continue
        end, begin = min(edges, key=lambda x: x[0] - x[1])
        body = [(a, t) for a, t in ins if begin <= a <= end]
        loops[n] = collections.Counter(opcode(t) for a, t in body)
        skips = [b for a, t in body for b in [target(t)] if b is not None and a < b <= end
                 and sum(a < x < b for x, _ in body) * 3 >= len(body)]
        compute[n] = sum(x >= skips[0] for x, _ in body) if skips else 0
except Exception as e:
    print(f"(token-loop SASS left out: {e!r})", file=sys.stderr)
    loops, compute = {}, {}
names = list(rows)
pretty = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
ROT, META = {"0": "", "1": "H", "2": "R"}, {"0": "fp16", "1": "bf16", "2": "fp32"}
def spec(m, kv):  # QuantSpec{bits, group, rotation, centered, clip‰, meta, seed} → K4g32HC/fp16
    bits, group, rot, cen, clip, meta = m.groups()[:6]
    return (f"{kv}{bits}g{group}{ROT[rot]}{'C' if cen == 'true' else ''}"
            f"{'' if clip == '1000' else 'clip' + clip}/{META[meta]}")
def short(s):  # the kernel and its template arguments, compact
    s = re.sub(r"kvq::(cuda::)?(kernel::)?", "", s)
    s = re.sub(r"\(([^()]*)\)$", "", s).replace("void ", "")
    q = r"QuantSpec\{(\d+), (\d+), \(Rotation\)(\d), (\w+), (\d+), \(MetaType\)(\d), \w+\}"
    s = re.sub(r"Policy\{" + q + ", " + q + r", (\d+)\}",
               lambda m: spec(re.match(q, m.group(0)[7:]), "K") + " " +
               spec(re.search(q + r", (\d+)\}$", m.group(0)), "V") + " d" + m.group(13), s)
    s = s.replace("(DecodePrecision)0", "fast").replace("(DecodePrecision)1", "exact")
    s = re.sub(r", MmaPipeline<(\d), (\d)>", lambda m: "" if m.group(1) == "0" else f", w{m.group(1)}s{m.group(2)}", s)
    s = re.sub(r"DecodeKernelParams<(QuantSource|DenseSource)<([^>]*)>, (\w+), (\w+)>", r"\2, q/o \3", s)
    return re.sub(r">\(.*\)$", ">", s)[:140]
print(f"{'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6} {'loop':>5} {'/tok':>5} {'comp':>5} {'lspill':>6}"
      "  kernel (sm_90)")
for n, p in sorted(zip(names, pretty), key=lambda x: short(x[1])):
    r, c = rows[n], loops.get(n)
    sass = (f"{sum(c.values()):5d} {sum(c.values()) / 32:5.1f} {compute[n]:5d} {c['STL'] + c['LDL']:6d}" if c
            else f"{'':5} {'':5} {'':5} {'':6}")
    print(f"{r.get('regs', -1):4d} {r.get('spill_st', 0):5d}/{r.get('spill_ld', 0):<5d} {r.get('stack', 0):5d} "
          f"{r.get('smem', 0):6d} {sass}  {short(p)}")
if loops:
    print("\ntoken-loop instruction mix (static SASS, top 10):")
    for n, p in sorted(zip(names, pretty), key=lambda x: short(x[1])):
        if n in loops:
            print(f"  {short(p)}\n    " + " ".join(f"{k}:{v}" for k, v in loops[n].most_common(10)))
PY
  # What the stage was built from, so that a run on a stage left from an earlier session says so.
  git -C "$here" describe --always --dirty > "$stage/commit.txt" 2> /dev/null || echo unknown > "$stage/commit.txt"
  echo "staged in $stage (commit $(cat "$stage/commit.txt")):"; ls -la "$stage" "$stage/lib"
  echo "ptxas table ($stage/ptxas.txt):"; cat "$stage/ptxas.txt"
  exit 0
fi

stage=${1:-build-gpu/stage}
# bench_cuda_decode with its staged shared libraries (ncu and the peer keep their own).
bench=(env "LD_LIBRARY_PATH=$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$stage/bench_cuda_decode")
out=${KVQ_GPU_CHECK_OUT:-${OUT:-/tmp}}/kvq_gpu_check
mkdir -p "$out"
status=0
deadline=$((SECONDS + ${KVQ_GPU_CHECK_BUDGET:-540}))
# within N: N seconds, or what is left of the budget when that is less; 0 below 15 s.
within() {
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# budget_for NAME N: sets $t to within N; false (and a line saying so) when NAME is skipped.
budget_for() {
  t=$(within "$2")
  [ "$t" -gt 0 ] || { echo "!! $1 skipped: the ${KVQ_GPU_CHECK_BUDGET:-540} s budget is spent"; return 1; }
}
# before_sanitizers NAME N: the same for a step that must leave 200 s to the sanitizers
# (at least 20 s of its own, else skipped).
before_sanitizers() {
  t=$(within $(($2 + 200)))
  t=$((t - 200))
  [ "$t" -ge 20 ] || { echo "!! $1 skipped: the budget keeps its last 200 s for the sanitizers"; return 1; }
}
echo "stage built from commit $(cat "$stage/commit.txt" 2> /dev/null || echo "unknown (no commit.txt)")"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || echo "nvidia-smi not available"
[ -f "$stage/ptxas.txt" ] && cp "$stage/ptxas.txt" "$out/"

echo "== host-side tests"
timeout -k 10 60 "$stage/test_cuda_plan" --gtest_brief=1 || status=1
echo "== device tests"
timeout -k 10 150 "$stage/test_cuda_kernels" --gtest_brief=1 2>&1 | tee "$out/tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if grep -q "no CUDA device found" "$out/tests.log"; then echo "!! device tests skipped: no CUDA device found"; status=1; fi

echo "== the engine example (examples/cuda: sink + quantized + recent windows, two TP ranks, appends by position and by slot)"
if budget_for "the engine example" 60; then
  timeout -k 10 "$t" "$stage/kvq_cuda_engine" 2>&1 | tee "$out/engine.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! engine example FAILED"; status=1; }
else
  status=1
fi

echo "== benchmarks"
if before_sanitizers "bench_cuda_decode" 240; then
  timeout -k 10 "$t" "${bench[@]}" --benchmark_min_time=0.05 --benchmark_counters_tabular=true \
    --benchmark_out="$out/bench.json" --benchmark_out_format=json > "$out/bench.txt" 2>&1 ||
    echo "!! bench_cuda_decode failed or timed out (the summary reads the runs it finished)"
  tail -5 "$out/bench.txt"
fi

echo "== torch peer"
if [ ! -f "$stage/torch_sdpa_peer.py" ]; then
  echo "!! no torch_sdpa_peer.py in the stage"
elif before_sanitizers "the torch peer" 120; then
  OUT="$out" timeout -k 10 "$t" python3 "$stage/torch_sdpa_peer.py" > "$out/peer.txt" 2>&1 || echo "!! peer failed or timed out"
  tail -3 "$out/peer.txt"
fi

# Why warps wait (per issued instruction), beside the sections.
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard \
  mio_throttle math_pipe_throttle wait barrier not_selected dispatch_stall lg_throttle no_instruction membar \
  branch_resolving drain imc_miss sleeping tex_throttle misc selected)
stalls=${stalls%,}
if command -v ncu > /dev/null; then
  # The large shape (bandwidth) of the quantized and the 16-bit kernels, and one small
  # batch, where a CTA streams few tiles and its prologue, pipeline fill and split merge
  # dominate.
  for run in 'BM_DecodeTC/K4V2_d128_half 16 32768' 'BM_DecodeFP16TC 16 32768' 'BM_DecodeTC/K4V2_d128_half 1 32768'; do
    read -r bench batch ctx <<< "$run"
    tag="${bench//\//_}_${batch}x${ctx}"
    filter="$bench/batch:$batch/ctx:$ctx"
    echo "== Nsight Compute: $bench at $batch x $ctx (one decode launch after warm-up)"
    before_sanitizers "the profile" 60 || continue
    timeout -k 10 "$t" ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --metrics "$stalls" --launch-skip 2 \
      --launch-count 1 -k regex:decode "${bench[@]}" --benchmark_min_time=0.01 \
      --benchmark_filter="$filter" > "$out/ncu_$tag.txt" 2>&1 ||
      echo "!! ncu failed or timed out"
    grep -E "decode|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|stalled" \
      "$out/ncu_$tag.txt" | head -32
    # Where they wait: warp-state samples per SASS instruction (ncu's source page as CSV),
    # to read against `cuobjdump -sass` of the same binary.
    if [ -n "${KVQ_GPU_CHECK_SASS:-}" ]; then
      rep="$out/src_$tag"
      before_sanitizers "the source page" 60 || continue
      timeout -k 10 "$t" ncu --clock-control none --section SourceCounters --launch-skip 2 --launch-count 1 -k regex:decode \
        -f -o "$rep" "${bench[@]}" --benchmark_min_time=0.01 \
        --benchmark_filter="$filter" > /dev/null 2>&1 &&
        ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2> "$rep.err" ||
        echo "!! ncu source page failed ($rep.err)"
    fi
  done
fi

summary() {
echo "== summary (one run: compare the ratios inside it, not absolutes across runs; stage from commit $(cat "$stage/commit.txt" 2> /dev/null || echo unknown))"
if command -v python3 > /dev/null && [ -s "$out/bench.json" ]; then
  python3 - "$out/bench.json" "$out/peer.json" << 'PY'
import json, os, re, sys, collections
def load_bench(path):
    # A run cut by its timeout leaves the JSON open: keep the runs it finished (Google
    # Benchmark writes each run as an object indented by 4 spaces).
    text = open(path).read()
    try:
        return json.loads(text)
    except ValueError:
        end = text.rfind("\n    }")
        data = json.loads(text[:end + 6] + "\n  ]\n}") if end > 0 else {"benchmarks": []}
        print(f"!! {path} was cut short: {len(data['benchmarks'])} runs recovered")
        return data
runs = [b for b in load_bench(sys.argv[1])["benchmarks"]
        if b.get("run_type", "iteration") == "iteration" and "error_occurred" not in b]
copy = max((b["GB/s"] for b in runs if b["name"].startswith("BM_Copy")), default=float("nan"))
print(f"device copy (read+write, bench_cuda_decode): {copy:8.0f} GB/s")
torch = {}  # (batch, ctx) -> best BF16 µs over backends and layouts
if os.path.exists(sys.argv[2]):
    for r in json.load(open(sys.argv[2])):
        if r.get("dtype") == "bfloat16":
            key = (r["batch"], r["ctx"])
            torch[key] = min(torch.get(key, float("inf")), r["us"])
else:
    print("(no peer.json: the x-torch column is empty)")
shapes = collections.OrderedDict()
for b in runs:
    m = re.match(r"BM_(Decode\w*)(?:/([^/]+))?/batch:(\d+)/ctx:(\d+)(?:/page:(\d+))?", b["name"])
    if not m:
        continue
    head, policy, batch, ctx = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
    kind = {"DecodeFP16": "fp16 pages", "DecodeFP16TC": "fp16 pages TC", "DecodeBF16": "bf16 pages",
            "DecodeBF16TC": "bf16 pages TC", "DecodeFP16TCPage": f"fp16 pages TC p{m.group(5)}",
            "DecodePipeFP16TC": f"fp16 TC {policy}", "DecodeTCSplits": f"{policy} TC split",
            "DecodeTCPage": f"{policy} TC p{m.group(5)}",
            "Decode": f"{policy}", "DecodeTC": f"{policy} TC", "DecodeTCExact": f"{policy} TC exact"}.get(head)
    if kind is None:
        print(f"(summary: no table row for {b['name']})")
        continue
    kind = kind.replace("_d128_half", "")
    shapes.setdefault((batch, ctx), []).append((kind, b))
for (batch, ctx), rows in shapes.items():
    t = torch.get((batch, ctx))
    print(f"\n{batch} x {ctx}  (Hkv 8, Hq 32, d 128, page 64; p16: page 16)   torch BF16 SDPA: "
          + (f"{t:.1f} us" if t else "-"))
    # us: host-launched back to back, as the peer is timed (the ratios use it); graph us:
    # the same call replayed from a CUDA graph, the device time without the launch cost.
    print(f"  {'kernel':<18}{'us':>10}{'graph us':>10}{'GB/s':>9}{'%copy':>7}{'x torch':>9}{'splits':>7}")
    for kind, b in rows:
        us = b["real_time"]
        ratio = f"{t / us:9.2f}" if t else f"{'-':>9}"
        print(f"  {kind:<18}{us:10.1f}{b.get('graph_us', float('nan')):10.1f}{b['GB/s']:9.0f}"
              f"{100 * b['GB/s'] / copy:6.0f}%{ratio}{int(b.get('splits', 0)):7d}")
print()
# The sweeps, per shape: the fastest fp16 pipeline and split count against the defaults.
for (batch, ctx), rows in shapes.items():
    by_kind = collections.defaultdict(list)
    for kind, b in rows:
        by_kind[kind].append(b)
    pipes = [(kind, bs[0]["real_time"]) for kind, bs in by_kind.items() if kind.startswith("fp16 TC w")]
    if pipes and "fp16 pages TC" in by_kind:
        kind, us = min(pipes, key=lambda x: x[1])
        default = by_kind["fp16 pages TC"][0]["real_time"]
        print(f"{batch} x {ctx}: fastest fp16 pipeline {kind[8:]} {us:.1f} us, default (w2s2) {default:.1f} us"
              f" ({default / us:.2f}x)")
    for kind, bs in by_kind.items():
        if kind.endswith(" TC split") and len(bs) > 1:
            best = min(bs, key=lambda b: b["real_time"])
            suggested = next((b for b in bs if b["name"].split("/splits:")[1].startswith("0")), bs[0])
            print(f"{batch} x {ctx}: {kind[:-9]} fastest at {int(best['splits'])} splits {best['real_time']:.1f} us,"
                  f" suggested {int(suggested['splits'])} splits {suggested['real_time']:.1f} us"
                  f" ({suggested['real_time'] / best['real_time']:.2f}x)")
print()
times = {b["name"].replace("/manual_time", ""): b["real_time"] for b in runs}
for b in runs:
    if b["name"].startswith("BM_Append"):
        name = b["name"].replace("/manual_time", "")
        line = f"{name:<40} {b['real_time']:9.1f} us  {b['Mtok/s']:8.2f} Mtok/s"
        m = re.match(r"BM_Append/(\w+)/tokens:64(/slots:\d)?$", name)
        step = times.get(f"BM_DecodeTC/{m.group(1)}/batch:64/ctx:4096") if m else None
        if step:  # one decode step of 64 sequences appends 64 tokens
            line += f"   {100 * b['real_time'] / step:5.1f}% of the 64 x 4K TC decode step"
        print(line)
print()
for b in runs:  # append + decode on one stream, without and with PDL
    if b["name"].startswith("BM_Step"):
        name = b["name"].replace("/manual_time", "")
        print(f"{name:<40} step {b['step_us']:8.1f} us, decode alone {b['decode_us']:8.1f} us: append "
              f"{b['append_%']:5.1f}%   graph: step {b['graph_us']:8.1f} us, append {b['graph_append_%']:5.1f}%")
PY
else
  echo "(python3 missing or no benchmark JSON; raw output in $out/bench.txt)"
fi
# Beside the measured times, the static size of each benched tensor-core kernel's token
# loop (from --prepare's ptxas.txt; a warp's 32-token tile, rarely taken paths included).
sass_rows='NR > 1 && $5 ~ /^[0-9]+$/ && $6 ~ /^[0-9.]+$/ && $7 ~ /^[0-9]+$/ && $8 ~ /^[0-9]+$/'
if [ -f "$stage/ptxas.txt" ] && awk "$sass_rows" "$stage/ptxas.txt" | grep -q .; then
  echo; echo "token-loop static SASS (loop, per token, compute part, spill instructions; ptxas.txt):"
  awk "$sass_rows"' {k = $9; for (i = 10; i <= NF; ++i) k = k " " $i; printf "  %5d %5.1f %5d %3d  %s\n", $5, $6, $7, $8, k}' \
    "$stage/ptxas.txt"
fi
}
summary | tee "$out/summary.txt"

# compute-sanitizer on the tests of one policy per kernel (both decode kernels, split-KV,
# append, dense pages, merge, NaN rows); racecheck on the kernels that share memory.
memcheck_set='CudaAppend.K4V2_d128_half:CudaDecode.K4V2_d128_half:CudaDecode.OneWorkspace*:CudaDecodeTensorCore.K4V2_d128_half:CudaDenseDecode.dense_d128_half:CudaDenseDecodeTensorCore.dense_d128_half:CudaMergeStates.dense_d128_half:CudaDecode.NaN*:CudaDependentLaunch.*'
racecheck_set='CudaDecode.K4V2_d128_half:CudaDecodeTensorCore.K4V2_d128_half:CudaDenseDecodeTensorCore.dense_d128_half'
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    set_var=${tool}_set
    echo "== compute-sanitizer --tool $tool (${!set_var})"
    # memcheck leaves racecheck at least 70 s (its timeout's 10 s kill grace included).
    reserve=$([ $tool = memcheck ] && echo 80 || echo 0)
    t=$(within $((130 + reserve)))
    t=$((t - reserve))
    [ "$t" -ge 15 ] || { echo "!! compute-sanitizer --tool $tool skipped: the budget is spent"; status=1; continue; }
    timeout -k 10 "$t" compute-sanitizer --tool "$tool" --error-exitcode 3 "$stage/test_cuda_kernels" --gtest_brief=1 \
      --gtest_filter="${!set_var}" > "$out/$tool.log" 2>&1
    rc=$?
    tail -4 "$out/$tool.log"
    # A filter that matches no test passes: clean only with tests run (GoogleTest's
    # "[  PASSED  ] N tests.", N > 0). 3 is the tool's own finding; a test that fails
    # under it prints GoogleTest's FAILED lines; anything else is the tool not running
    # (a refused device, a bad option): a failed check, but no verdict on the kernels.
    if [ $rc -eq 0 ] && ! grep -q -E '^\[  PASSED  \] [1-9][0-9]* test' "$out/$tool.log"; then rc=4; fi
    if [ $rc -ne 0 ] && [ $rc -ne 3 ] && [ $rc -ne 4 ] && [ $rc -lt 124 ] && grep -q -E '^\[  FAILED  \]' "$out/$tool.log"; then rc=5; fi
    case $rc in 0) echo "$tool: clean";; 3) echo "!! $tool: FAILED (errors reported; $tool.log in extras.tgz)";;
      4) echo "!! $tool: no test ran";; 5) echo "!! $tool: a test FAILED under it";;
      124|137) echo "!! $tool: timed out after $t s";;
      *) echo "!! $tool: did not run (exit $rc; see $tool.log in extras.tgz): no verdict on the kernels";; esac
    [ $rc -eq 0 ] || status=1
  done
else
  echo "!! compute-sanitizer not found"; status=1
fi

# A device machine may return only a few files: keep the tables plain, pack the rest.
(cd "$out" && extras=$(ls | grep -v -x -E 'summary.txt|bench.json|peer.json|ptxas.txt|tests.log|extras.tgz') &&
  [ -n "$extras" ] && tar czf extras.tgz $extras && rm -f $extras)
cat "$out/summary.txt"
echo "gpu_check: tests $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
