#!/usr/bin/env bash
# RULER on the gutenberg pair (issue 36): gutenberg-sparsek (SparseK+SW, k = w = 128) and gutenberg-sw
# (w = 256, the same KV budget) trained side by side for TRAIN_SECONDS each (SIGTERM: each saves a
# checkpoint and stops), then `longtrain eval --task ruler` on both at 4k ... MAX_LEN tokens and one
# lm-eval task through the adapter (rolling log-likelihood of validation paragraphs, a local YAML).
#
#   bash benchmarks/ruler_books.sh TRAIN_DIR VALID_DIR OUT [TRAIN_SECONDS]
#
# Env: MAX_LEN (16384), TRIALS (8), TASKS (all RULER tasks: "ruler"; or "ruler:niah_single_1,vt"),
# DEVICE (cuda), EXTRA (more --set flags for both runs, e.g. "--set train.steps=200" on a CPU).
# Writes OUT/ruler.json, OUT/ruler.png, OUT/lm-eval.json and the logs; prints both tables.
set -euo pipefail
TRAIN=${1:?TRAIN_DIR}; VALID=${2:?VALID_DIR}; OUT=${3:?OUT}; SECONDS_EACH=${4:-240}
MAX_LEN=${MAX_LEN:-16384}; TRIALS=${TRIALS:-8}; TASKS=${TASKS:-ruler}; DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT/runs"
cd "$(dirname "$0")/.."

common=(--set data.path="$TRAIN" --set data.valid="$VALID" --set train.device="$DEVICE" --set train.valid_every=0
        --set logging.progress=false ${EXTRA:-})
longtrain fit gutenberg-sparsek --run-dir "$OUT/runs/sparsek" "${common[@]}" --dry-run > "$OUT/prepare.log" 2>&1  # tokenize once
for name in sparsek sw; do
  timeout -s TERM "$SECONDS_EACH" longtrain fit "gutenberg-$name" --run-dir "$OUT/runs/$name" "${common[@]}" \
    > "$OUT/fit-$name.log" 2>&1 &
done
wait || true  # timeout's exit status: the runs stop by SIGTERM, after saving
tail -n 3 "$OUT"/fit-*.log

longtrain eval "$OUT/runs/sparsek" "$OUT/runs/sw" --task "$TASKS" --max-len "$MAX_LEN" --trials "$TRIALS" \
  --device "$DEVICE" --json "$OUT/ruler.json" --plot "$OUT/ruler.png" 2>&1 | tee "$OUT/ruler.log"

# lm-eval: word and byte perplexity of 20 validation paragraphs, a task written here (no download)
python - "$VALID" "$OUT" <<'EOF'
import json, pathlib, sys
valid, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for f in sorted(p for p in valid.iterdir() if p.is_file())[:4]:
    paras = [" ".join(p.split()) for p in f.read_text(encoding="utf-8", errors="replace").split("\n\n")]
    rows += [{"text": p} for p in paras if 400 < len(p) < 1500][10:15]
(out / "paragraphs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "book_paragraphs.yaml").write_text(
    f"task: book_paragraphs\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {out.resolve()}/paragraphs.jsonl\n"
    'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
EOF
longtrain eval "$OUT/runs/sparsek" "$OUT/runs/sw" --task "lm-eval:$OUT/book_paragraphs.yaml" --device "$DEVICE" \
  --json "$OUT/lm-eval.json" 2>&1 | tee "$OUT/lm-eval.log"
rm -rf "$OUT/runs"  # checkpoints stay on the device: only the numbers come back
