#!/usr/bin/env bash
# The GPU checks in order of priority within one deadline: each stage is cut where the deadline
# falls, so that the most important results come first. Run from the repository root on a CUDA
# machine with torch and Triton installed (no package registry needed):
#
#   bash benchmarks/tools/gpu_checks_in_order.sh [STAGE...]   (default: every stage, in this order)
#
#   install    build the C++ extension (CUDA kernels for the GPU present, TORCH_CUDA_ARCH_LIST) in place
#   check      the gpu suite's install check: every kernel family on the GPU against float64
#   packed     the packed-launch and native-call tests on the GPU (launches from C++,
#              csrc/launch/triton_launch.cpp: bitwise Triton's results, on a side stream and in a CUDA graph;
#              native calls, csrc/launch/native_calls.cpp: bitwise the Python kernels' results); where either
#              fails, the remaining stages run with TRANSFORMER_FAST_NATIVE_LAUNCH=0
#   atomic_dq  the attention backward with dQ added atomically by the dK/dV kernel
#              (TRANSFORMER_FAST_ATOMIC_DQ=1, opt-in): its gpu tests, then device time per kernel of
#              one forward+backward without it and with it, each against torch's (tools/profile_attention_gpu)
#   layer_norm the sweep's LayerNorm rows on the GPU, ours against torch
#   attention_rows the sweep's softmax attention rows on the GPU (N = 1k-16k, bf16, B=4 H=16 D=64):
#              ours against torch's SDPA as it chooses
#   fwd_tiles  the attention forward's candidate tiles timed alone, D = 64 and 128, causal and not
#              (tools/sweep_attention_tiles_gpu --kernels fwd): its table was chosen by spills, not time
#   tests      the gpu-marked tests without the attention and linear-attention full grids (the
#              LayerNorm grid is short and stays in), 14 workers
#   ln_bwd     the LayerNorm backward's tile choices and its partial sums' reduction tiles against its
#              table (tools/sweep_layer_norm_bwd_gpu)
#   attention  target_gpu_attention, bf16, N = 4k and 16k, against torch's SDPA as it chooses
#   llama      the Llama-like decoder on the GPU (bf16 autocast): training steps and `generate`,
#              progress and any traceback logged whole to $OUT/llama.log (up to 300 s: each
#              `generate` of 256 tokens takes seconds of host time, and a row runs it 14 times or more)
#   models     the encoder-decoder and BERT on the GPU (bf16 autocast)
#   host       host time per call, ours and torch's, tiny and sweep-sized (tools/profile_host_gpu)
#   kernels    device time per kernel of one forward+backward, ours and torch's (tools/profile_attention_gpu)
#   ncu        Nsight Compute on one forward+backward at D=64, N=4096, ours and torch's kernels
#   direct     the direct-launch test on the GPU (bitwise Triton's results); where it fails, the
#              remaining stages run with TRANSFORMER_FAST_DIRECT_LAUNCH=0, so the run still measures
#   host_direct the tiny rows again with TRANSFORMER_FAST_NATIVE_LAUNCH=0: what packed launches and
#              native calls save
#   host_run   the tiny rows again with TRANSFORMER_FAST_DIRECT_LAUNCH=0 (every launch through
#              Triton's JITFunction.run): what the direct launches (kernels/_launch.py) save
#   grids      the full grids of the gpu tests, in what time is left
#
# `python -m benchmarks.run --only gpu` is the complete run; this is its order of priority when
# there is time for only part of it. Logs go to $OUT (default /tmp/gpu_checks); result files to
# $OUT/results; both are packed into $OUT/results.tar after each stage, so that what finished is
# kept when a later stage is cut (and can be copied back as one file). DEADLINE (seconds, default
# 570) bounds the whole call; TESTS_K replaces the tests stage's -k expression, HOST_ARGS adds
# options to the host stage. Where the tree was copied without its own .git, set
# TRANSFORMER_FAST_GIT_COMMIT to the commit it holds, for the result files.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT/results"
exec > >(tee -a "$OUT/main.log") 2>&1
export PYTHONUNBUFFERED=1 MAX_JOBS=16
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}

