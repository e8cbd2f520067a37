"""`longtrain import HF_DIR --out RUN_DIR`: a local Hugging Face model folder as a longtrain run.

Reads `config.json`, the safetensors weights (one file, or shards listed by
`model.safetensors.index.json`) with `safetensors` and `tokenizer.json` with `tokenizers`: no network
and no `transformers`. Families: Llama (1-3, TinyLlama), Mistral, Qwen2 and GPT-NeoX (Pythia),
with plain or scaled RoPE (linear, dynamic, yarn, llama3); see hf_families. Writes
`RUN_DIR/checkpoints/step-00000000/` (float32 weights in longtrain's layout, the recipe, the tokenizer)
and `RUN_DIR/recipe.yaml`, so `fit` (through `train.init_from`), `eval`, `generate` and
`verify-equivalence` take it like any checkpoint. Imported with `--attention full`, the
model computes what the Hugging Face one does (CI compares logits with `transformers`).

With a SparseK attention type each layer gains a scoring vector w_score [G, d] (G = 1 shared, or one
per KV head). `--score-init`:

- `mimic` (paper section 3.5): w = w' / ||w'|| with, per score group,
  w' = Σ_h W_Q,h (W_K,h)ᵀ 1, summed over the group's query heads h, where W_Q,h and W_K,h (d × D) are
  head h's query and key projections in the row convention q = x W_Q (for grouped-query attention,
  W_K,h is the KV head that h reads) and 1 is the all-ones d-vector. The raw score of token j is then
  x_j · w' = Σ_h (x_j W_Q,h) · (1ᵀ W_K,h): the attention logit (unscaled, before RoPE, without biases)
  of token j's query against the key an all-ones input would have, summed over the heads. It is
  the paper's formula as written, a query-independent summary of W_Q W_Kᵀ computed once from the
  pretrained weights; TimestepNorm removes its offset and scale along the document.
- `random`: N(0, 1/d) entries, as a from-scratch model starts (seeded by `--seed`).

A folder that `longtrain export` wrote from a SparseK model carries the scoring vectors as extra
tensors; importing it with a SparseK type of the same groups takes them instead of initialising.
Every export records its attention settings and rotary fraction (config.json's `longtrain_sparsek`):
what the flags leave unset comes from there (`attention_settings`, hf_families.model_section).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from longtrain.data import DataError
from longtrain.data.tokenizer import EOD, EOD_CANDIDATES, eod_id, load_tokenizer
from longtrain.interop.hf_families import Family, HFFormatError, family_of, model_section, split_qkv
from longtrain.model import LM, LMConfig
from longtrain.model.attention import initial_linear_log_gain
from longtrain.model.attention_types import USES
from longtrain.model.scoring import mimic_score_weight
from longtrain.path_args import input_folder
from longtrain.train.checkpoint import RECIPE_FILE, TOKENIZER_FILE, CheckpointManager, checkpoint_files
from longtrain.train.recipe import Recipe, recipe_to_yaml

INDEX = "model.safetensors.index.json"
DEFAULT_K = DEFAULT_W = 512  # the paper's fine-tuning: k = w = 512
HF_FOLDER = "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"


@dataclass
class HFFolder:
    path: Path
    config: dict[str, Any]
    family: Family
    tensors: dict[str, tuple[Path, tuple[int, ...], str]]  # HF name -> (file, shape, dtype)

    def load(self, name: str) -> torch.Tensor:
        file = self.tensors[name][0]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)


def read_folder(path: str | Path) -> HFFolder:
    """config.json and the tensor index of a Hugging Face model folder (no tensor is loaded yet)."""
    path = input_folder(path, HF_FOLDER)  # no such path, or a file: the argument cannot work (exit 2)
    if not (path / "config.json").is_file():
        raise HFFormatError(f"{path} has no config.json: give {HF_FOLDER}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise HFFormatError(f"{path / 'config.json'} does not parse as JSON: {e}") from None
    family = family_of(config)
    files = _weight_files(path)
    tensors: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    sl = f.get_slice(name)
                    tensors[name] = (file, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise HFFormatError(f"{file} is not a readable safetensors file: {e}") from None
    return HFFolder(path, config, family, tensors)


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise HFFormatError(f"{path / INDEX} is not a safetensors index (no weight_map): {e}") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFFormatError(f"{path / INDEX} lists shards that are not in the folder: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")] + [p.name for p in path.glob("*.pth")]
        hint = (
            f" It has {', '.join(other)}: convert it first, e.g. with transformers: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
        ) if other else ""
        raise HFFormatError(f"{path} has no weights (*.safetensors or {INDEX}).{hint}")
    return files


def _layer_pattern(key: str) -> tuple[str, int | None]:
    m = re.match(r"blocks\.(\d+)\.", key)
    return (re.sub(r"^blocks\.\d+\.", "blocks.{i}.", key), int(m.group(1))) if m else (key, None)


def convert(
    folder: HFFolder, *, attention: str, topk: int, window: int, score_init: str, score_groups: str = "shared", seed: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """(recipe model section, longtrain float32 state dict, notes) for the folder's weights."""

    fam, config = folder.family, folder.config
    section = model_section(fam, config)
    try:
        cfg = LMConfig(**section, attention=attention, topk=topk, window=window, score_groups=score_groups)
    except ValueError as e:
        raise HFFormatError(f"config.json describes a model longtrain cannot build: {e}") from None
    with torch.device("meta"):  # names and shapes only: no memory, no init
        expected = {k: tuple(v.shape) for k, v in LM(cfg).state_dict().items()}

    # Where each longtrain tensor comes from (HF name, and which third of a fused q/k/v), and the
    # HF shape that config.json implies for it.
    sources: dict[str, tuple[str, int | None]] = {}
    want: dict[str, tuple[int, ...]] = {}
    score_names: dict[str, str] = {}
    linear_keys = []  # linear types: phi's head-wise maps and the linear gain, which no HF model has (they start as at init)
    for key, shape in expected.items():
        pattern, i = _layer_pattern(key)
        if key.endswith("scorer.weight"):
            score_names[key] = fam.score.format(i=i)
            continue
        if key.endswith(("phi_weight", "linear_log_gain")):
            linear_keys.append(key)
            continue
        proj = re.match(r"blocks\.\{i\}\.attn\.([qkv])_proj\.(weight|bias)$", pattern)
        if fam.fused_qkv and proj:
            name, part = f"{fam.fused_qkv.format(i=i)}.{proj.group(2)}", "qkv".index(proj.group(1))
            want[name] = (3 * shape[0], *shape[1:])
        else:
            name, part = fam.names[pattern].format(i=i), None
            name = name if name in folder.tensors else fam.aliases.get(name, name)
            want[name] = shape
        sources[key] = (name, part)
    missing = sorted(n for n in want if n not in folder.tensors)
    if missing:
        raise HFFormatError(
            f"the weights lack {len(missing)} tensor(s) that config.json implies, e.g. {', '.join(missing[:3])}; "
            "is the folder complete (every shard)?"
        )
    bad = [f"{n}: weights {folder.tensors[n][1]} vs config {s}" for n, s in want.items() if folder.tensors[n][1] != s]
    if bad:
        raise HFFormatError(
            f"{len(bad)} tensor shape(s) disagree with config.json: {'; '.join(bad[:3])}; the config does not belong to these weights"
        )
    head = fam.names["unembed.weight"]
    ignorable = lambda n: (  # noqa: E731
        n.endswith(fam.ignored) or "sparsek_score" in n  # buffers; scoring vectors a full/sw import leaves out
        or (cfg.tied_embeddings and n in (head, fam.aliases.get(head)))  # a tied model's saved copy of the head
    )
    extra = [n for n in folder.tensors if n not in want and n not in score_names.values() and not ignorable(n)]
    if extra:
        raise HFFormatError(f"the weights hold {len(extra)} tensor(s) a {fam.model_type} model does not have, e.g. {', '.join(extra[:3])}")

    state: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple[torch.Tensor, ...]] = {}
    for key, (name, part) in sources.items():
        if part is None:
            t = folder.load(name)
        else:
            if name not in fused:
                fused[name] = split_qkv(folder.load(name), cfg.heads)
            t = fused[name][part]
        state[key] = t.to(torch.float32)
    notes = []
    if score_names:
        state |= _scores(folder, cfg, state, score_names, score_init, seed, notes)
    if linear_keys:
        state |= {k: torch.eye(expected[k][-1]).expand(expected[k]).clone() for k in linear_keys if k.endswith("phi_weight")}
        state |= {k: initial_linear_log_gain(expected[k][0], cfg.head_dim) for k in linear_keys if k.endswith("linear_log_gain")}
        gain = ", its gain per head from 1/F" if cfg.linear_gain == "learned" else ""
        notes.append(f"linear attention: phi = elu(x W) + 1 with every W the identity{gain} (learned in fine-tuning)")
    assert set(state) == set(expected), set(state) ^ set(expected)
    dtype = next(iter(folder.tensors.values()))[2]
    dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype)
    params = sum(t.numel() for k, t in state.items() if not k.endswith(("scorer.weight", "phi_weight", "linear_log_gain")))
    notes.insert(0, f"{fam.model_type}: {cfg.layers} layers × {cfg.d_model}, {params / 1e6:.2f}M parameters ({dtype} -> float32)")
    return section, state, notes


