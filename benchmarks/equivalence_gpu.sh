#!/usr/bin/env bash
# Issue 24's measurements on one GPU: verify-equivalence at 1M tokens, chunks of 4096, 3001, 1000 and 777,
# float32 and bf16, before and after the fix, plus the first-divergence diagnosis.
#
#   AFTER=path/to/this/code BEFORE=path/to/main's/code DATA=books/ OUT=results/ \
#       bash benchmarks/equivalence_gpu.sh ITEM...
#
# Items, run in order (each one bounded by a timeout; results are saved after each):
#   train                  a short gutenberg-sparsek run on DATA/train, DATA/valid (stopped by SIGINT after
#                          TRAIN_SECONDS, which saves a checkpoint); its weights also go to OUT in parts
#                          (model.safetensors.part-*, recipe.yaml, tokenizer.json: OUT takes files <= 16 MiB);
#                          with CKPT=folder holding such parts, the checkpoint is rebuilt instead
#   verify:MODEL:TREE:DTYPE  MODEL random (the default model, random tokens) or trained (the checkpoint over
#                          DATA/valid's books as one document); TREE after or before; DTYPE as --dtype
#   diag:MODEL:TREE:DTYPE  benchmarks/equivalence_divergence.py at chunks of 3001
#   tiletest, gemm, gputests   tests/ops/test_tile_invariance.py on CUDA; whether cuBLAS rows depend on the
#                          matmul's row count; tests/gpu
# Results: OUT/log.txt (tee it) and OUT/results.tgz (every JSON).
set -uo pipefail
TOKENS=${TOKENS:-1048576}
CHUNKS="--chunk-size 4096 --chunk-size 3001 --chunk-size 1000 --chunk-size 777"
RES=/tmp/eq_results
RUN=/tmp/gs-run
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 COLUMNS=160
save() { tar -czf "$OUT/results.tgz" -C "$RES" . ; }
tree_dir() { [ "$1" = before ] && echo "${BEFORE:?BEFORE is not set}" || echo "$AFTER"; }
py() { (cd "$1" && shift && PYTHONPATH="/tmp/site:$PWD" "$@"); }

model_args() {  # random | trained
    if [ "$1" = trained ]; then
        [ -f /tmp/doc.txt ] || cat "$DATA"/valid/*.txt > /tmp/doc.txt
        echo "--checkpoint $RUN --text /tmp/doc.txt"
    fi
}

train() {
    if [ -n "${CKPT:-}" ]; then
        echo "=== rebuild the checkpoint from $CKPT"
        py "$AFTER" python benchmarks/equivalence_gpu_ckpt.py rebuild "$CKPT" "$RUN"
        return
    fi
    echo "=== train gutenberg-sparsek for ${TRAIN_SECONDS:-150} s"
    py "$AFTER" timeout -s INT "${TRAIN_SECONDS:-150}" python -m longtrain.cli fit gutenberg-sparsek \
        --run-dir "$RUN" --set data.path="$DATA/train" --set data.valid="$DATA/valid" --set train.valid_every=0 \
        --set checkpoint.every=100000 --set logging.progress=false --set logging.every=100
    echo "(exit $?)"
    cp "$RUN/metrics.jsonl" "$RES/train-metrics.jsonl" 2>/dev/null
    py "$AFTER" python benchmarks/equivalence_gpu_ckpt.py export "$RUN" "$OUT"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
cat "$AFTER/COMMIT" 2>/dev/null

for item in "$@"; do
    IFS=: read -r what model tree dtype <<< "$item"
    case $what in
    train) train ;;
    verify)
        echo "=== verify $model $tree $dtype"
        py "$(tree_dir "$tree")" timeout "${VERIFY_TIMEOUT:-150}" python -m longtrain.cli verify-equivalence \
            --device "${DEVICE:-cuda}" --tokens "$TOKENS" $CHUNKS --dtype "$dtype" --min-agreement 0 --max-logit-diff 1e9 \
            --json "$RES/verify-$model-$tree-$dtype.json" $(model_args "$model")
        echo "(exit $?)" ;;
    diag)
        echo "=== diagnose $model $tree $dtype"
        py "$(tree_dir "$tree")" timeout "${DIAG_TIMEOUT:-120}" python benchmarks/equivalence_divergence.py \
            --device "${DEVICE:-cuda}" --tokens "$TOKENS" --dtype "$dtype" --chunk-size 3001 \
            --json "$RES/diag-$model-$tree-$dtype.json" $(model_args "$model")
        echo "(exit $?)" ;;
    tiletest)
        echo "=== tests/ops/test_tile_invariance.py"
        py "$AFTER" timeout 150 python -m pytest -q -p no:cacheprovider tests/ops/test_tile_invariance.py ;;
    gemm)
        echo "=== do cuBLAS rows depend on the row count?"
        py "$AFTER" timeout 60 python benchmarks/equivalence_gemm_rows.py ;;
    gputests)
        echo "=== tests/gpu"
        py "$AFTER" timeout "${TEST_TIMEOUT:-150}" python -m pytest -q -p no:cacheprovider tests/gpu ;;
    *) echo "unknown item $item" ;;
    esac
    save
done
