"""RULER's synthetic task families: templates and generators of prompts of a given token length.

Each task (RULER's names and settings, scripts/synthetic.yaml there) builds its prompt from a
haystack of `n` units (noise sentences, sentences of a book, distractor needles, list words) around
what the question asks for; `make_sample` picks the largest `n` whose prompt, in the model's own
tokenizer, leaves room for the answer: prompt + max_new_tokens <= length, as RULER fits its
`max_seq_length`. A sample is a pure function of (task, length, seed, index): the same prompt on
every run and every machine with the same tokenizer.

  niah_*    needle in a haystack: "One of the special magic {numbers} for {key} is: {value}." hidden
            in noise (repeat), in book text (essay) or among other needles (needle); single,
            multi-key (distractor keys), multi-value (4 values for one key), multi-query (4 keys asked).
  vt        variable tracking: a chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops) in noise; name
            every variable that holds the value. One in-context example first.
  cwe       common words: a numbered list where 10 words appear 30 times and the rest 3 times; name
            the 10 common ones. One in-context example first.
  fwe       frequent words: coded words drawn from a Zipf law (alpha 2); name the 3 most frequent
            after the noise word "...".

Where these prompts differ from RULER's (the templates, needles, answer prefixes, depths, counts
and token budgets are RULER's):
  - keys and the common-words vocabulary are pseudo-words ("tamiro-vekudo"), not wonderwords'
    English adjective-noun pairs (values.py);
  - the essay haystack is text of the evaluation documents (the run's validation books or --data),
    not Paul Graham's essays, split into sentences by punctuation (not nltk);
  - repeat and needle haystacks place needles at positions drawn with replacement (RULER: without),
    so a prompt of any size can hold them; a VAR statement ends with a period;
  - vt's in-context example takes up to 470 tokens (RULER: a 500-token example incl. its answer),
    at most a quarter of the prompt at short lengths;
  - qa_1 and qa_2 (SQuAD, HotpotQA) are left out: they need downloads.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from longtrain.errors import PromptTooLong  # noqa: F401  (raised here; defined with the others)
from longtrain.eval.ruler.values import distinct_values, distinct_words

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)), in percent

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
VT_ICL_TOKENS = 500 - 30  # RULER's example: 500 tokens with its 30-token answer

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
)
CWE_ANSWER = " Answer: The top {num_cw} words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
ZETA_2 = math.pi**2 / 6  # zeta(FWE_ALPHA): the Zipf law's normaliser


@dataclass
class Built:
    """One prompt's text and what the question asks for."""

    text: str  # the whole prompt, answer prefix included
    answers: list[str]  # string_match_all looks for each of them in the continuation
    needles: list[tuple[int, str]] = field(default_factory=list)  # (character offset in text, sentence) of each needle
    depths: list[float] = field(default_factory=list)  # each needle's place in the haystack, 0 (first) .. 1 (last)


@dataclass
class Sample:
    task: str
    length: int  # the budget: prompt tokens + max_new_tokens <= length
    index: int
    text: str
    ids: list[int]  # the prompt's tokens
    answers: list[str]
    max_new_tokens: int
    haystack_units: int  # noise sentences, book sentences, distractor needles or list words
    needles: list[tuple[int, str]]
    depths: list[float]


# ----------------------------------------------------------------------------- assembling text


def place(head: str, units: list[str], items: list[str], slots: list[int], sep: str, tail: str) -> tuple[str, list[int]]:
    """head + units joined by sep, items[i] inserted before units[slots[i]] (slots nondecreasing; len(units):
    after the last) + tail; returns the text and each item's character offset in it."""
    pieces, which = [], []  # which[p]: the item index of piece p, or -1 for a unit
    j = 0
    for i in range(len(units) + 1):
        while j < len(items) and slots[j] == i:
            pieces.append(items[j])
            which.append(j)
            j += 1
        if i < len(units):
            pieces.append(units[i])
            which.append(-1)
    offsets = [0] * len(items)
    pos = len(head)
    for p, (piece, w) in enumerate(zip(pieces, which)):
        if p:
            pos += len(sep)
        if w >= 0:
            offsets[w] = pos
        pos += len(piece)
    return head + sep.join(pieces) + tail, offsets