def _scores(folder: HFFolder, cfg, state, score_names: dict[str, str], how: str, seed: int, notes: list[str]) -> dict[str, torch.Tensor]:
    """The scoring vectors: the folder's own (exported from a SparseK model), or initialised."""
    G, d = cfg.score_group_count, cfg.d_model
    if all(n in folder.tensors and folder.tensors[n][1] == (G, d) for n in score_names.values()):
        notes.append(f"scoring vectors: taken from the folder ({next(iter(score_names.values()))} ...)")
        return {k: folder.load(n).to(torch.float32) for k, n in score_names.items()}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(score_names, key=lambda k: _layer_pattern(k)[1]):
        prefix = key.removesuffix("scorer.weight")
        if how == "mimic":
            out[key] = mimic_score_weight(state[prefix + "q_proj.weight"], state[prefix + "k_proj.weight"], cfg.heads, cfg.kv_heads, G)
        else:
            out[key] = torch.randn(G, d, generator=gen) * d**-0.5  # as Scorer.reset_parameters
    notes.append(f"scoring vectors: {how} (W_Q W_Kᵀ 1, normalised)" if how == "mimic" else f"scoring vectors: random (seed {seed})")
    return out


FINETUNE_RECIPES = {"llama": "finetune-llama", "gptneox": "finetune-pythia"}  # block style -> built-in recipe
SAVED_SETTINGS = ("variant", "timestep_norm", "eps_slope")  # what an export records beside type, k, w and groups


