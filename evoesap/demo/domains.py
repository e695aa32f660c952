"""Synthetic chat domains for the demo world: deterministic, disjoint splits, tiny vocabulary.

Each domain turns a `numpy.random.Generator` into (user, assistant) pairs. The domains differ in what
they exercise (arithmetic with worked steps, string algorithms, copying, memorised facts) so that a
small MoE trained on them routes them to different experts and pruning has visible consequences.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from evoesap.errors import ConfigError

# Evaluation first: when two splits would draw the same prompt, the earlier split keeps it.
SPLITS: tuple[str, ...] = ("evaluation", "search_heldout", "search", "calibration", "train")
SPLIT_SIZES: dict[str, int] = {"evaluation": 128, "search_heldout": 64, "search": 64, "calibration": 64}
# The facts domain trains on its whole knowledge base, so its size is what must be memorised in minutes.
FACT_SPLIT_SIZES: dict[str, int] = {"evaluation": 64, "search_heldout": 32, "search": 32, "calibration": 32}


@dataclass(frozen=True)
class Sample:
    """One chat exchange; `extra` holds task fields such as multiple-choice options."""

    user: str
    assistant: str
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> dict:
        row = {"messages": [{"role": "user", "content": self.user}, {"role": "assistant", "content": self.assistant}]}
        row.update(self.extra)
        return row


# ---------------------------------------------------------------------------------------------- math
_NAMES = ("Ann", "Bob", "Cai", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Lou", "Max")
_ITEMS = ("apples", "coins", "books", "pens", "shells", "cards", "stamps", "eggs")


def _math(rng: np.random.Generator) -> Sample:
    """Add-then-subtract word problem; the answer shows both steps so it is tens of tokens long.

    Single-digit operands keep the arithmetic a small table of facts (81 sums, ~150 differences) that a
    tiny model learns in a few minutes on a CPU, while names and items make tens of thousands of prompts.
    """
    name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
    a, b = int(rng.integers(1, 10)), int(rng.integers(1, 10))
    s = a + b
    c = int(rng.integers(1, min(9, s) + 1))
    user = f"{name} has {a} {item}, gets {b}, gives {c}. How many?"
    assistant = f"{a}+{b}={s}. {s}-{c}={s - c}. The answer is {s - c}."
    return Sample(user, assistant)


# ---------------------------------------------------------------------------------------------- code
_LETTERS = "abcdefgh"


def _balanced(brackets: str) -> bool:
    depth = 0
    for ch in brackets:
        depth += 1 if ch == "(" else -1
        if depth < 0:
            return False
    return depth == 0


def _code(rng: np.random.Generator) -> Sample:
    """A string transform a programmer would write: reverse, sort, or bracket matching.

    Bracket strings are 10-14 characters, half of them balanced (drawn uniformly within their class and
    length). Uniform strings of 4-8 characters were balanced 1 time in 12 and numbered 336 in all, so the
    evaluation and search splits took most balanced ones: training held 12 "yes" among 8,000 prompts, none of
    length 4, and the model answered "no" to all 5 balanced evaluation strings (code 121/128 exact match).
    """
    op = int(rng.integers(3))
    if op == 2:
        n, want = int(rng.integers(5, 8)) * 2, bool(rng.integers(2))
        while True:
            brackets = "".join("()"[int(i)] for i in rng.integers(0, 2, size=n))
            if _balanced(brackets) == want:
                return Sample(f"balanced {brackets}", "yes" if want else "no")
    word = "".join(_LETTERS[int(i)] for i in rng.integers(0, len(_LETTERS), size=int(rng.integers(3, 7))))
    if op == 0:
        return Sample(f"reverse {word}", word[::-1])
    return Sample(f"sort {word}", "".join(sorted(word)))


# ---------------------------------------------------------------------------------------------- copy
_SYMBOLS = string.ascii_lowercase + string.digits


def _copy(rng: np.random.Generator) -> Sample:
    """Verbatim copy: needs attention, not memory.

    A key lookup ("k=4 c=7 r=3; c?", also tried as "k4 c7 r3; find c" answered "c7") stayed near chance on a
    CPU budget of ~1000 steps, capping the domain near 0.6 exact match, so the domain is plain copying.
    """
    text = "".join(_SYMBOLS[int(i)] for i in rng.integers(0, len(_SYMBOLS), size=int(rng.integers(3, 8))))
    return Sample(f"copy {text}", text)


# --------------------------------------------------------------------------------------------- facts
_CITIES = ("Quenta", "Morvil", "Tasko", "Belund", "Xirra", "Pollen", "Dravik", "Sunmere", "Okara", "Vellis", "Rhun", "Caddis")
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def fact_table(seed: int, n: int) -> list[tuple[str, str]]:
    """The knowledge base the model memorises: `n` invented names, each living in one city."""
    rng = np.random.default_rng([seed, 7919])
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        parts = [rng.choice(list(_CONSONANTS if i % 2 == 0 else _VOWELS)) for i in range(5)]
        name = "".join(parts).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    cities = rng.integers(0, len(_CITIES), size=n)
    return [(name, _CITIES[int(c)]) for name, c in zip(names, cities)]


def _fact_sample(name: str, city: str, rng: np.random.Generator) -> Sample:
    """A fact as a question with its sentence answer plus a 4-way multiple-choice form of it."""
    distractors = [c for c in _CITIES if c != city]
    options = [str(c) for c in rng.choice(distractors, size=3, replace=False)]
    label = int(rng.integers(4))
    options.insert(label, city)
    choices = [f"{name} lives in {c}." for c in options]
    return Sample(f"Where does {name} live?", f"{name} lives in {city}.", {"choices": choices, "label": label})


# ------------------------------------------------------------------------------------------- domains
@dataclass(frozen=True)
class Domain:
    """A named generator; `memorised` domains train on their evaluation prompts by design (facts)."""

    name: str
    make: Callable[[np.random.Generator], Sample] | None
    memorised: bool = False
    multiple_choice: bool = False


DOMAINS: dict[str, Domain] = {
    "math": Domain("math", _math),
    "code": Domain("code", _code),
    "copy": Domain("copy", _copy),
    "facts": Domain("facts", None, memorised=True, multiple_choice=True),
}


def generate_splits(domain: str, seed: int, train_size: int) -> dict[str, list[Sample]]:
    """All splits of one domain; prompts never repeat across the evaluation/search/calibration splits.

    Generative domains also keep their training prompts out of every other split. The facts domain
    partitions its knowledge base over the evaluation/search/calibration splits and trains on all of it:
    recall of memorised facts is what it measures.
    """
    if domain not in DOMAINS:
        raise ConfigError(f"unknown demo domain {domain!r}; choose one of {sorted(DOMAINS)}")
    spec = DOMAINS[domain]
    rng = np.random.default_rng([seed, sorted(DOMAINS).index(domain)])
    sizes = dict(SPLIT_SIZES, train=train_size)
    out: dict[str, list[Sample]] = {}
    if spec.memorised:
        sizes = dict(FACT_SPLIT_SIZES)
        table = fact_table(seed, sum(sizes.values()))
        start = 0
        for split in SPLITS[:-1]:
            out[split] = [_fact_sample(n, c, rng) for n, c in table[start : start + sizes[split]]]
            start += sizes[split]
        out["train"] = [_fact_sample(n, c, rng) for n, c in table]
        return out
    seen: set[str] = set()
    assert spec.make is not None
    for split in SPLITS:
        samples: list[Sample] = []
        attempts = 0
        while len(samples) < sizes[split]:
            attempts += 1
            if attempts > 50 * sizes[split] + 1000:
                raise ConfigError(f"domain {domain!r} cannot produce {sizes[split]} distinct {split} prompts")
            sample = spec.make(rng)
            if sample.user not in seen:
                seen.add(sample.user)
                samples.append(sample)
        out[split] = samples
    return out


def write_jsonl(samples: Iterable[Sample], path: Path) -> None:
    """Messages-style JSONL, the format real users feed the pipeline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file (used by training and tests)."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