left() { echo $((DEADLINE - SECONDS)); }
cap() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }  # at most $1 seconds, within the deadline
pack() { (cd "$OUT" && tar -cf results.tar results $(ls *.log 2>/dev/null)); }
BENCH=(python3 -m benchmarks.run --out "$OUT/results" --no-progress --no-plots)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)

stage_install() {
    python3 -m pip install -v --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
    echo "pip exit $? at ${SECONDS}s"
    python3 -c "import torch, triton, transformers, transformer_fast as tf; from transformer_fast import _build; \
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, \
'|', torch.cuda.get_device_name(), '| C++ CUDA families', _build.extension().cuda_families(), \
'| backends', tf.available_backends())"
}
stage_check() { timeout -s INT "$(cap 120)" python3 -m benchmarks.run --only gpu --gpu-steps install \
    --out "$OUT/results" --no-progress; }
# The gpu tests of tests/test_direct_launch.py matching $2, logged to $OUT/$1.log, within $3 seconds
# (default 90); pytest's status.
launch_test() {
    timeout -s INT "$(cap "${3:-90}")" python3 -m pytest -m gpu tests/test_direct_launch.py -k "$2" -q -rfE --tb=short \
        -p no:cacheprovider >"$OUT/$1.log" 2>&1
    local rc=$?
    echo "$1-launch test exit $rc"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/$1.log" | tail -10
    return $rc
}
stage_direct() {
    launch_test direct direct_launches ||
        { export TRANSFORMER_FAST_DIRECT_LAUNCH=0; echo "direct launches off from here on"; }
}
stage_packed() {
    [ "${TRANSFORMER_FAST_DIRECT_LAUNCH:-1}" = 0 ] && { echo "packed: skipped (direct launches off)"; return; }
    launch_test packed "packed_launches or native_calls" 150 ||
        { export TRANSFORMER_FAST_NATIVE_LAUNCH=0; echo "packed launches and native calls off from here on"; }
}
stage_tests() {
    timeout -s INT "$(cap 170)" python3 -m pytest -m gpu tests -k "${TESTS_K:-not full_grid or layer_norm}" -n 14 -q -rfE --tb=short \
        -p no:cacheprovider --durations=10 >"$OUT/tests.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -40
}
stage_host() {
    timeout -s INT "$(cap 90)" python3 -m benchmarks.tools.profile_host_gpu --top 20 ${HOST_ARGS:-} >"$OUT/host.log" 2>&1
    echo "profile_host_gpu exit $?"
    grep -E "^(tiny|large) " "$OUT/host.log"
}
stage_host_direct() {
    TRANSFORMER_FAST_NATIVE_LAUNCH=0 timeout -s INT "$(cap 45)" python3 -m benchmarks.tools.profile_host_gpu \
        --shapes tiny --no-cprofile >"$OUT/host_direct.log" 2>&1
    echo "profile_host_gpu (packed launches and native calls off) exit $?"
    grep -E "^tiny " "$OUT/host_direct.log"
}
stage_host_run() {
    TRANSFORMER_FAST_DIRECT_LAUNCH=0 timeout -s INT "$(cap 45)" python3 -m benchmarks.tools.profile_host_gpu \
        --shapes tiny --no-cprofile >"$OUT/host_run.log" 2>&1
    echo "profile_host_gpu (direct launches off) exit $?"
    grep -E "^tiny " "$OUT/host_run.log"
}
stage_attention() { timeout -s INT "$(cap 150)" "${BENCH[@]}" --only target_gpu_attention --dtype bfloat16 \
    --seq-lens 4096 16384 --gpu-rounds 3 2>&1 | tail -20; }
