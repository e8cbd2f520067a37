#!/usr/bin/env bash
# The books experiment (issue 17): SparseK+SW (k = w = 512) against a sliding window of the same KV
# budget (w = 1024) on books, 12 x 768 llama, chunks of 2048 tokens, two seeds each; then
# `longtrain eval` perplexity by position on the validation books and the spread between seeds.
# The claim to test: SparseK+SW is better than SW on tokens far into a book, by more than the
# spread between seeds.
#
#   bash benchmarks/books_experiment.sh TRAIN_DIR VALID_DIR OUT PART [STEPS]
#
# PART, each within a 10-minute device call:
#   calibrate           30 steps of each model: tokens/s, and the steps that fit 480 s of training
#   sparsek-0 sparsek-1 sw-0 sw-1
#                       one training run (model-seed) of STEPS steps (default 1500, or the
#                       calibration's). It stops with a checkpoint at 540 s; run the same PART again
#                       to resume it where it stopped (the cosine schedule spans all STEPS).
#   prepare             train the tokenizer and tokenize the books once (the token cache), no GPU
#   parallel            prepare, then the four runs at once (one process each) within BUDGET: what
#                       one device call allows when its files do not outlive it
#   eval                perplexity by position bucket of every finished run on VALID_DIR
#   summary             OUT/books.md: mean ppl per bucket per model, the seeds' spread, the difference
#   picture             `longtrain inspect` of sparsek-0 on a book page: HTML (every layer) and PNG
#                       (layer $LAYER, default 6)
#
# Everything lands in OUT: runs/<part>/, logs, calibration.json, books-eval.json/png, books.md.
set -euo pipefail
TRAIN=${1:?TRAIN_DIR}; VALID=${2:?VALID_DIR}; OUT=${3:?OUT}; PART=${4:?PART}; STEPS=${5:-}
mkdir -p "$OUT/runs"
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-540}

# The shared settings: the gutenberg recipes at 12 x 768 and chunks of 2048.
common=(
  --set data.path="$TRAIN" --set data.valid="$VALID"
  --set model.layers=12 --set model.d_model=768 --set model.heads=12
  --set tokenizer.vocab_size=16384
  --set train.chunk_size=2048 --set train.batch_docs=8 --set train.grad_accum=1
  --set train.lr=6.0e-4 --set train.warmup_steps=100 --set train.weight_decay=0.1
  --set train.valid_every=0 --set train.device=cuda
  --set checkpoint.every=250 --set checkpoint.keep=1
  --set logging.every=25 --set logging.progress=false
)
sparsek=(gutenberg-sparsek --set attention.topk=512 --set attention.window=512)
sw=(gutenberg-sw --set attention.window=1024)
EVAL_ARGS=(--docs 16 --tokens 65536 --device cuda)  # 16 validation books, their first 64k tokens
if [[ -n "${SMOKE:-}" ]]; then  # SMOKE=1: the same parts at a toy size on the CPU, to check the script
  common+=(--set model.layers=1 --set model.d_model=32 --set model.heads=2 --set tokenizer.vocab_size=512
           --set train.chunk_size=256 --set train.batch_docs=2 --set train.warmup_steps=1 --set train.device=cpu)
  sparsek=(gutenberg-sparsek --set attention.topk=32 --set attention.window=32)
  sw=(gutenberg-sw --set attention.window=64)
  EVAL_ARGS=(--docs 2 --tokens 4096 --device cpu)
  INSPECT_DEVICE=cpu
fi

steps_for() {  # STEPS if given, else the calibration's, else 1500
  if [[ -n "$STEPS" ]]; then echo "$STEPS"; return; fi
  if [[ -f "$OUT/calibration.json" ]]; then
    python -c "import json,sys; print(json.load(open(sys.argv[1]))['steps'])" "$OUT/calibration.json"; return
  fi
  echo 1500
}

train() {  # train MODEL SEED STEPS RUN_DIR [more --set]
  local model=$1 seed=$2 steps=$3 run=$4; shift 4
  local args
  if [[ $model == sparsek ]]; then args=("${sparsek[@]}"); else args=("${sw[@]}"); fi
  echo "$ longtrain fit ${args[*]} ${common[*]} --set train.seed=$seed --set train.steps=$steps --run-dir $run $*"
  # SIGTERM at the budget: the trainer finishes its step, saves a checkpoint and exits 143.
  timeout -s TERM "$BUDGET" python -m longtrain.cli fit "${args[@]}" "${common[@]}" \
    --set train.seed="$seed" --set train.steps="$steps" --run-dir "$run" "$@" || echo "fit exited $?"
}

case "$PART" in
  calibrate)
    for model in sparsek sw; do
      BUDGET=240 train "$model" 0 30 "$OUT/calib-$model" --set train.warmup_steps=5 --set checkpoint.every=1000 \
        > "$OUT/calibrate-$model.log" 2>&1
      tail -3 "$OUT/calibrate-$model.log"
    done
    python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rates = {}
