"""The random keys and values of RULER's tasks, drawn from a seeded `random.Random`.

RULER draws its words from the `wonderwords` English lists (adjective-noun keys such as
"fragile-magnitude", and the common-words task's vocabulary); no list ships here, so words are
pronounceable pseudo-words made of 2-3 syllables ("tamiro", "vekudo"): unlimited, the same for
every tokenizer, and never a word the haystack text already holds.
"""

from __future__ import annotations

import random
import uuid

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def pseudo_word(rng: random.Random) -> str:
    """A lowercase word of 2 or 3 consonant-vowel syllables."""
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.choice((2, 3))))


def distinct_words(rng: random.Random, n: int, avoid: set[str] = frozenset()) -> list[str]:
    """n different pseudo-words, none in `avoid`, in the order drawn."""
    out, seen = [], set(avoid)
    while len(out) < n:
        w = pseudo_word(rng)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def random_value(rng: random.Random, kind: str) -> str:
    """A key or value of RULER's kinds: "words" (word-word), "numbers" (7 digits) or "uuids"."""
    if kind == "words":
        return f"{pseudo_word(rng)}-{pseudo_word(rng)}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown value kind {kind!r}: words, numbers or uuids")


def distinct_values(rng: random.Random, kind: str, n: int, avoid: set[str] = frozenset()) -> list[str]:
    """n different values of `kind`, none in `avoid`."""
    out: dict[str, None] = {}  # insertion-ordered set
    while len(out) < n:
        v = random_value(rng, kind)
        if v not in avoid:
            out.setdefault(v)
    return list(out)