def attention_settings(
    saved: dict[str, Any] | None, attention: str | None, topk: int | None, window: int | None, score_groups: str | None,
    *, sw_window: int | None = None,
) -> tuple[dict[str, Any], str]:
    """The imported run's attention section and a note on where it came from.

    A folder `longtrain export` wrote records its attention under config.json's `longtrain_sparsek`:
    what the flags leave unset comes from there (k and w only when the type uses them), the rest from
    the defaults (sparsek+sw, k = w = 512, shared score groups; type sw: w = `sw_window`, a Mistral's own)."""

    saved = saved if isinstance(saved, dict) and saved.get("attention") in USES else None
    given = {"attention": attention, "score_groups": score_groups}
    attention = attention or (saved["attention"] if saved else "sparsek+sw")
    from_saved = []
    section: dict[str, Any] = {"type": attention}
    for key, value, default in (("topk", topk, DEFAULT_K), ("window", window, DEFAULT_W)):
        if key not in USES[attention]:
            if value is not None:  # the CLI checks a type it was given; this one came from the folder
                raise HFFormatError(f"{value}: attention {attention} (config.json's longtrain_sparsek) has no {key}; "
                                    "give the attention type sparsek+sw (or another type with it)", arg=key)
            section[key] = 0
        elif value is not None:
            section[key] = value
        elif saved and key in USES[saved["attention"]] and saved.get(key):
            section[key], _ = saved[key], from_saved.append(key)
        else:
            section[key] = sw_window if key == "window" and attention == "sw" and sw_window else default
    section["score_groups"] = score_groups or (saved or {}).get("score_groups", "shared")
    if saved:
        section |= {k: saved[k] for k in SAVED_SETTINGS if k in saved}
        from_saved += [k for k in ("attention", "score_groups") if given[k] is None and k in saved]
    where = f"; {', '.join(from_saved)} from config.json's longtrain_sparsek" if saved and from_saved else ""
    note = f"attention: {attention} (k={section['topk']}, w={section['window']}){where}"
    return section, note


