#!/usr/bin/env bash
# One call of the `device` tool on a lent GPU machine: `bash benchmarks/gpu_lease.sh STAGE...`,
# run from the repository root. Each stage writes its log under $OUT (what comes back), and the
# whole call stops before DEADLINE seconds (default 570, inside the tool's 600-second limit).
#
#   install   build the C++ extension with its CUDA kernels for sm_90 (or, where a build from an
#             earlier call was carried in .gpu/, reuse it) and install the package in place
#   tests     the `gpu`-marked tests, 14 workers, cut at the deadline (junit XML + log)
#   rerun     only the tests named in .gpu/rerun.txt (one node id per line)
#   memcheck  compute-sanitizer memcheck over a few C++ CUDA grid cases and the dropout test
#   bench     the Triton attention grid against torch's flash backend (issue #3's grid)
#   bench-cpp the C++ backend's CUDA kernels, N = 1k and 2k
#   bench-run linear attention, LayerNorm and the training step (benchmarks.run)
#   profile   host time of small calls (benchmarks.profile_host_gpu)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_lease_out}
mkdir -p "$OUT"
DEADLINE=${DEADLINE:-570}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
left() { echo $((DEADLINE - SECONDS)); }
so_name() { python3 -c "import sysconfig; print('_C' + sysconfig.get_config_var('EXT_SUFFIX'))"; }

stage_install() {
    local so; so=$(so_name)
    if [ -f ".gpu/$so" ]; then
        cp ".gpu/$so" "transformer_fast/$so"
        TRANSFORMER_FAST_NO_BUILD=1 python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
    else
        python3 -m pip install -v --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
        # without debug symbols it fits the 16 MiB a returned file may have (carry it back in .gpu/)
        strip --strip-debug -o "$OUT/$so" "transformer_fast/$so" || echo "no transformer_fast/$so was built"
    fi
    python3 -c "import transformer_fast._C as c, torch, triton; print('extension cuda families', c.cuda_families(), \
'| torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
    echo "install done at ${SECONDS}s"
}

run_pytest() {  # run_pytest LOGNAME WORKERS ARGS...: cut by SIGINT at the deadline, so the summary still prints
    local log=$1 workers=$2; shift 2
    timeout -s INT "$(left)" python3 -m pytest -n "$workers" -q -rfEp --tb=short -p no:cacheprovider \
        --durations=15 --junitxml="$OUT/$log.xml" "$@" >"$OUT/$log.log" 2>&1
    echo "pytest $log exit $? at ${SECONDS}s"
    grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/$log.log" | tail -40
}

stage_tests() { run_pytest tests 14 tests -m gpu; }
stage_rerun() { mapfile -t ids <.gpu/rerun.txt; run_pytest rerun 14 "${ids[@]}"; }

stage_memcheck() {
    # The CPU emulation of the CUDA kernels cannot see out-of-bounds reads; memcheck can.
    timeout -s INT "$(left)" compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -x \
        -p no:cacheprovider tests/test_attention.py \
        -k "cpp_cuda_grid and (40-dtype1-True or 256-dtype2-False or 80-dtype0-True) \
or cpp_cuda_dropout" >"$OUT/memcheck.log" 2>&1
    echo "memcheck exit $? at ${SECONDS}s"
    grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/memcheck.log" | tail -20
}

stage_bench() {
    timeout -s INT "$(left)" python3 -m benchmarks.bench_attention_gpu --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -90
}
stage_bench_cpp() {
    timeout -s INT "$(left)" python3 -m benchmarks.bench_attention_gpu --backend cpp --seq-lens 1024 2048 \
        --rounds 3 --out "$OUT" 2>&1 | tee "$OUT/bench-cpp.log" | tail -40
}
stage_bench_run() {
    # No plots: $OUT returns at most 8 files. Make them here from the JSON with benchmarks.report.write_all.
    timeout -s INT "$(left)" python3 -m benchmarks.run --out "$OUT" --no-progress --no-plots 2>&1 \
        | tee "$OUT/bench-run.log" | tail -60
}

stage_profile() {  # the per-call table is printed first; the cProfile listings stay in the log
    timeout -s INT "$(left)" python3 -m benchmarks.profile_host_gpu >"$OUT/profile.log" 2>&1
    echo "profile exit $? at ${SECONDS}s"
    grep -E "^(layer_norm|attention) " "$OUT/profile.log"
}

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
for stage in "$@"; do
    echo "== $stage (at ${SECONDS}s, $(left)s left)"
    "stage_${stage//-/_}"
done
