"""`longtrain export CHECKPOINT --out HF_DIR`: a longtrain checkpoint as a Hugging Face model folder.

Writes `config.json`, `model.safetensors` and `tokenizer.json` (plus a small `tokenizer_config.json`
so `AutoTokenizer` finds it). The llama style becomes `LlamaForCausalLM` (`Qwen2ForCausalLM` with q/k/v
biases, `MistralForCausalLM` for a Mistral import or a plain sliding window); gptneox becomes
`GPTNeoXForCausalLM` (q, k and v fused back into query_key_value), and so does gpt2 (a GPT-NeoX
without parallel residual, with tied embeddings and full rotary). Weights are written in `--dtype`
(default float32, longtrain's own); an import exported in its source dtype gives back bitwise the
same tensors.

Every export records longtrain's attention settings (type, k, w, variant, ...) and rotary fraction in
config.json under `longtrain_sparsek`, with a note on what plain `transformers` computes otherwise;
`longtrain import` reads them back. A SparseK model's scoring vectors are written as extra tensors
(`...sparsek_score.weight`, one [G, d] per layer); plain `transformers` ignores them and the key and
runs full attention. A SparseK or SW model also gets `modeling_longtrain.py` and `configuration_longtrain.py`
(copied from longtrain/interop/remote/) and an `auto_map`, so that
`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` runs its SparseK attention in plain
PyTorch (RoPE from `longtrain_rope`: the inverse frequencies longtrain uses).

Anything else the family's config cannot say (hf_families.export_problems: a partial rotary fraction
in the Llama layout of a full-attention model, a parallel-residual Llama, ...) refuses the export
before anything is written: transformers would load it and compute another model. The folder is
written under a temporary name and renamed when complete, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from longtrain.data.tokenizer import eod_id
from longtrain.errors import UsageError
from longtrain.interop.hf_families import LLAMA_LIKE, MISTRAL, HFFormatError, export_family, export_problems, fuse_qkv, hf_config
from longtrain.model.attention_types import selects
from longtrain.path_args import checkpoint_arg
from longtrain.model.rope import inverse_frequencies
from longtrain.train.checkpoint import TOKENIZER_FILE, beside, load_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REMOTE_TYPES = ("sparsek+sw", "sparsek", "sw")  # what modeling_longtrain.py runs
REMOTE = Path(__file__).parent / "remote"
REMOTE_FILES = ("modeling_longtrain.py", "configuration_longtrain.py")
AUTO_MAP = {"AutoConfig": "configuration_longtrain.LongtrainConfig", "AutoModelForCausalLM": "modeling_longtrain.LongtrainForCausalLM"}


def hf_state_dict(model, source_type: str | None = None) -> dict[str, torch.Tensor]:
    """The HF tensors of a longtrain LM (its family: hf_families.export_family), scoring vectors included."""
    cfg = model.cfg
    if model.blocks[0].attn.phi_weight is not None:
        raise HFFormatError(f"attention {cfg.attention}: its linear attention (phi's head-wise maps) has no Hugging Face "
                            "layout; export a model of another attention type (nothing was written)")
    fam = export_family(cfg, source_type)
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = re.match(r"blocks\.(\d+)\.", key)
        i = int(m.group(1)) if m else None
        pattern = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", key)
        if key.endswith("scorer.weight"):
            out[fam.score.format(i=i)] = t
        elif fam.fused_qkv and re.match(r"blocks\.\{i\}\.attn\.[qkv]_proj\.", pattern):
            if ".q_proj." in key:  # fuse once per layer and kind, from the q key
                kind = key.rsplit(".", 1)[1]
                qkv = [state[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
                out[f"{fam.fused_qkv.format(i=i)}.{kind}"] = fuse_qkv(*qkv, cfg.heads)
        else:
            out[fam.names[pattern].format(i=i)] = t
    return out


def note(cfg, family) -> str:
    """config.json's word on what plain transformers computes otherwise than longtrain (nothing, for most exports)."""
    differs = []
    if selects(cfg.attention):
        differs.append("ignores this key and the *.sparsek_score.weight tensors (the scoring vectors) and runs full "
                       "causal attention instead of SparseK")
    elif cfg.attention == "sw" and family is not MISTRAL:
        differs.append(f"runs full causal attention instead of a sliding window of {cfg.window} keys")
    if family in LLAMA_LIKE and cfg.rotary_pct != 1.0:
        differs.append(f"rotates all of each head's dims instead of the first {cfg.rotary_dim} of {cfg.head_dim} (rotary_pct)")
    text = f"Written by longtrain: the model was trained with {cfg.attention} attention. "
    if not differs:
        return text + "transformers computes what longtrain does; `longtrain import` reads these settings back."
    return (text + "Plain transformers " + "; it ".join(differs) + ". from_pretrained(..., trust_remote_code=True) runs "
            "longtrain's model (modeling_longtrain.py); `longtrain import` reads these settings back.")


