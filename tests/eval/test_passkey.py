"""Passkey prompts: exactly the asked length, the key once, at the asked depth; the scoring of answers."""

import pytest

from longtrain.eval.passkey import DEPTHS, FILLER, INSTRUCTION, answer_is_key, lengths_up_to, passkey_prompt


@pytest.mark.parametrize("length", [300, 1024, 2000])
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_key_appears_once_at_the_asked_depth(tokenizer, length, depth):
    key = "73915"
    p = passkey_prompt(tokenizer, length, depth, key)
    assert len(p.ids) == length
    text = tokenizer.decode(p.ids)
    assert text.count(key) == 1
    assert text.count(f"The pass key is {key}. Remember it.") == 1
    assert text.rstrip().endswith("What is the pass key? The pass key is")
    assert tokenizer.decode(p.ids[p.needle_start : p.needle_end]).strip() == f"The pass key is {key}. Remember it."
    # The depth is the share of the filler before the needle, to within one filler sentence group.
    unit = len(tokenizer.encode(FILLER).ids)
    before = text[: text.index(key)].count("The grass is green.")
    total = text.count("The grass is green.")
    assert abs(before - depth * total) <= 1, (before, total)
    question = len(tokenizer.encode(" What is the pass key? The pass key is").ids)
    if depth == 0:  # right after the instruction (and the partial filler that makes the length exact)
        assert p.needle_start <= len(tokenizer.encode(INSTRUCTION).ids) + unit
    if depth == 1:  # right before the question
        assert p.needle_end == length - question


def test_a_prompt_too_short_for_its_parts_is_refused(tokenizer):
    with pytest.raises(ValueError, match="needs at least"):
        passkey_prompt(tokenizer, 20, 0.5, "12345")


def test_lengths_and_answers():
    assert lengths_up_to(8192) == [1024, 2048, 4096, 8192]
    assert lengths_up_to(3000) == [1024, 2048, 3000]
    assert lengths_up_to(500) == [500]
    assert answer_is_key(" 12345. Remember", "12345")
    assert answer_is_key("12345", "12345")
    assert not answer_is_key(" 123456", "12345")
    assert not answer_is_key(" 1234 5", "12345")
    assert not answer_is_key(" the key", "12345")
