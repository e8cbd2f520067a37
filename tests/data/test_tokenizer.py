import pytest

from longtrain.data.tokenize import split_pieces, splits_exactly
from longtrain.data.tokenizer import EOD, eod_id, sample_for_training

from .corpora import GUTENBERG_VALID, make_text

TRICKY = "".join(
    f"{make_text(i, 30).rstrip()}{sep}" for i, sep in enumerate(["\n", " \n", "\n\n", "\n  ", "\r\n", "\n'", "\n1", "\t\n"] * 40)
)


def test_trained_tokenizer_has_eod_and_bounded_vocab(tiny_tokenizer):
    assert tiny_tokenizer.id_to_token(eod_id(tiny_tokenizer)) == EOD
    assert 257 <= tiny_tokenizer.get_vocab_size() <= 300
    assert splits_exactly(tiny_tokenizer)
    text = "Ünïcode and bytes \x00 never seen: 日本語"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text).ids) == text  # byte-level: no unknowns


def test_training_sample_is_bounded_and_deterministic():
    docs = [make_text(i, 2000) for i in range(10)]
    sample = list(sample_for_training(iter(docs), len(docs), budget=5000))
    assert sum(map(len, sample)) == 5000 and sample == list(sample_for_training(iter(docs), 10, budget=5000))
    assert sample[1] == docs[1][:500]  # an equal share of every document
    assert sum(map(len, sample_for_training(iter(docs), None, budget=3000))) == 3000


def test_pieces_encode_exactly_like_the_whole_text(tiny_tokenizer):
    texts = [TRICKY]
    if GUTENBERG_VALID.is_dir():
        texts.append(sorted(GUTENBERG_VALID.glob("*.txt"))[0].read_text()[:300_000])
    for text in texts:
        pieces = split_pieces(text, size=500)
        assert len(pieces) > 20 and "".join(pieces) == text
        whole = tiny_tokenizer.encode(text).ids
        split = [i for e in tiny_tokenizer.encode_batch(pieces) for i in e.ids]
        assert split == whole


@pytest.mark.parametrize("text", ["", "short", "x" * 2000])
def test_pieces_without_a_cut_stay_whole(text):
    assert split_pieces(text, size=100) == [text]