def export_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "float32", max_positions: int | None = None) -> Path:
    """Write the HF folder `out` for a checkpoint (or run dir); returns `out`."""

    if dtype not in DTYPES:
        raise UsageError(f"{dtype!r} is not a weight dtype of a Hugging Face folder: choose one of {', '.join(DTYPES)}", arg="dtype")
    if max_positions is not None and max_positions < 1:
        raise UsageError(f"must be at least 1; got {max_positions}", arg="max_positions")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFFormatError(f"{out} exists and is not an empty folder; choose another {{arg}} (nothing was written)", arg="out")
    loaded = load_checkpoint(checkpoint_arg(checkpoint), dtype=torch.float32)  # a missing path or a file: exit 2
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.cfg
    imported = loaded.meta.get("imported_from", {})
    source, source_type = imported.get("config", {}), imported.get("model_type")
    fam = export_family(cfg, source_type)
    remote = cfg.attention in REMOTE_TYPES
    problems = export_problems(cfg, fam, remote)
    if problems:
        raise HFFormatError(
            f"checkpoint {loaded.path} cannot be exported as {fam.architecture} without changing what it computes: "
            f"{'; '.join(problems)}. Nothing was written; run it with longtrain itself (eval, generate, longtrain.load)"
        )
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_dict(model, source_type).items()}

    eos = eod_id(tok)
    bos = next((tok.token_to_id(t) for t in ("<s>", "<|begin_of_text|>") if tok.token_to_id(t) is not None), eos)
    config = hf_config(fam, cfg, bos=bos, eos=eos, dtype=dtype, max_positions=max_positions or source.get("max_position_embeddings", 2048))
    # Every export records longtrain's settings, so that `longtrain import` restores them (and the remote code runs them).
    config["longtrain_sparsek"] = {
        "attention": cfg.attention, "topk": cfg.topk, "window": cfg.window, "variant": cfg.variant,
        "score_groups": cfg.score_groups, "timestep_norm": cfg.timestep_norm, "eps_slope": cfg.eps_slope,
        "qkv_bias": model.blocks[0].attn.q_proj.bias is not None, "layout": fam.model_type if fam.model_type == "gpt_neox" else "llama",
        "parallel_residual": cfg.parallel_residual, "rotary_pct": cfg.rotary_pct, "note": note(cfg, fam),
    }
    if remote:
        inv_freq, attention_factor = inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        config["longtrain_rope"] = {"inv_freq": inv_freq.tolist(), "attention_factor": attention_factor}
        config["auto_map"] = AUTO_MAP
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.id_to_token(eos) if eos is not None else None,
        "bos_token": tok.id_to_token(bos) if bos is not None else None,
        "model_max_length": config["max_position_embeddings"],
    }
    # The checkpoint's file as it is (the loaded tokenizer may carry an added end-of-document token).
    raw = beside(loaded.path, TOKENIZER_FILE)
    tokenizer = raw.read_bytes() if raw is not None else tok.to_str().encode()

    def fill(folder: Path) -> None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "tokenizer.json").write_bytes(tokenizer)
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        if remote:  # self-contained: the folder runs SparseK without longtrain installed
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE / name, folder / name)

    write_folder(out, fill)
    return out


def write_folder(out: Path, fill) -> None:
    """`fill(folder)` on a temporary sibling of `out`, renamed to `out` once complete (`out`: absent or an
    empty folder), so that a failed export leaves nothing behind."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise HFFormatError(f"cannot write {out}: {e}; choose another {{arg}} (nothing was written)", arg="out") from None
    try:
        fill(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp and safetensors create 0700 / 0600; the folder follows the umask
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HFFormatError(f"cannot write {out}: {e}; choose another {{arg}} (nothing was written)", arg="out") from None
    except BaseException:  # Ctrl-C, a bug: still no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise
