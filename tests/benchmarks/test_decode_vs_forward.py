"""benchmarks/decode_vs_forward.py on a tiny model on the CPU: float64 decoding follows the forward pass (the same
selections), and in bf16 the first module that rounds apart is the attention (its output projection's input): the
projections before it sum in float64 on the CPU (chunk_invariant_linear), so they give a row the same bits."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_vs_forward  # noqa: E402

from longtrain.model import LM, LMConfig  # noqa: E402


def model(dtype):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=300, layers=2, d_model=32, heads=2, style="llama", attention="sparsek+sw", topk=8, window=8)
    return LM(cfg).to(dtype).eval()


IDS = torch.randint(0, 300, (1, 160), generator=torch.Generator().manual_seed(1))


def test_float64_decoding_keeps_the_forward_passes_selections():
    res = decode_vs_forward.compare(model(torch.float64), IDS, 128, 32)
    assert res["tokens"] == 32 and res["selections_differ_per_layer"] == [0, 0]
    assert res["max_abs_logit_diff"] < 1e-9
    assert "blocks.0.attn.q_proj" in res["differing_positions_per_module"]  # per-token outputs were compared


def test_in_bf16_the_attention_output_is_what_rounds_apart_first():
    res = decode_vs_forward.compare(model(torch.bfloat16), IDS, 128, 32)
    differing = [name for name, n in res["differing_positions_per_module"].items() if n]
    assert differing and differing[0] == "blocks.0.attn.o_proj", differing[:3]


def test_exact_decoding_rounds_nowhere_apart_in_bf16():
    res = decode_vs_forward.compare(model(torch.bfloat16), IDS, 128, 32, exact=True)
    assert res["selections_differ_per_layer"] == [0, 0] and res["max_abs_logit_diff"] == 0
    assert not any(res["differing_positions_per_module"].values())
    assert "blocks.0.attn.o_proj" in res["differing_positions_per_module"]  # the modules were compared