def import_hf(
    hf_dir: str | Path,
    out: str | Path,
    *,
    attention: str | None = None,
    topk: int | None = None,
    window: int | None = None,
    score_init: str = "mimic",
    score_groups: str | None = None,
    seed: int = 0,
) -> tuple[Path, list[str], str]:
    """Convert `hf_dir` into the run dir `out`; returns (checkpoint path, notes, the built-in fine-tuning recipe).

    Unset attention settings come from the folder's `longtrain_sparsek` (an export), else the defaults."""

    out = Path(out).expanduser()
    manager = CheckpointManager(out, keep=1)
    if manager.steps() or (out / RECIPE_FILE).exists():
        raise HFFormatError(f"{out} already holds a run (recipe.yaml or checkpoints); choose another {{arg}} or remove it", arg="out")
    folder = read_folder(hf_dir)
    # Mistral's sliding window: full attention keeps it (max_context: what transformers computes), sw takes it as w.
    sliding = folder.config.get("sliding_window") if folder.family.model_type == "mistral" else None
    settings, attention_note = attention_settings(
        folder.config.get("longtrain_sparsek"), attention, topk, window, score_groups, sw_window=sliding
    )
    attention, topk, window, score_groups = (settings[k] for k in ("type", "topk", "window", "score_groups"))
    max_context = sliding if attention == "full" else None
    tok_file = folder.path / TOKENIZER_FILE
    if not tok_file.is_file():
        raise HFFormatError(
            f"{folder.path} has no tokenizer.json (the fast-tokenizer file). If it has a slow tokenizer only, write one with "
            "transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    tokenizer = _original_tokenizer(tok_file)
    eod_token, eod_note = _end_of_document(folder, tokenizer)
    try:
        raw_tok = load_tokenizer(tok_file, eod_token)  # adds an end-of-document token if it has none
    except DataError as e:
        raise HFFormatError(str(e)) from None
    section, state, notes = convert(folder, attention=attention, topk=topk, window=window, score_init=score_init,
        score_groups=score_groups, seed=seed)
    notes.insert(1, attention_note)
    if sliding:
        notes.append(
            f"sliding window {sliding} (config.json): kept as attention.max_context (remove it for whole-document attention)"
            if attention == "full" else f"sliding window {sliding} (config.json): attention {attention} uses w = {window}"
        )
    notes.append(eod_note)
    if section.get("rope_scaling"):
        notes.append(f"RoPE scaling: {section['rope_scaling']} (model.rope_scaling)")
    rows = state["embed.weight"].shape[0]
    if raw_tok.get_vocab_size() > rows:
        raise HFFormatError(
            f"tokenizer.json has {raw_tok.get_vocab_size()} tokens (end-of-document token included) but the embedding has "
            f"{rows} rows; this tokenizer does not belong to these weights"
        )

    recipe = Recipe.model_validate({
        "name": folder.path.name,
        "model": section,
        "attention": {**settings, "score_init": score_init, "max_context": max_context},
        "tokenizer": {"path": str((out / TOKENIZER_FILE).resolve()), "eod_token": eod_token},
        "train": {"steps": 1000, "lr": 3e-4, "warmup_steps": 100, "warmup_start_ratio": 0.1, "init_from": None},
    })
    meta = {
        "step": 0, "tokens": 0,
        "imported_from": {"path": str(folder.path.resolve()), "model_type": folder.family.model_type, "config": folder.config},
    }
    path = manager.save(0, tensors={"model": state}, meta=meta, files=checkpoint_files(recipe, tokenizer))
    finetune = FINETUNE_RECIPES[folder.family.style]
    header = (
        f"# imported from {folder.path.resolve()} by `longtrain import`; its train/data sections are placeholders:\n"
        f"# fine-tune with `longtrain fit {finetune} --set train.init_from={out}`\n"
    )
    (out / RECIPE_FILE).write_text(header + recipe_to_yaml(recipe))
    (out / TOKENIZER_FILE).write_text(tokenizer.to_str())
    return path, notes, finetune


def _end_of_document(folder: HFFolder, tokenizer) -> tuple[str | None, str]:
    """(tokenizer.eod_token for the recipe, a note): the tokenizer's usual names first (longtrain.data.
    tokenizer.EOD_CANDIDATES), else the model's own eos_token_id (config.json, then generation_config.json)."""

    named = eod_id(tokenizer)
    if named is not None:
        return None, f"end of document: {tokenizer.id_to_token(named)!r} (token {named})"
    sources = [("config.json", folder.config)]
    gen = folder.path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(("generation_config.json", json.loads(gen.read_text())))
        except ValueError as e:
            raise HFFormatError(f"{gen} does not parse as JSON: {e}") from None
    for file, config in sources:
        ids = config.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and tokenizer.id_to_token(i) is not None:
                return tokenizer.id_to_token(i), f"end of document: {tokenizer.id_to_token(i)!r} (eos_token_id {i} of {file})"
    return None, (
        f"end of document: the tokenizer has none of {', '.join(EOD_CANDIDATES)} and neither config.json nor "
        f"generation_config.json gives an eos_token_id the tokenizer knows, so {EOD} is added as token "
        f"{tokenizer.get_vocab_size()} (its embedding row is untrained); to use one of the tokenizer's own tokens "
        "instead, set tokenizer.eod_token in the fine-tuning recipe"
    )


def _original_tokenizer(path: Path):
    """The folder's tokenizer as it is (load_tokenizer adds the end-of-document token again when needed)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))