def split_template(template: str, **fields) -> tuple[str, str]:
    """The template's text before and after {context}, its other fields filled."""
    head, tail = template.split("{context}")
    return head.format(**fields), tail.format(**fields)


# ----------------------------------------------------------------------------- the families


@dataclass(frozen=True)
class Family:
    """What the fitter reads of every family: the answer's token budget and the fewest haystack units a prompt
    has (keywords, so that each family's own fields come first and the registry sets these per task)."""

    max_new_tokens: int = field(default=128, kw_only=True)
    min_units: int = field(default=0, kw_only=True)


@dataclass(frozen=True)
class Niah(Family):
    haystack: str  # "repeat" (noise), "essay" (book sentences) or "needle" (distractor needles)
    key: str  # "words" | "numbers" | "uuids"
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1

    def build(self, rng: random.Random, n: int, length: int, haystack: list[str]) -> Built:
        keys = distinct_values(rng, self.key, self.keys)
        values = [distinct_values(rng, self.value, self.values) for _ in keys]
        needles = [NEEDLE.format(type_v=self.value, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(self.keys), self.queries)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        template, answer_prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER, self.value
        if self.queries * self.values == 1:  # RULER's singular wording
            swap = [("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")]
            for a, b in swap:
                template, answer_prefix = template.replace(a, b), answer_prefix.replace(a, b)
            type_v = type_v[:-1]
        head, tail = split_template(template + answer_prefix, type_v=type_v, query=query)

        if self.haystack == "essay":
            units = [haystack[i % len(haystack)] for i in range(n)] if n else []
            slots = sorted(n * d // 100 for d in rng.sample(NIAH_DEPTHS, len(needles)))
            sep = " "
        else:
            if self.haystack == "repeat":
                units = [NOISE] * n
            else:  # distractor needles: other keys, never one of the real ones
                others = distinct_values(rng, self.key, n, avoid=set(keys))
                units = [NEEDLE.format(type_v=self.value, key=k, value=distinct_values(rng, self.value, 1)[0]) for k in others]
            slots = sorted(rng.randint(0, n) for _ in needles)
            sep = "\n"
        text, offsets = place(head, units, needles, slots, sep, tail)
        return Built(text, answers, list(zip(offsets, needles)), [s / max(n, 1) for s in slots])


@dataclass(frozen=True)
class VariableTracking(Family):
    chains: int = 1
    hops: int = 4

    def chain(self, rng: random.Random, name_len: int) -> tuple[list[list[str]], list[list[str]], str]:
        """(variables per chain, statements per chain, the first chain's value)."""
        per = self.hops + 1
        names: list[str] = []
        while len(names) < self.chains * per:
            v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
            if v not in names:
                names.append(v)
        variables = [names[i : i + per] for i in range(0, len(names), per)]
        statements, first = [], None
        for vs in variables:
            value = str(rng.randint(10000, 99999))
            first = first or value
            statements.append([f"VAR {vs[0]} = {value}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(self.hops)])
        return variables, statements, first

    def one(self, rng: random.Random, n: int, name_len: int) -> Built:
        variables, statements, value = self.chain(rng, name_len)
        head, tail = split_template(VT_TEMPLATE + VT_ANSWER, query=value, num_v=self.hops + 1)
        units = [NOISE] * n
        items, slots = [], []
        for chain in statements:  # each chain in order, at positions of its own
            items += chain
            slots += sorted(rng.randint(0, n) for _ in chain)
        order = sorted(range(len(items)), key=lambda i: (slots[i], i))  # a chain's statements stay in order
        items, slots = [items[i] for i in order], [slots[i] for i in order]
        text, offsets = place(head, units, items, slots, "\n", tail)
        return Built(text, variables[0], list(zip(offsets, items)), [s / max(n, 1) for s in slots])

    def build(self, rng: random.Random, n: int, length: int, haystack: list[str], icl: str = "") -> Built:
        main = self.one(rng, n, 5)
        if not icl:
            return main
        sep = "\n\n"
        shift = len(icl) + len(sep)
        return Built(icl + sep + main.text, main.answers, [(o + shift, s) for o, s in main.needles], main.depths)

    def icl_example(self, rng: random.Random, n: int) -> str:
        """The in-context example (3-letter names), its answer written out."""
        ex = self.one(rng, n, 3)
        return ex.text + " ".join(ex.answers)  # the answer prefix ends with a space


@dataclass(frozen=True)
class CommonWords(Family):
    common: int = 10
    common_repeats: int = 30
    uncommon_repeats: int = 3

    def example(self, rng: random.Random, words: list[str], common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        common, uncommon = words[: self.common], words[self.common :]
        listed = common * common_repeats + uncommon * uncommon_repeats
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def build(self, rng: random.Random, n: int, length: int, haystack: list[str]) -> Built:
        # RULER's in-context example: 40 words (10 x 10, 30 x 3), or 20 (10 x 3, 10 x 1) below 4k tokens
        icl_words, icl_reps = (40, (10, 3)) if length >= 4096 else (20, (3, 1))
        icl = distinct_words(rng, icl_words)
        icl_context, icl_answer = self.example(rng, icl, *icl_reps)
        words = distinct_words(rng, n, avoid=set(icl))
        context, answers = self.example(rng, words, self.common_repeats, self.uncommon_repeats)
        q = {"num_cw": self.common}
        example = (CWE_TEMPLATE + CWE_ANSWER).format(context=icl_context, **q) + " " + " ".join(
            f"{i + 1}. {w}" for i, w in enumerate(icl_answer)
        )
        head, tail = split_template(CWE_TEMPLATE + CWE_ANSWER, **q)
        return Built(example + "\n" + head + context + tail, answers)


@dataclass(frozen=True)
class FrequentWords(Family):
    word_len: int = 6

    def counts(self, n: int, vocab: int) -> list[int]:
        """Occurrences of the word of each rank k = 1..vocab: int(n k^-alpha / zeta(alpha)), as RULER."""
        return [int(n * (k**-FWE_ALPHA) / ZETA_2) for k in range(1, vocab + 1)]

    def build(self, rng: random.Random, n: int, length: int, haystack: list[str]) -> Built:
        vocab = distinct_values_coded(rng, max(length // 50, 8), self.word_len)
        vocab[0] = "..."  # the most frequent "word" is noise (RULER)
        words = [w for w, c in zip(vocab, self.counts(n, len(vocab))) for _ in range(c)]
        rng.shuffle(words)
        head, tail = split_template(FWE_TEMPLATE + FWE_ANSWER)
        return Built(head + " ".join(words) + tail, vocab[1:4])


def distinct_values_coded(rng: random.Random, n: int, word_len: int) -> list[str]:
    """n different random lowercase strings of word_len letters (fwe's coded words)."""
    out: dict[str, None] = {}  # insertion-ordered set
    while len(out) < n:
        out.setdefault("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    return list(out)


# RULER's 11 synthetic tasks (its qa_1, qa_2 need downloads), with one example each for --help and README.
TASKS: dict[str, Family] = {
    "niah_single_1": Niah("repeat", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", keys=4, queries=4),
    "vt": VariableTracking(max_new_tokens=30),
    "cwe": CommonWords(max_new_tokens=120, min_units=10),  # units: words in all, the common ones at least
    "fwe": FrequentWords(max_new_tokens=50),  # units: words drawn (N); the vocabulary is length // 50 coded words
}


def uses_book_text(task: str) -> bool:
    spec = TASKS[task]
    return isinstance(spec, Niah) and spec.haystack == "essay"


# ----------------------------------------------------------------------------- fitting to a length


def sample_rng(task: str, length: int, seed: int, index: int, part: str = "") -> random.Random:
    """The generator of one sample (str seeds hash with SHA-512: the same on every run and machine)."""
    return random.Random(f"ruler:{task}:{length}:{seed}:{index}{part}")


def largest_fitting(count: Callable[[int], int], budget: int, low: int, guess: int, step: int | None = None) -> int:
    """The largest n >= low with count(n) <= budget (count grows with n; count(low) fits), searched from
    `guess`: steps (default ~0.5% of it) away from it, doubling until one side is passed, then bisection
    (each count is an encode of the whole prompt: a good guess saves most of them)."""
    g = max(guess, low)
    step = step or max(1, g // 200)
    if count(g) <= budget:
        lo, hi = g, None
        while hi is None:
            probe = lo + step
            lo, hi = (probe, None) if count(probe) <= budget else (lo, probe)
            step *= 2
    else:
        lo, hi = None, g
        while lo is None:
            probe = max(low, hi - step)
            lo, hi = (probe, hi) if probe == low or count(probe) <= budget else (None, probe)
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return lo


def _builder(task: str, tokenizer, length: int, seed: int, index: int, haystack: list[str]) -> Callable[[int], Built]:
    """build(n): the sample's prompt with n haystack units (vt: its in-context example fitted first)."""
    spec = TASKS[task]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    icl = ""
    if isinstance(spec, VariableTracking):
        icl_budget = min(VT_ICL_TOKENS, length // 4)

        def icl_text(n: int) -> str:
            return spec.icl_example(sample_rng(task, length, seed, index, ":icl"), n)

        least = len(encode(icl_text(0)))
        if least > icl_budget:  # the example may take a quarter of the prompt
            raise PromptTooLong(task, length, 4 * least)
        icl = icl_text(largest_fitting(lambda n: len(encode(icl_text(n))), icl_budget, 0, 16))

    def build(n: int) -> Built:
        args = (sample_rng(task, length, seed, index), n, length, haystack)
        return spec.build(*args, icl=icl) if icl else spec.build(*args)

    return build


def check_room(task: str, tokenizer, length: int) -> None:
    """Raise PromptTooLong when a `task` prompt with no haystack and its answer do not fit `length` tokens."""
    spec = TASKS[task]
    build = _builder(task, tokenizer, length, 0, 0, ["."])
    least = len(tokenizer.encode(build(spec.min_units).text, add_special_tokens=False).ids)
    if least + spec.max_new_tokens > length:
        raise PromptTooLong(task, length, least + spec.max_new_tokens)


def make_sample(
    task: str, tokenizer, length: int, *, seed: int = 0, index: int = 0, haystack: list[str] | None = None,
    guess: int | None = None,
) -> Sample:
    """Sample `index` of `task` at `length` tokens: the most haystack that leaves room for the answer.

    haystack: sentences of book text (the essay tasks); guess: a haystack size to search from (the
    previous sample's, to save encodes).
    """
    spec = TASKS[task]
    budget = length - spec.max_new_tokens
    if uses_book_text(task) and not haystack:
        raise ValueError(f"{task} needs book text for its haystack (sentences); none given")
    build = _builder(task, tokenizer, length, seed, index, haystack or [])

    def count(n: int) -> int:
        return len(tokenizer.encode(build(n).text, add_special_tokens=False).ids)

    least = count(spec.min_units)
    if least > budget:
        raise PromptTooLong(task, length, least + spec.max_new_tokens)
    step = 1  # a guess from the previous sample of the cell is off by a few units at most
    if guess is None:  # from the tokens a few units add, then once more from the tokens that many add
        low, step = spec.min_units, None
        guess = low + int((budget - least) * 16 / max(count(low + 16) - least, 1))
        guess = low + int((guess - low) * (budget - least) / max(count(guess) - least, 1))
    n = largest_fitting(count, budget, spec.min_units, guess, step)
    built = build(n)
    ids = tokenizer.encode(built.text, add_special_tokens=False).ids
    return Sample(task=task, length=length, index=index, text=built.text, ids=ids, answers=built.answers,
                  max_new_tokens=spec.max_new_tokens, haystack_units=n, needles=built.needles, depths=built.depths)


# ----------------------------------------------------------------------------- book text


SENTENCE = re.compile(r"[^.!?]+[.!?]+[\"'”’)\]]*")


def book_sentences(texts: list[str]) -> list[str]:
    """Sentences of the texts, whitespace collapsed (a hard-wrapped book reads as running text)."""
    out = []
    for text in texts:
        flat = " ".join(text.split())
        out += [s.strip() for s in SENTENCE.findall(flat) if s.strip()]
    return out