for model in ("sparsek", "sw"):
    rec = [json.loads(l) for l in (out / f"calib-{model}" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    late = [r for r in rec if r["step"] > 10]  # after compilation and warm-up
    rates[model] = sum(r["tokens"] - e["tokens"] for r, e in zip(late[1:], late)) / sum(r["step_s"] for r in late[1:])
tokens_per_step = rec[-1]["tokens"] / rec[-1]["step"]
slow = min(rates.values())
steps = int(480 * slow / tokens_per_step) // 50 * 50  # 480 s of training in a 540 s budget
json.dump({"tokens_per_s": rates, "tokens_per_step": tokens_per_step, "steps": steps,
           "tokens": steps * tokens_per_step}, open(out / "calibration.json", "w"), indent=1)
print(f"tokens/s: {rates}; {tokens_per_step:.0f} tokens a step; {steps} steps = {steps * tokens_per_step / 1e6:.1f}M tokens in ~480 s")
PY
    ;;
  sparsek-0|sparsek-1|sw-0|sw-1)
    model=${PART%-*}; seed=${PART#*-}
    train "$model" "$seed" "$(steps_for)" "$OUT/runs/$PART" >> "$OUT/train-$PART.log" 2>&1
    tail -4 "$OUT/train-$PART.log"
    ;;
  prepare)
    python - "${sparsek[@]}" "${common[@]}" <<'PY'
import sys
from longtrain.data import prepare_corpus
from longtrain.train.recipe import load_recipe
args = sys.argv[1:]
sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
r = load_recipe(args[0], sets)
c = prepare_corpus(r.data, r.tokenizer, progress=False)
print(f"prepared: {len(c.train)} training and {len(c.valid)} validation documents")
PY
    ;;
  parallel)
    bash "$0" "$TRAIN" "$VALID" "$OUT" prepare
    for part in sparsek-0 sparsek-1 sw-0 sw-1; do
      model=${part%-*}; seed=${part#*-}
      train "$model" "$seed" "$(steps_for)" "$OUT/runs/$part" >> "$OUT/train-$part.log" 2>&1 &
    done
    wait
    for part in sparsek-0 sparsek-1 sw-0 sw-1; do tail -2 "$OUT/train-$part.log"; done
    ;;
  eval)
    runs=()
    for r in "$OUT"/runs/*; do [[ -d "$r/checkpoints" ]] && runs+=("$r"); done
    echo "$ longtrain eval ${runs[*]} --task ppl --data $VALID ${EVAL_ARGS[*]}"
    python -m longtrain.cli eval "${runs[@]}" --task ppl --data "$VALID" "${EVAL_ARGS[@]}" \
      --json "$OUT/books-eval.json" --plot "$OUT/books-eval.png" | tee "$OUT/eval.log"
    ;;
  picture)  # the selection picture of a book page: the first 20k characters of the first validation book
    python - "$VALID" "$OUT/page.txt" <<'PY'
import sys
from pathlib import Path
book = sorted(Path(sys.argv[1]).glob("*.txt"))[0]
Path(sys.argv[2]).write_text(book.read_text(encoding="utf-8", errors="replace")[:20000])
print(f"page: the first 20,000 characters of {book.name}")
PY
    layer=${LAYER:-6}
    python -m longtrain.cli inspect "$OUT/runs/sparsek-0" --text "$OUT/page.txt" --out "$OUT/books-selection.html" --device "${INSPECT_DEVICE:-cuda}"
    python -m longtrain.cli inspect "$OUT/runs/sparsek-0" --text "$OUT/page.txt" --layer "$layer" --out "$OUT/books-selection.png" --device "${INSPECT_DEVICE:-cuda}"
    ;;
  summary)
    python - "$OUT" <<'PY'
import json, math, sys
from collections import defaultdict
from pathlib import Path
out = Path(sys.argv[1])
res = json.loads((out / "books-eval.json").read_text())["results"]
by_model = defaultdict(list)  # model -> [(seed, {bucket: ppl})]
for r in res:
    name = Path(r["checkpoint"]).parent.parent.name  # runs/<model>-<seed>/checkpoints/step-...
    model, seed = name.rsplit("-", 1)
    by_model[model].append((seed, {(b["start"], b["end"]): b["ppl"] for b in r["ppl"]["buckets"]}, r["ppl"]["ppl"], r["step"]))
buckets = sorted({b for runs in by_model.values() for _, bs, _, _ in runs for b in bs})
k = lambda n: f"{n // 1024}k" if n >= 1024 else str(n)
lines = ["| model | seeds | steps | all | " + " | ".join(f"{k(a)}–{k(b)}" for a, b in buckets) + " |",
         "|---|---|---|---|" + "---|" * len(buckets)]
mean = {}
for model, runs in sorted(by_model.items()):
    cells, mean[model] = [], {}
    for b in buckets:
        vals = [bs[b] for _, bs, _, _ in runs if b in bs]
        m = sum(vals) / len(vals)
        mean[model][b] = (m, max(vals) - min(vals))
        cells.append(f"{m:.2f} ± {(max(vals) - min(vals)) / 2:.2f}")
    alls = [a for _, _, a, _ in runs]
    lines.append(f"| {model} | {len(runs)} | {runs[0][3]} | {sum(alls) / len(alls):.2f} | " + " | ".join(cells) + " |")
if {"sparsek", "sw"} <= set(mean):
    cells = []
    for b in buckets:
        (ms, ss), (mw, sw_) = mean["sparsek"][b], mean["sw"][b]
        diff = mw - ms  # > 0: SparseK+SW better
        cells.append(f"{diff:+.2f}{' *' if diff > max(ss, sw_) else ''}")
    lines.append("| sw − sparsek | | | | " + " | ".join(cells) + " |")
text = ("Perplexity by position bucket on the validation books (mean over seeds ± half the range between "
        "seeds); last row: SW minus SparseK+SW, * where the gap exceeds both models' spread between seeds.\n\n"
        + "\n".join(lines) + "\n")
(out / "books.md").write_text(text)
print(text)
PY
    ;;
  *) echo "unknown PART $PART (calibrate | sparsek-0 | sparsek-1 | sw-0 | sw-1 | prepare | parallel | eval | summary | picture)"; exit 2 ;;
esac
