# fit A/B of the quickstart between commits: bash benchmarks/fit_ab.sh old new [old ...]
# Each NAME is a `git archive` tarball at .snap/NAME.tar; for each, a 60-step warm-up (fills the Triton
# cache, captures graphs), then 300 steps; prints tokens/s over steps 20-99, 100-199, 201-299 from
# metrics.jsonl (elapsed_s per step). Writes logs and metrics under $OUT.
for v in "$@"; do
  mkdir -p /tmp/$v && tar -xf .snap/$v.tar -C /tmp/$v
  (cd /tmp/$v && PYTHONPATH=/tmp/$v timeout 150 python -m longtrain.cli fit quickstart --set train.steps=60 --run-dir /tmp/w-$v --resume never > /dev/null 2>&1; echo "$v warm=$?")
  (cd /tmp/$v && PYTHONPATH=/tmp/$v timeout 150 python -m longtrain.cli fit quickstart --set train.steps=300 --run-dir /tmp/f-$v --resume never > $OUT/fit-$v.log 2>&1; echo "$v fit=$?")
  find /tmp/f-$v -name metrics.jsonl -exec cp {} $OUT/metrics-$v.jsonl \;
  python - "$OUT/metrics-$v.jsonl" "$v" <<'PY'
import json, sys
by = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
tps = lambda a, b: (by[b]["tokens"] - by[a]["tokens"]) / (by[b]["elapsed_s"] - by[a]["elapsed_s"])
print(sys.argv[2], "first step", by[1]["elapsed_s"], "tok/s 20-99", round(tps(20, 99)), "100-199", round(tps(100, 199)), "201-299", round(tps(201, 299)), "end", by[300]["elapsed_s"])
PY
done
