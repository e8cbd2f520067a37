"""The CPU probes behind issue 17's report: is the recall task learnable at a tiny scale, and how
does the selection learn? Research code, sized for a shared 2-core CPU (one thread, calls of a few
minutes; every stage resumes from its file).

    circuit  learn the recall circuit (match a key, copy its value) with full attention, unchunked:
             tiny.yaml's model on short documents (256 tokens, 10 facts, distances 6..128) up to
             --short-steps, then the probe's documents (512 tokens, 16 facts, 6..256). Saves DIR/circuit.pt.
    switch   start from the circuit, switch to SparseK+SW with a fresh scorer and train chunk by chunk
             (cache carried, chunks of 128: facts more than 128 back reach the query only through the
             pool), printing recall per distance bucket and the selection diagnostics.
    census   where the score gradient goes at fact tokens: one unchunked pass over fresh documents,
             loss on the queried values only, |dL/dr| (r = x . w_score, the raw score) at the tokens of
             each fact line, by whether its own query selected the token, had it in the active set
             only, or neither; filler for comparison.
    oracle   recall with a perfect scorer: the tokens of each fact line (offsets --span from the '@')
             score --oracle, all else 0 (plus the slope): an upper bound for what selection can give
             this circuit.

    python benchmarks/recall_cpu_probe.py circuit --out /tmp/probe            # repeat until it says done
    (--set model.rope_theta=500000 on every part for the slow-RoPE circuit)
    python benchmarks/recall_cpu_probe.py switch --out /tmp/probe --name base --set attention.topk=8
    python benchmarks/recall_cpu_probe.py census --out /tmp/probe --set attention.timestep_norm=false
    python benchmarks/recall_cpu_probe.py oracle --out /tmp/probe --set attention.topk=32 --span 3,4
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import yaml

from longtrain.data import DocumentStream, prepare_corpus
from longtrain.data.recall import Symbols, generate_documents, line_length, value_offset, word_filler
from longtrain.eval.recall import measure_recall
from longtrain.model import LM, LMConfig
from longtrain.model import scoring
from longtrain.train.diagnostics import SelectionDiagnostics
from longtrain.train.recipe import Recipe
from longtrain.train.trainer import lm_loss

TINY = """
model: {style: llama, layers: 2, d_model: 64, heads: 2, mlp_ratio: 2.0}
attention: {type: sparsek+sw, topk: 4, window: 4, eps_slope: 1.0e-3}
data:
  source: recall
  recall: {docs: 6000, doc_tokens: 512, facts: 16, min_distance: 6, max_distance: 256, key_length: 1, value_length: 1}