stage_attention_rows() {
    timeout -s INT "$(cap 120)" "${BENCH[@]}" --device cuda --budget 0.5 --only attention:ours_softmax attention:torch_sdpa \
        2>&1 | grep -E "^\| |^wrote|Error|error" | head -40
}
stage_fwd_tiles() {
    timeout -s INT "$(cap 150)" python3 -m benchmarks.tools.sweep_attention_tiles_gpu --kernels fwd --jobs 14 \
        >"$OUT/fwd_tiles.log" 2>&1
    echo "sweep_attention_tiles_gpu exit $?"
    grep -E "^D=|failed" "$OUT/fwd_tiles.log"
}
stage_kernels() {
    timeout -s INT "$(cap 60)" python3 -m benchmarks.tools.profile_attention_gpu >"$OUT/kernels.log" 2>&1
    echo "profile_attention_gpu exit $?"
    grep -E "^==|^  (ours|torch):" "$OUT/kernels.log"
}
stage_atomic_dq() {
    timeout -s INT "$(cap 120)" python3 -m pytest -m gpu tests/test_attention_atomic_dq.py -q -rfE --tb=short \
        -p no:cacheprovider >"$OUT/atomic_dq_tests.log" 2>&1
    echo "atomic dQ tests exit $?"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/atomic_dq_tests.log" | tail -10
    for atomic in 0 1; do
        TRANSFORMER_FAST_ATOMIC_DQ=$atomic timeout -s INT "$(cap 60)" python3 -m benchmarks.tools.profile_attention_gpu \
            >"$OUT/atomic_dq_$atomic.log" 2>&1
        echo "profile_attention_gpu (TRANSFORMER_FAST_ATOMIC_DQ=$atomic) exit $?"
        grep -E "^==|^  (ours|torch):" "$OUT/atomic_dq_$atomic.log"
    done
}
stage_layer_norm() { timeout -s INT "$(cap 60)" "${BENCH[@]}" --only layer_norm --device cuda 2>&1 | tail -14; }
stage_ln_bwd() {
    timeout -s INT "$(cap 120)" python3 -m benchmarks.tools.sweep_layer_norm_bwd_gpu \
        --out "$OUT/results/layer_norm_bwd_sweep.json" >"$OUT/ln_bwd.log" 2>&1
    echo "sweep_layer_norm_bwd_gpu exit $?"
    grep -E "^==|current" "$OUT/ln_bwd.log"
}
stage_models() {
    timeout -s INT "$(cap 150)" "${BENCH[@]}" --only models --device cuda --model-families encdec,bert --budget 1 \
        --repeats 10 --min-repeats 3 2>&1 | tail -12
}
stage_llama() {
    timeout -s INT "$(cap 300)" python3 -X faulthandler -m benchmarks.run --out "$OUT/results" --no-plots \
        --only models --device cuda --model-families llama --budget 1 --repeats 10 --min-repeats 3 \
        >"$OUT/llama.log" 2>&1
    echo "llama exit $? at ${SECONDS}s"
    grep -E "^  llama|^wrote" "$OUT/llama.log"
}
stage_ncu() {
    timeout -s INT "$(cap 120)" "${NCU:-ncu}" --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 -m benchmarks.tools.profile_attention_gpu --ncu --head-dims 64 --causal no >"$OUT/ncu.log" 2>&1
    echo "ncu exit $?"
    grep -E "^  [a-z_A-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per" \
        "$OUT/ncu.log" | head -60
}
stage_grids() {
    timeout -s INT "$(cap 600)" python3 -m pytest -m gpu tests -k "full_grid" -n 14 -q -rfE --tb=short \
        -p no:cacheprovider >"$OUT/grids.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/grids.log" | tail -20
}

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,utilization.gpu --format=csv,noheader
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install check packed atomic_dq layer_norm attention_rows fwd_tiles tests ln_bwd attention llama models host kernels ncu direct host_direct host_run grids)
for stage in "${stages[@]}"; do
    if [ "$(left)" -le 5 ]; then echo "== $stage: skipped, deadline reached"; continue; fi
    echo "== $stage (at ${SECONDS}s, $(left)s left)"
    "stage_$stage"
    pack
done
echo "== done at ${SECONDS}s"
