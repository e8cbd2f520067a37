"""A/B of the GPU selection scan between commits: graph-mode scan_chunk_device, median ms of 20 warm calls.

    (cd /tmp/old && PYTHONPATH=/tmp/old python /tmp/new/benchmarks/scan_ab.py old /tmp/old)
    (cd /tmp/new && PYTHONPATH=/tmp/new python /tmp/new/benchmarks/scan_ab.py new /tmp/new)

argv: a tag and the checkout whose benchmarks/scan_device.py (inputs: u ~ N(0, 1) + 1e-3 i, k = w = 512,
blocks of 64, a fresh cache) and longtrain/ run; its scan_device.py must have device_scan(keys, state) (the
selection's one-signature scans; older checkouts need this file from their own commit). Alternate the sides
in one device call; compare only within it.
"""
import json
import sys

sys.path.insert(0, sys.argv[2] + "/benchmarks")
import scan_device as S  # noqa: E402

res = {}
for B, T in ((1, 16384), (8, 16384), (1, 65536), (1, 262144)):
    keys, state = S.inputs(B, T, "cuda")
    ms, _ = S.timed(lambda: S.device_scan(keys, state), repeats=20)
    res[f"{B}x{T}"] = round(ms, 3)
print("SCAN", sys.argv[1], json.dumps(res))