tokenizer: {vocab_size: 300}
train: {steps: 400, chunk_size: 128, batch_docs: 16, lr: 3.0e-3, warmup_steps: 30, seed: 0, device: cpu}
"""
SHORT = ["data.recall.doc_tokens=256", "data.recall.facts=10", "data.recall.max_distance=128"]


def recipe(overrides: list[str]) -> Recipe:
    raw = yaml.safe_load(TINY)
    for o in overrides:
        key, value = o.split("=", 1)
        node = raw
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return Recipe.model_validate(raw)


def setup(overrides: list[str]):
    r = recipe(overrides)
    corpus = prepare_corpus(r.data, r.tokenizer, progress=False)
    torch.manual_seed(0)
    model = LM(LMConfig.from_recipe(r.model, r.attention, vocab_size=corpus.vocab_size))
    return r, corpus, model


def recall(model, r, corpus, docs=24) -> list:
    buckets = measure_recall(SimpleNamespace(model=model, recipe=r, tokenizer=corpus.tokenizer), docs=docs)
    model.train()
    return [(b["start"], b["trials"], None if b["accuracy"] is None else round(b["accuracy"], 2)) for b in buckets]


# ----------------------------------------------------------------------------- circuit


def circuit(a) -> None:
    path = a.out / "circuit.pt"
    state = torch.load(path) if path.exists() else None
    start = state["step"] if state else 0
    short = start < a.short_steps
    r, corpus, model = setup(a.set + ["attention.type=full", "attention.topk=0", "attention.window=0"] + (SHORT if short else []))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    docs, rng, t0 = corpus.train, np.random.default_rng(start), time.monotonic()
    end = a.short_steps if short else a.steps
    for s in range(start + 1, end + 1):
        x = torch.from_numpy(np.stack([docs.doc(i) for i in rng.integers(0, len(docs), a.batch)]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1, s / 50)
        loss = lm_loss(model(x[:, :-1]).logits, x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if s % 100 == 0 or s == end or time.monotonic() - t0 > a.budget_s:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s}, path)
            print(json.dumps({"step": s, "loss": round(loss.item(), 3), "s": round(time.monotonic() - t0)}), flush=True)
            if time.monotonic() - t0 > a.budget_s:
                print("budget spent: run again to continue", flush=True)
                return
    if end == a.steps:
        full = recipe(a.set + ["attention.type=full", "attention.topk=0", "attention.window=0"])
        print(json.dumps({"done": a.steps, "recall_full_attention": recall(model.eval(), full, corpus, docs=32)}), flush=True)
    else:
        print("short documents done: run again for the long ones", flush=True)


def load_circuit(a, model) -> None:
    missing = model.load_state_dict(torch.load(a.out / "circuit.pt")["model"], strict=False).missing_keys
    assert all("scorer" in k for k in missing), missing
    if model.cfg.score_init == "mimic":
        model.init_scores_mimic_()


# ----------------------------------------------------------------------------- switch


def switch(a) -> None:
    r, corpus, model = setup(a.set)
    load_circuit(a, model)
    print(json.dumps({"name": a.name, "set": a.set, "step": 0, "recall": recall(model, r, corpus)}), flush=True)
    scorer = [p for n, p in model.named_parameters() if "scorer" in n]
    rest = [p for n, p in model.named_parameters() if "scorer" not in n]
    opt = torch.optim.AdamW([{"params": scorer, "mult": a.scorer_lr_mult}, {"params": rest, "mult": 1.0}], lr=a.lr, weight_decay=0.0)
    stream = DocumentStream(corpus.train, batch_rows=r.train.batch_docs, chunk_size=r.train.chunk_size, seed=0)
    cache = model.empty_cache(r.train.batch_docs, dtype=torch.float32)
    diag, t0 = SelectionDiagnostics(model), time.monotonic()
    for s in range(1, a.steps + 1):
        for g in opt.param_groups:
            g["lr"] = a.lr * g["mult"] * min(1, s / 20)
        ch = stream.next_chunk()
        cache = cache.reset_rows(ch.reset)
        out = model(ch.tokens, cache=cache, lengths=ch.lengths)
        loss = lm_loss(out.logits, ch.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        diag.update(cache, out)
        cache = out.cache
        if s % a.every == 0 or s == a.steps:
            sel = [{k: round(v, 3) if isinstance(v, float) else v for k, v in x.items()} for x in diag.read()]
            print(json.dumps({"step": s, "loss": round(loss.item(), 3), "s": round(time.monotonic() - t0),
                              "selection": sel, "recall": recall(model, r, corpus)}), flush=True)
    print(json.dumps({"census_end": census_of(model, r, corpus)}), flush=True)


# ----------------------------------------------------------------------------- census


RAW: dict[int, torch.Tensor] = {}


def scorer_forward_keeping_r(self, x, pos, valid, seen, score_sum, score_sumsq):
    """Scorer.forward, with the raw score r kept (and its gradient retained) for the census."""
    sd = scoring.score_dtype(x.dtype)
    r = x.to(sd) @ self.weight.to(sd).t()
    if r.requires_grad:
        r.retain_grad()
    RAW[id(self)] = r
    r64 = torch.where(valid[..., None], r.to(torch.float64), 0.0)
    csum = torch.cat([score_sum[:, None].to(r64), r64], 1).cumsum(1)[:, 1:]
    csq = torch.cat([score_sumsq[:, None].to(r64), r64 * r64], 1).cumsum(1)[:, 1:]
    n = r64
    if self.timestep_norm:
        count = (seen[:, None] + valid.cumsum(1)).clamp(min=1).to(torch.float64)[..., None]
        mean = csum / count
        var = (csq / count - mean * mean).clamp(min=0.0)
        n = torch.where(valid[..., None], (r64 - mean) / torch.sqrt(var + scoring.TSN_EPS), 0.0)
    u = n + self.eps_slope * pos.to(torch.float64)[..., None]
    return u.to(sd), csum[:, -1].detach(), csq[:, -1].detach()


def census_of(model, r, corpus, n_docs=16) -> dict:
    cfg = r.data.recall
    orig = scoring.Scorer.forward
    scoring.Scorer.forward = scorer_forward_keeping_r
    try:
        td, rd = generate_documents(cfg, corpus.tokenizer, word_filler(corpus.tokenizer, cfg.doc_tokens - 1), seed=77, n_docs=n_docs)
        x = torch.from_numpy(np.stack([td.doc(i) for i in range(n_docs)]).astype(np.int64))
        model.zero_grad()
        out = model(x[:, :-1])
        v0, Lv, line = value_offset(cfg), cfg.value_length, line_length(cfg)
        tgt = torch.full_like(x[:, 1:], -100)
        for i, d in enumerate(rd):
            for q in d.query_pos:
                for t in range(Lv):
                    tgt[i, q + v0 + t - 1] = x[i, q + v0 + t]
        lm_loss(out.logits, tgt).backward()
    finally:
        scoring.Scorer.forward = orig
    res = {}
    for li, blk in enumerate(model.blocks):
        if blk.attn.scorer is None:
            continue
        w, k = blk.attn.window, blk.attn.topk
        g = RAW[id(blk.attn.scorer)].grad[..., 0].abs().numpy()  # [B, T]
        u = out.selections[li].u.double().numpy()
        tau = out.selections[li].tau.numpy()
        groups: dict[str, list[float]] = {"selected": [], "active_only": [], "neither": []}
        fact = np.zeros_like(g, dtype=bool)
        for i, d in enumerate(rd):
            for p, q in zip(d.fact_pos, d.query_pos):
                fact[i, p : p + line] = True
                for j in range(p, p + line):
                    sel = act = False
                    for qi in (q + v0 + t - 1 for t in range(Lv)):  # the query's value-predicting positions
                        if j > qi - w:
                            continue
                        cand = u[i, : qi - w + 1]
                        top = set(np.lexsort((np.arange(len(cand)), cand))[::-1][:k].tolist())
                        if len(cand) <= k or j in top:
                            sel = True
                        elif tau[i, qi] < u[i, j] < tau[i, qi] + 1:
                            act = True
                    groups["selected" if sel else "active_only" if act else "neither"].append(float(g[i, j]))
        groups["filler"] = g[~fact].tolist()
        res[f"layer{li}"] = {name: {"n": len(v), "nonzero": round(float(np.mean(np.array(v) > 1e-12)), 3) if v else None,
                                    "mean_abs_dr": float(f"{np.mean(v):.3g}") if v else None} for name, v in groups.items()}
    model.zero_grad()
    return res


def census(a) -> None:
    r, corpus, model = setup(a.set)
    load_circuit(a, model)
    print(json.dumps({"set": a.set, "census": census_of(model, r, corpus)}), flush=True)


# ----------------------------------------------------------------------------- oracle


def oracle(a) -> None:
    r, corpus, model = setup(a.set)
    load_circuit(a, model)
    sym, lo_hi = Symbols.of(corpus.tokenizer), [int(v) for v in a.span.split(",")]
    ids: dict[str, torch.Tensor] = {}
    hidden = LM.hidden

    def hidden_keeping_ids(self, tokens, cache=None, lengths=None):
        ids["tokens"] = tokens
        return hidden(self, tokens, cache=cache, lengths=lengths)

    def oracle_scores(self, x, pos, valid, seen, score_sum, score_sumsq):
        mark = torch.zeros(ids["tokens"].shape, dtype=torch.float64)
        for b, p in (ids["tokens"] == sym.fact).nonzero().tolist():
            mark[b, max(p + lo_hi[0], 0) : p + lo_hi[1]] = a.oracle
        u = mark[..., None] + self.eps_slope * pos.to(torch.float64)[..., None]
        return u.to(scoring.score_dtype(x.dtype)), score_sum, score_sumsq

    LM.hidden, scoring.Scorer.forward = hidden_keeping_ids, oracle_scores
    print(json.dumps({"set": a.set, "span": a.span, "oracle": a.oracle, "recall": recall(model, r, corpus)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("circuit", "switch", "census", "oracle"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides (key=value) of the probe's tiny recipe")
    ap.add_argument("--name", default="run")
    ap.add_argument("--steps", type=int, default=None, help="circuit: 4100; switch: 1500")
    ap.add_argument("--short-steps", type=int, default=3000, help="circuit: steps on the short documents first")
    ap.add_argument("--batch", type=int, default=16, help="circuit: documents per step")
    ap.add_argument("--lr", type=float, default=None, help="circuit: 5e-3; switch: 2e-3")
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--scorer-lr-mult", type=float, default=1.0)
    ap.add_argument("--oracle", type=float, default=5.0)
    ap.add_argument("--span", default="3,4", help="oracle: offsets from the '@' of the fact line's marked tokens")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "circuit":
        a.steps, a.lr = a.steps or 4100, a.lr or 5e-3
        circuit(a)
    elif a.part == "switch":
        a.steps, a.lr = a.steps or 1500, a.lr or 2e-3
        switch(a)
    elif a.part == "census":
        census(a)
    else:
        oracle(a)


if __name__ == "__main__":
    main()
