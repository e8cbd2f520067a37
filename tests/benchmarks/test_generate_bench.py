"""benchmarks/generate.py's --inductor: KEY=VALUE settings of torch._inductor.config for the compiled decode rows,
over Decoder's COMPILE_OPTIONS, parsed as each setting's type; an unknown key stops the script before anything runs, naming it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_inductor_settings_are_typed_and_override_the_decoders_options(monkeypatch):
    from generate import inductor_settings

    from longtrain import generate

    monkeypatch.setattr(generate, "COMPILE_OPTIONS", {"freezing": True, "combo_kernels": True})
    errors = []
    assert inductor_settings("", errors.append) == {"freezing": True, "combo_kernels": True}
    assert inductor_settings("freezing=0,combo_kernels=false,max_autotune=1", errors.append) == {
        "freezing": False, "combo_kernels": False, "max_autotune": True}
    assert generate.COMPILE_OPTIONS["max_autotune"] is True and not errors


def test_an_unknown_inductor_setting_is_refused_by_name(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--small", "--out", str(tmp_path),
                          "--inductor", "freezing=1,no_such_setting=3"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--inductor no_such_setting: torch._inductor.config has no such setting" in res.stderr
    assert not (tmp_path / "generate.json").exists()


def test_the_warm_prefix_holds_every_chunk_shape_of_the_prompt_and_no_more():
    import torch
    from generate import warm_prefix

    chunk = 8
    for n, expected in ((5, 5), (8, 8), (16, 16), (20, 20), (21, 21), (27, 19), (64, 16), (1000, 16)):
        # under a chunk: all of it; else two full chunks (from the empty cache, from a filled one) and the partial last
        prefix = warm_prefix(torch.arange(n)[None], chunk)
        assert prefix.shape == (1, expected), n
        assert torch.equal(prefix[0], torch.arange(expected))  # the prompt's own first tokens


def test_the_exact_check_finds_decoding_equal_to_the_forward_in_bf16():
    import torch
    from generate import decode_equals_forward

    from longtrain.model import LM, LMConfig

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=300, layers=2, d_model=32, heads=2, style="llama", attention="sparsek+sw", topk=8,
                        window=8)).to(torch.bfloat16).eval()
    res = decode_equals_forward(model, 100, 24, chunk=32, dev=torch.device("cpu"), exact=True)
    assert res["exact"] and res["selections_identical"] and res["max_abs_logit_diff"] == 0
    assert res["argmax_agreement"] == 1.0


def test_the_attention_floor_replaces_the_decode_op_and_only_inside_it():
    import torch
    from generate import attention_floor

    from longtrain.model import LM, LMConfig
    from longtrain.model import attention
    from longtrain.generate import prefill

    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=300, layers=2, d_model=32, heads=4, kv_heads=2, style="llama", attention="sparsek+sw",
                        topk=8, window=8)).eval()
    cache, _ = prefill(model, torch.randint(0, 300, (1, 40)), chunk_size=16)
    token = torch.tensor([5])
    real = attention.sparsek_attention_decode
    with torch.no_grad():
        expected = model.decode(token, cache).logits
        with attention_floor():
            assert attention.sparsek_attention_decode is not real
            out = model.decode(token, cache)
        assert attention.sparsek_attention_decode is real  # restored
        again = model.decode(token, cache).logits
    assert out.logits.shape == expected.shape and torch.isfinite(out.logits).all()
    assert not torch.equal(out.logits, expected)  # the op did not run: other logits
    assert torch.equal(again, expected)
    for before, after in zip(cache.layers, out.cache.layers):  # the floor leaves the attention cache as it was
        assert after.attn is before.attn
    with torch.no_grad(), attention_floor():  # a prefill chunk's op too
        floor_cache, floor_logits = prefill(model, torch.randint(0, 300, (2, 40)), chunk_size=16)
    assert floor_logits.shape == (2, 300) and torch.isfinite(floor_logits).all()
    assert all(la.attn.pool_pos.lt(0).all() for la in floor_cache.layers)  # nothing was selected into a pool
