"""Fine-tune an imported Hugging Face model with SparseK+SW, end to end, and measure it.

    python benchmarks/finetune_hf.py --books BOOKS/train --valid BOOKS/valid --out $OUT [--tiny]

No hub is reachable here, so the "pretrained model" is made on the spot:
1. a byte-level BPE tokenizer trained on the books (longtrain's trainer);
2. a randomly initialised Pythia-160M-shaped `GPTNeoXForCausalLM` (12 x 768, 12 heads, MLP 3072,
   partial rotary 0.25, parallel residual, untied head) built with `transformers`;
3. pretrained briefly from scratch with plain PyTorch on random 2048-token windows of the books (full
   attention, bf16 autocast, AdamW), as Pythia itself was, and saved with `save_pretrained`: a local
   HF folder like a downloaded one;
4. `longtrain import --attention full` (the reference) and `--attention sparsek+sw --score-init mimic`;
5. validation loss of both before fine-tuning, then `longtrain fit finetune-pythia` from the SparseK
   import (plain, and with the scorer-first warm-up `train.freeze`), and validation loss after.

Validation is always the trainer's `evaluate` (chunk-recurrent, float32, the same documents, chunk
size and tokens for every model). If this checkout has `longtrain eval`, it also runs
`longtrain eval CKPT --data GLOB --docs N --tokens N --task ppl --json FILE` and keeps its JSON.

Writes under --out: results.json (every number), summary.txt, log.txt (every command's output),
metrics_*.jsonl of the fine-tuning runs. `--tiny` runs the same steps at a toy size on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {  # pythia-160m shape; tiny for the CPU
    "full": dict(hidden=768, layers=12, heads=12, mlp=3072, vocab=16384, seq=2048, pre_batch=16, pre_steps=400, pre_lr=6e-4,
                 ft_steps=200, ft_chunk=2048, ft_batch=8, k=512, w=512, freeze=50, eval_docs=8, eval_tokens=16384, max_books=None),
    "tiny": dict(hidden=64, layers=2, heads=4, mlp=256, vocab=512, seq=128, pre_batch=4, pre_steps=30, pre_lr=3e-3,
                 ft_steps=6, ft_chunk=64, ft_batch=2, k=16, w=16, freeze=2, eval_docs=2, eval_tokens=512, max_books=4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", type=Path, required=True, help="folder of training books (.txt, one per file)")
    ap.add_argument("--valid", type=Path, required=True, help="folder of held-out books")
    ap.add_argument("--out", type=Path, required=True, help="where results.json, summary.txt, log.txt go")
    ap.add_argument("--work", type=Path, default=Path("/tmp/finetune_hf"), help="scratch folder (models, runs)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (a smoke test of every step)")
    for key in ("pre_steps", "ft_steps", "freeze", "k", "w", "eval_docs", "eval_tokens", "max_books", "vocab"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    args = ap.parse_args()
    size = dict(SIZES["tiny" if args.tiny else "full"])
    size.update({k: v for k, v in vars(args).items() if k in size and v is not None})
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    bench = Bench(args, size, device)
    bench.run()


class Bench:
    def __init__(self, args, size, device):
        self.args, self.size, self.device = args, size, device
        self.work = args.work
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = open(args.out / "log.txt", "w")
        self.results: dict = {"size": size, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
        self.books = self._books(args.books, "train", size["max_books"])
        self.valid = self._books(args.valid, "valid", None)

    def pretrain_windows(self, model, ids: np.ndarray, *, steps: int, batch: int, length: int, lr: float,
                         log_every: int) -> list[float]:
        """Plain PyTorch training of an HF causal LM on random `length`-token windows of `ids`: AdamW, linear
        warm-up over a tenth of the steps, cosine to 10%, bf16 autocast on CUDA, clip 1.0. The losses per step."""
        dev = self.device
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        rng = np.random.default_rng(0)
        warm = max(1, steps // 10)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
        losses = []
        for step in range(1, steps + 1):
            progress = max(0, step - warm) / max(1, steps - warm)
            step_lr = lr * (step / warm if step <= warm else 0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
            for g in opt.param_groups:
                g["lr"] = step_lr
            starts = rng.integers(0, len(ids) - length - 1, batch)
            x = torch.from_numpy(np.stack([ids[i : i + length + 1] for i in starts]).astype(np.int64)).to(dev)
            with autocast:
                logits = model(x[:, :-1]).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
            if step % log_every == 0 or step == 1:
                self.say(f"pretrain step {step}/{steps} loss {losses[-1]:.3f} lr {step_lr:.2e}")
        return losses

    def write_results(self) -> None:
        """results.json and summary.txt in --out; the summary printed too."""
        (self.args.out / "results.json").write_text(json.dumps(self.results, indent=1))
        (self.args.out / "summary.txt").write_text(self.summary())
        self.say(self.summary())

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def _books(self, folder: Path, name: str, limit: int | None) -> Path:
        files = sorted(p for p in folder.iterdir() if p.suffix == ".txt")
        if limit:
            files = files[:limit]
        dst = self.work / "books" / name
        dst.mkdir(parents=True)
        for f in files:
            (dst / f.name).symlink_to(f.resolve())
        return dst

    def run(self) -> None:
        t0 = time.monotonic()
        tok = self.tokenizer()
        hf_dir = self.pretrain(tok)
        full, sparse = self.work / "full", self.work / "sparse"
        s = self.size
        self.longtrain("import", hf_dir, "--out", full, "--attention", "full")
        t = time.monotonic()
        self.longtrain("import", hf_dir, "--out", sparse, "--attention", "sparsek+sw", "--topk", s["k"], "--window", s["w"],
            "--score-init", "mimic")
        self.results["import_seconds"] = round(time.monotonic() - t, 2)

        ev = self.results["eval"] = {}
        ev["full_attention_as_pretrained"] = self.evaluate(full)
        ev["sparsek_sw_before_finetune"] = self.evaluate(sparse)
        ft = self.results["finetune"] = {}
        for name, extra in (("plain", []), ("scorer_first", ["--set", f"train.freeze={{steps: {s['freeze']}}}"])):
            run = self.work / f"ft-{name}"
            ft[name] = self.finetune(sparse, run, extra, name)
            ev[f"sparsek_sw_after_finetune_{name}"] = self.evaluate(run)
        self.results["total_seconds"] = round(time.monotonic() - t0, 1)
        self.write_results()

    # ------------------------------------------------------------------ steps

    def tokenizer(self):
        from longtrain.data.tokenizer import sample_for_training, train_bpe

        t = time.monotonic()
        files = sorted(self.books.iterdir())
        tok = train_bpe(sample_for_training((f.read_text(errors="replace") for f in files), len(files)), self.size["vocab"])
        self.results["tokenizer"] = {"vocab": tok.get_vocab_size(), "seconds": round(time.monotonic() - t, 1)}
        self.say(f"tokenizer: {tok.get_vocab_size()} tokens in {time.monotonic() - t:.1f} s")
        return tok

    def pretrain(self, tok) -> Path:
        """Random Pythia-shaped model, trained briefly from scratch with plain PyTorch; saved as an HF folder."""
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        s, dev = self.size, self.device
        ids = np.concatenate([np.array(e.ids + [0],
            dtype=np.int32) for e in tok.encode_batch([f.read_text(errors="replace") for f in sorted(self.books.iterdir())])])
        vocab = -(-tok.get_vocab_size() // 128) * 128  # rounded up, as Pythia's 50304
        cfg = GPTNeoXConfig(
            vocab_size=vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            intermediate_size=s["mlp"], rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
            max_position_embeddings=s["seq"], tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        )
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(cfg).to(dev).train()
        params = sum(p.numel() for p in model.parameters())
        steps, B, T = s["pre_steps"], s["pre_batch"], s["seq"]
        t = time.monotonic()
        losses = self.pretrain_windows(model, ids, steps=steps, batch=B, length=T, lr=s["pre_lr"], log_every=max(1, steps // 10))
        secs = time.monotonic() - t
        self.results["pretrain"] = {
            "how": "plain PyTorch on transformers' GPTNeoXForCausalLM, random windows, full attention, bf16 autocast",
            "params": params, "steps": steps, "tokens_per_step": B * T, "seconds": round(secs, 1),
            "tokens_per_s": round(steps * B * T / secs), "loss_first": losses[0], "loss_last_10_mean": float(np.mean(losses[-10:])),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
            "corpus_tokens": int(len(ids)),
        }
        out = self.work / "hf-pretrained"
        model.to("cpu").save_pretrained(out)
        tok.save(str(out / "tokenizer.json"))
        del model  # (the optimizer went with pretrain_windows)
        if dev == "cuda":
            torch.cuda.empty_cache()
        return out

    def finetune(self, source: Path, run: Path, extra: list[str], name: str) -> dict:
        s = self.size
        sets = {
            "train.init_from": source, "data.path": self.books, "data.valid": self.valid, "train.steps": s["ft_steps"],
            "train.warmup_steps": min(100, s["ft_steps"] // 2), "train.chunk_size": s["ft_chunk"], "train.batch_docs": s["ft_batch"],
            "train.grad_accum": 1, "train.valid_every": 0, "attention.topk": s["k"], "attention.window": s["w"],
            "checkpoint.every": s["ft_steps"], "train.device": self.device, "logging.progress": "false",
            "data.min_doc_tokens": 1024 if self.args.tiny else 4096,
        }
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        t = time.monotonic()
        self.longtrain("fit", REPO / "recipes/finetune-pythia.yaml", "--run-dir", run, *args, *extra)
        wall = time.monotonic() - t
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        shutil.copy(run / "metrics.jsonl", self.args.out / f"metrics_finetune_{name}.jsonl")
        a = rows[min(10, len(rows) - 2)]  # steady state: after the first steps (compiles, warm caches)
        b = rows[-1]
        return {
            "steps": b["step"], "tokens": b["tokens"], "wall_seconds_incl_startup": round(wall, 1),
            "tokens_per_s": round((b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])),
            "tokens_per_s_window": [a["step"], b["step"]],
            "peak_memory_gib": round(max(r["memory_bytes"] for r in rows) / 2**30, 2),
            "loss_first": rows[0]["loss"], "loss_last": b["loss"], "extra": extra,
        }

    def evaluate(self, ckpt: Path) -> dict:
        """Validation loss with the trainer's evaluate (same documents and chunking for every model)."""
        from longtrain.data import DataConfig, TokenizerConfig, prepare_corpus
        from longtrain.train.checkpoint import load_checkpoint, resolve_checkpoint
        from longtrain.train.validation import evaluate

        s = self.size
        path = resolve_checkpoint(ckpt)
        t = time.monotonic()
        loaded = load_checkpoint(path, device=self.device)
        data = DataConfig(source="files", path=str(self.valid), min_doc_tokens=1024 if self.args.tiny else 4096)
        corpus = prepare_corpus(data, TokenizerConfig(path=str(path / "tokenizer.json")), progress=False)
        cfg = SimpleNamespace(batch_docs=min(4, s["eval_docs"]), chunk_size=s["ft_chunk"], valid_docs=s["eval_docs"],
            valid_tokens=s["eval_tokens"])
        loss = evaluate(loaded.model, SimpleNamespace(valid=corpus.train), cfg, torch.device(self.device))
        out = {"loss": loss, "ppl": math.exp(min(loss, 700)), "docs": min(s["eval_docs"], len(corpus.train)),
               "tokens_per_doc": s["eval_tokens"],
               "chunk": s["ft_chunk"], "attention": loaded.recipe.attention.type, "seconds": round(time.monotonic() - t, 1)}
        del loaded
        if self.cli_has_eval():
            js = self.work / f"eval-{ckpt.name}.json"
            self.longtrain("eval", path, "--data", f"{self.valid}/*.txt", "--docs", s["eval_docs"], "--tokens", s["eval_tokens"],
                "--task", "ppl", "--json", js)
            out["longtrain_eval"] = json.loads(js.read_text())
        self.say(f"eval {ckpt.name}: loss {loss:.4f} (ppl {out['ppl']:.2f})")
        return out

    # ------------------------------------------------------------------ helpers

    def cli_has_eval(self) -> bool:
        if not hasattr(self, "_has_eval"):
            r = subprocess.run([sys.executable, "-m", "longtrain.cli", "eval", "--help"], capture_output=True, env=self.env(), cwd=REPO)
            self._has_eval = r.returncode == 0
            self.results["longtrain_eval_cli"] = self._has_eval
        return self._has_eval

    def env(self) -> dict:
        return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")

    def longtrain(self, *args) -> None:
        cmd = [sys.executable, "-m", "longtrain.cli", *map(str, args)]
        self.say("$ longtrain " + " ".join(map(str, args)))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env(), cwd=REPO)
        for line in proc.stdout:
            self.say(line.rstrip())
        if proc.wait():
            raise SystemExit(f"longtrain {args[0]} failed with exit code {proc.returncode}; see {self.args.out / 'log.txt'}")

    def summary(self) -> str:
        r = self.results
        p = r["pretrain"]
        lines = [
            f"device: {r['device']}; model: GPT-NeoX {self.size['layers']} x {self.size['hidden']} "
            f"({p['params'] / 1e6:.1f}M parameters), vocab {r['tokenizer']['vocab']}",
            f"pretrain (plain PyTorch, full attention, {p['steps']} steps x {p['tokens_per_step']} tokens): "
            f"{p['tokens_per_s']:,} tokens/s, "
            f"loss {p['loss_first']:.3f} -> {p['loss_last_10_mean']:.3f}, peak {p['peak_memory_gib']} GiB",
        ]
        for name, f in r["finetune"].items():
            lines.append(
                f"fine-tune {name} (k={self.size['k']}, w={self.size['w']}, {f['steps']} steps): {f['tokens_per_s']:,} tokens/s "
                f"(steps {f['tokens_per_s_window'][0]}-{f['tokens_per_s_window'][1]}), peak {f['peak_memory_gib']} GiB, "
                f"loss {f['loss_first']:.3f} -> {f['loss_last']:.3f}"
            )
        e = next(iter(r["eval"].values()))
        lines.append(f"validation ({e['docs']} books x {e['tokens_per_doc']} tokens, chunks of {e['chunk']}):")
        lines += [f"  {name:40s} loss {v['loss']:.4f}  ppl {v['ppl']:.2f}" for name, v in r["eval"].items()]
        lines.append(f"total {r['total_seconds']} s")
        return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
