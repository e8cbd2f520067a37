"""LoRA against full fine-tuning at ~1B parameters, and NTK-aware context extension of an imported Qwen2.

    python benchmarks/finetune_lora.py --out $OUT [--tiny]

Everything runs offline on the Python standard library's sources (longtrain's `stdlib` corpus,
10% of its documents held out), with one byte-level BPE tokenizer trained on them.

1. LoRA vs full: a randomly initialised Llama-shaped model (22 x 2048, 32 query heads on 4 KV heads,
   MLP 5632, vocab 32,000: TinyLlama's shape, 1.1B parameters) trained by `longtrain fit` with
   SparseK+SW for the same steps, once with every weight learning and once with
   `train.lora: {rank: 16, alpha: 32}` (adapters on every projection, scoring vectors in full).
   Reported: tokens/s over the steps after the first few, peak memory (the trainer's), training loss.
   Eager blocks (train.compile false) in both, to keep the run short; CUDA graphs as the trainer picks.
2. NTK: a randomly initialised Qwen2-shaped `Qwen2ForCausalLM` (q/k/v biases, GQA, tied head) built
   with transformers, pretrained briefly with plain PyTorch on 512-token windows and saved with
   `save_pretrained` (max_position_embeddings 512); `longtrain import` (full, and SparseK+SW with mimic
   scores); `longtrain fit finetune-llama` on documents read to 4x its context with
   `model.rope_scaling: {type: dynamic, target_length: 2048, original_context: 512}` (the paper's
   NTK-aware interpolation), and the same without the scaling as a control. Held-out loss on the
   first 2048 tokens of each validation document, split at the original context (positions < 512
   and 512-2047), before and after.

Writes under --out: results.json, summary.txt, log.txt, metrics_*.jsonl. `--tiny` runs every step at
toy sizes on the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import finetune_hf  # noqa: E402  (its Bench's helpers)

SIZES = {
    "full": dict(vocab=8192, model_vocab=32000, layers=22, d=2048, heads=32, kv=4, mlp=5632, steps=30, chunk=2048, batch=4,
                 k=512, w=512, q_d=512, q_layers=8, q_heads=8, q_kv=2, q_mlp=1408, ctx=512, pre_steps=400, pre_batch=32,
                 ntk_steps=150, ntk_chunk=512, ntk_batch=8, ntk_k=128, ntk_w=128, eval_docs=16),
    "tiny": dict(vocab=512, model_vocab=640, layers=2, d=64, heads=4, kv=2, mlp=128, steps=6, chunk=128, batch=2,
                 k=16, w=16, q_d=64, q_layers=2, q_heads=4, q_kv=2, q_mlp=128, ctx=64, pre_steps=20, pre_batch=4,
                 ntk_steps=6, ntk_chunk=64, ntk_batch=2, ntk_k=16, ntk_w=16, eval_docs=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/finetune_lora"), help="scratch folder (models, runs)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    ap.add_argument("--skip-lora", action="store_true", help="only the NTK part")
    args = ap.parse_args()
    Bench(args, SIZES["tiny" if args.tiny else "full"]).run()


class Bench(finetune_hf.Bench):  # its say, env, write_results and longtrain (a CLI call, logged)
    def __init__(self, args, size):
        self.args, self.s = args, size
        self.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
        self.work = args.work
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = open(args.out / "log.txt", "w")
        self.results: dict = {"size": size, "device": torch.cuda.get_device_name() if self.device == "cuda" else "cpu"}

    def run(self) -> None:
        t0 = time.monotonic()
        self.tokenizer, self.corpus = self.prepare()
        if not self.args.skip_lora:
            self.results["lora_vs_full"] = {name: self.lora_run(name, lora) for name, lora in (("full", None), ("lora",
                "{rank: 16, alpha: 32}"))}
        self.results["ntk"] = self.ntk()
        self.results["total_seconds"] = round(time.monotonic() - t0, 1)
        self.write_results()

    def prepare(self):
        """The tokenizer (trained on the stdlib corpus, 10% held out) and the tokenized corpus."""
        from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus

        t = time.monotonic()
        corpus = prepare_corpus(DataConfig(source="stdlib", valid=0.1, min_doc_tokens=self.s["ctx"] * 4),
                                TokenizerConfig(vocab_size=self.s["vocab"]), progress=False)
        path = self.work / "tokenizer.json"
        corpus.tokenizer.save(str(path))
        self.say(f"corpus: {len(corpus.train)} training / {len(corpus.valid)} held-out documents, "
                 f"{corpus.train.n_tokens:,} tokens, tokenizer {corpus.vocab_size} ({time.monotonic() - t:.0f} s)")
        return path, corpus

    # ------------------------------------------------------------------ 1. LoRA vs full

    def lora_run(self, name: str, lora: str | None) -> dict:
        s = self.s
        sets = {
            "model.style": "llama", "model.layers": s["layers"], "model.d_model": s["d"], "model.heads": s["heads"],
            "model.kv_heads": s["kv"], "model.intermediate_size": s["mlp"], "model.vocab_size": s["model_vocab"],
            "attention.type": "sparsek+sw", "attention.topk": s["k"], "attention.window": s["w"],
            "tokenizer.path": self.tokenizer, "data.source": "stdlib", "data.valid": 0.1, "data.min_doc_tokens": s["chunk"],
            "train.steps": s["steps"], "train.chunk_size": s["chunk"], "train.batch_docs": s["batch"], "train.grad_accum": 1,
            "train.lr": 3e-4 if lora is None else 1e-3, "train.warmup_steps": max(1, s["steps"] // 10), "train.valid_every": 0,
            "train.device": self.device, "train.compile": "false", "checkpoint.every": 10**6, "logging.every": 1,
            "logging.progress": "false",
        }
        if lora:
            sets["train.lora"] = lora
        return self.fit("quickstart", self.work / f"lm-{name}", sets, name)

    def fit(self, recipe: str, run: Path, sets: dict, name: str) -> dict:
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        t = time.monotonic()
        self.longtrain("fit", recipe, "--run-dir", run, *args)
        wall = time.monotonic() - t
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
        rows = [r for r in rows if "loss" in r]
        shutil.copy(run / "metrics.jsonl", self.args.out / f"metrics_{name}.jsonl")
        a, b = rows[min(5, len(rows) - 2)], rows[-1]  # steady state: after the first steps (graphs, warm caches)
        return {
            "steps": b["step"], "tokens": b["tokens"], "wall_seconds_incl_startup": round(wall, 1),
            "tokens_per_s": round((b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])),
            "tokens_per_s_window": [a["step"], b["step"]],
            "peak_memory_gib": round(max(r["memory_bytes"] for r in rows) / 2**30, 2),
            "loss_first": rows[0]["loss"], "loss_last": b["loss"], "loss_last5_mean": float(np.mean([r["loss"] for r in rows[-5:]])),
            "lr": sets["train.lr"] if "train.lr" in sets else None,
        }

    # ------------------------------------------------------------------ 2. NTK

    def ntk(self) -> dict:
        s = self.s
        hf_dir = self.pretrain_qwen2()
        full, sparse = self.work / "q-full", self.work / "q-sparse"
        self.longtrain("import", hf_dir, "--out", full, "--attention", "full")
        self.longtrain("import", hf_dir, "--out", sparse, "--topk", s["ntk_k"], "--window", s["ntk_w"], "--score-init", "mimic")
        ntk = {"type": "dynamic", "target_length": 4 * s["ctx"], "original_context": s["ctx"]}
        ev: dict = {}
        ev["full attention, plain RoPE (as pretrained)"] = self.evaluate(full)
        ev["full attention, NTK x4, no fine-tuning"] = self.evaluate(full, ntk)
        ev["SparseK+SW, NTK x4, before fine-tuning"] = self.evaluate(sparse, ntk)
        ft = {}
        for name, scaling in (("ntk", ntk), ("plain_rope", None)):
            run = self.work / f"q-ft-{name}"
            sets = {
                "train.init_from": sparse, "data.source": "stdlib", "data.path": "null", "data.valid": 0.1,
                "data.min_doc_tokens": 4 * s["ctx"], "train.steps": s["ntk_steps"], "train.warmup_steps": max(1, s["ntk_steps"] // 10),
                "train.chunk_size": s["ntk_chunk"], "train.batch_docs": s["ntk_batch"], "train.grad_accum": 1,
                "train.valid_every": 0, "train.device": self.device, "checkpoint.every": s["ntk_steps"],
                "logging.every": 1, "logging.progress": "false", "train.lr": 3e-4, "train.compile": "false",
            }
            if scaling:
                sets |= {f"model.rope_scaling.{k}": v for k, v in scaling.items()}
            ft[name] = self.fit("finetune-llama", run, sets, f"ntk_{name}")
            ev[f"SparseK+SW, {'NTK x4' if scaling else 'plain RoPE'}, after fine-tuning"] = self.evaluate(run)
        return {"pretrain": self.results.pop("pretrain"), "finetune": ft, "eval": ev, "rope_scaling": ntk}

    def pretrain_qwen2(self) -> Path:
        """A random Qwen2-shaped model trained briefly on `ctx`-token windows with plain PyTorch; an HF folder."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        s, dev = self.s, self.device
        ids = self.corpus.train.tokens.astype(np.int64)
        cfg = Qwen2Config(
            vocab_size=-(-self.corpus.vocab_size // 128) * 128, hidden_size=s["q_d"], num_hidden_layers=s["q_layers"],
            num_attention_heads=s["q_heads"], num_key_value_heads=s["q_kv"], intermediate_size=s["q_mlp"],
            max_position_embeddings=s["ctx"], rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
            bos_token_id=None, eos_token_id=int(self.corpus.eod_id),
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(dev).train()
        steps, B, T = s["pre_steps"], s["pre_batch"], s["ctx"]
        t = time.monotonic()
        losses = self.pretrain_windows(model, ids, steps=steps, batch=B, length=T, lr=1e-3, log_every=max(1, steps // 5))
        self.results["pretrain"] = {
            "model": "Qwen2ForCausalLM", "params": sum(p.numel() for p in model.parameters()), "steps": steps,
            "tokens_per_step": B * T, "context": T, "seconds": round(time.monotonic() - t, 1),
            "loss_first": losses[0], "loss_last_10_mean": float(np.mean(losses[-10:])),
        }
        out = self.work / "qwen2-pretrained"
        model.to("cpu").save_pretrained(out)
        shutil.copy(self.tokenizer, out / "tokenizer.json")
        del model  # (the optimizer went with pretrain_windows)
        return out

    @torch.no_grad()
    def evaluate(self, ckpt: Path, rope_scaling: dict | None = None) -> dict:
        """Held-out loss on the first 4·ctx tokens of each validation document, chunk by chunk through the
        cache, split at the original context."""
        from longtrain.train.checkpoint import load_checkpoint

        s = self.s
        loaded = load_checkpoint(ckpt, device=self.device)
        model = loaded.model
        if rope_scaling is not None:  # the imported model with NTK frequencies, before any fine-tuning
            model.cfg.rope_scaling = rope_scaling
        T, ctx = 4 * s["ctx"], s["ctx"]
        docs = [self.corpus.valid.doc(i)[: T + 1] for i in range(min(s["eval_docs"], len(self.corpus.valid)))]
        docs = [d for d in docs if len(d) == T + 1]
        x = torch.from_numpy(np.stack(docs).astype(np.int64)).to(self.device)  # [N, T + 1]
        losses, cache = [], None
        for start in range(0, T, ctx):
            out = model(x[:, start : start + ctx], cache=cache)
            cache = out.cache
            losses.append(torch.nn.functional.cross_entropy(out.logits.float().transpose(1, 2), x[:, start + 1 : start + ctx + 1],
                reduction="none"))
        per_pos = torch.cat(losses, 1)  # [N, T]
        result = {"loss_within_context": float(per_pos[:, :ctx].mean()), "loss_beyond_context": float(per_pos[:, ctx:].mean()),
                  "loss_last_quarter": float(per_pos[:, -ctx:].mean()), "docs": len(docs), "tokens": T,
                  "rope_scaling": model.cfg.rope_scaling, "attention": model.cfg.attention}
        self.say(f"eval {ckpt.name} (rope_scaling {model.cfg.rope_scaling}): positions < {ctx} {result['loss_within_context']:.4f}, "
                 f">= {ctx} {result['loss_beyond_context']:.4f}")
        del loaded, model
        return result

    def summary(self) -> str:
        r, s = self.results, self.s
        lines = [f"device: {r['device']}"]
        if "lora_vs_full" in r:
            lines.append(f"1. Llama-shaped {s['layers']} x {s['d']} ({s['heads']} heads / {s['kv']} KV, vocab {s['model_vocab']}), "
                         f"random init, SparseK+SW k={s['k']} w={s['w']}, {s['steps']} steps of {s['batch']} x {s['chunk']} tokens:")
            for name, f in r["lora_vs_full"].items():
                lines.append(f"   {name:5s} lr {f['lr']:.0e}: {f['tokens_per_s']:,} tokens/s (steps {f['tokens_per_s_window'][0]}-"
                             f"{f['tokens_per_s_window'][1]}), peak {f['peak_memory_gib']} GiB, loss {f['loss_first']:.3f} -> "
                             f"{f['loss_last']:.3f} (mean of the last 5: {f['loss_last5_mean']:.3f})")
        n = r["ntk"]
        p = n["pretrain"]
        lines.append(f"2. Qwen2-shaped {s['q_layers']} x {s['q_d']} ({p['params'] / 1e6:.1f}M parameters) "
                     f"pretrained on {p['context']}-token "
                     f"windows ({p['steps']} steps, loss {p['loss_first']:.3f} -> {p['loss_last_10_mean']:.3f}); fine-tuned "
                     f"{s['ntk_steps']} steps of {s['ntk_batch']} x {s['ntk_chunk']} tokens with SparseK+SW k={s['ntk_k']} w={s['ntk_w']}")
        for name, f in n["finetune"].items():
            lines.append(f"   fine-tune {name}: {f['tokens_per_s']:,} tokens/s, loss {f['loss_first']:.3f} -> {f['loss_last']:.3f}")
        ctx = s["ctx"]
        lines.append(f"   held-out loss on {next(iter(n['eval'].values()))['docs']} documents x {4 * ctx} tokens:"
                     f" positions < {ctx} | {ctx}-{4 * ctx - 1} | last {ctx}")
        lines += [f"   {name:48s} {v['loss_within_context']:.4f} | {v['loss_beyond_context']:.4f} | {v['loss_last_quarter']:.4f}"
                  for name, v in n["eval"].items()]
        lines.append(f"total {r['total_seconds']} s")
        return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
