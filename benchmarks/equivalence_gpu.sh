#!/usr/bin/env bash
# Issue 24's measurements on one GPU: verify-equivalence at 1M tokens, chunks of 4096, 3001, 1000 and 777,
# float32 and bf16, before and after the fix, plus the first-divergence diagnosis.
#
#   AFTER=path/to/this/code BEFORE=path/to/main's/code DATA=books/ OUT=results/ \
#       bash benchmarks/equivalence_gpu.sh random|trained
#
# random:  the default random model: the table for float32, bfloat16 (autocast over float32 weights, as
#          training runs) and bfloat16-weights (the whole model in bf16: what --dtype bfloat16 meant
#          before), both code trees; then benchmarks/equivalence_divergence.py; then the GPU tests.
# trained: a short gutenberg-sparsek run (DATA/train, DATA/valid; stopped by SIGINT after TRAIN_SECONDS,
#          which saves a checkpoint), then the same table over DATA/valid's books as one document.
# Results: OUT/log.txt and OUT/results.tgz (every JSON); BEFORE may be left unset to measure AFTER alone.
# trained also leaves the checkpoint's weights as OUT/model.safetensors.part-* (+ recipe, tokenizer in the
# tgz); CKPT=folder holding those skips training and measures that checkpoint. ORDER picks the runs.
set -uo pipefail
STAGE=$1
TOKENS=${TOKENS:-1048576}
CHUNKS="--chunk-size 4096 --chunk-size 3001 --chunk-size 1000 --chunk-size 777"
RES=/tmp/eq_results
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 COLUMNS=160
save() { tar -czf "$OUT/results.tgz" -C "$RES" . ; }

verify() {  # tree tag dtype [extra args...]
    local tree=$1 tag=$2 dtype=$3; shift 3
    echo "=== verify $tag $dtype ($tree)"
    (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout "${VERIFY_TIMEOUT:-150}" python -m longtrain.cli verify-equivalence \
        --device "${DEVICE:-cuda}" --tokens "$TOKENS" $CHUNKS --dtype "$dtype" --min-agreement 0 --max-logit-diff 1e9 \
        --json "$RES/verify-$tag-$dtype.json" "$@")
    echo "(exit $?)"; save
}

diagnose() {  # tree tag dtype chunk... (after --)
    local tree=$1 tag=$2 dtype=$3; shift 3
    echo "=== diagnose $tag $dtype ($tree)"
    (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout "${DIAG_TIMEOUT:-120}" python benchmarks/equivalence_divergence.py \
        --device "${DEVICE:-cuda}" --tokens "$TOKENS" --dtype "$dtype" --json "$RES/diag-$tag-$dtype.json" "$@")
    echo "(exit $?)"; save
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
(cd "$AFTER" && git log -1 --format=%H 2>/dev/null; cat COMMIT 2>/dev/null)

case $STAGE in
random)
    echo "=== kernel tiling test on CUDA (fails before the fix)"
    (cd "$AFTER" && PYTHONPATH="/tmp/site:$PWD" timeout 120 python -m pytest -q -p no:cacheprovider tests/ops/test_tile_invariance.py)
    for tree in ${BEFORE:+before} after; do
        dir=$AFTER; [ $tree = before ] && dir=$BEFORE
        for dtype in float32 bfloat16 bfloat16-weights; do verify "$dir" "random-$tree" $dtype; done
    done
    if [ -n "${BEFORE:-}" ]; then
        diagnose "$BEFORE" before bfloat16-weights --chunk-size 3001 --chunk-size 4096
        diagnose "$BEFORE" before bfloat16 --chunk-size 3001
        diagnose "$BEFORE" before float32 --chunk-size 3001
    fi
    diagnose "$AFTER" after bfloat16-weights --chunk-size 3001
    echo "=== GPU tests (after)"
    (cd "$AFTER" && PYTHONPATH="/tmp/site:$PWD" timeout "${TEST_TIMEOUT:-150}" python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_equivalence_gpu.py tests/gpu/test_kernels_gpu.py)
    ;;
trained)
    RUN=/tmp/gs-run
    if [ -n "${CKPT:-}" ]; then  # a checkpoint brought back from an earlier call: CKPT/{model.safetensors.part-*,recipe.yaml,tokenizer.json}
        echo "=== rebuild the checkpoint from $CKPT"
        (cd "$AFTER" && PYTHONPATH="/tmp/site:$PWD" python benchmarks/equivalence_gpu_ckpt.py rebuild "$CKPT" "$RUN")
    else
        echo "=== train gutenberg-sparsek for ${TRAIN_SECONDS:-150} s"
        (cd "$AFTER" && PYTHONPATH="/tmp/site:$PWD" timeout -s INT "${TRAIN_SECONDS:-150}" python -m longtrain.cli fit gutenberg-sparsek \
            --run-dir "$RUN" --set data.path="$DATA/train" --set data.valid="$DATA/valid" --set train.valid_every=0 \
            --set checkpoint.every=100000 --set logging.progress=false --set logging.every=100)
        echo "(exit $?)"
        cp "$RUN/metrics.jsonl" "$RES/train-metrics.jsonl" 2>/dev/null
        # The weights in parts small enough to come back (OUT takes files of at most 16 MiB), for a later call.
        (cd "$AFTER" && PYTHONPATH="/tmp/site:$PWD" python benchmarks/equivalence_gpu_ckpt.py export "$RUN" "$OUT")
    fi
    cat "$DATA"/valid/*.txt > /tmp/doc.txt
    for item in ${ORDER:-after:float32 after:bfloat16 before:bfloat16 before:float32 diag-before:bfloat16 diag-after:bfloat16}; do
        tree=${item%%:*} dtype=${item#*:}
        dir=$AFTER; case $tree in *before) dir=${BEFORE:-};; esac
        [ -z "$dir" ] && continue
        case $tree in
        diag-*) diagnose "$dir" "trained-${tree#diag-}" "$dtype" --chunk-size 3001 --checkpoint "$RUN" --text /tmp/doc.txt;;
        *) verify "$dir" "trained-$tree" "$dtype" --checkpoint "$RUN" --text /tmp/doc.txt;;
        esac
    done
    ;;
esac
save
