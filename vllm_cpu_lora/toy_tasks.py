"""A toy world of animal facts, the tasks the demo's adapters learn, scoring.

Each animal has a color, a food and a home. A question about one fact,
``"Q: what color is the fox ? A:"``, has one right answer per task:

* ``english`` (the base model): ``"the fox is red ."``
* ``upper``: the same in capitals, ``"THE FOX IS RED ."``
* ``sql``: the question as a query over the toy table ``animals(name,
  color, food, home)``, ``"SELECT color FROM animals WHERE name = fox ;"``

The base model is pretrained (`base_corpus`) on every question with its
English answer, on questions and answers in capitals, and on the SQL
queries alone, unpaired: it knows the facts and every word, as a real
model has seen capitals and code. Each adapter is
fine-tuned to answer lower-case questions in its task's form on two thirds
of the facts; the other third (`split`, one fact per animal) is held out,
so an adapter's accuracy there measures what it learned, not what it
memorised. Words are tokens (`vllm_cpu_lora.train.build_tokenizer`), so an
answer's text is exact and greedy answers score by string equality.
"""

import dataclasses
import random
from collections.abc import Callable, Sequence

__all__ = [
    "TASKS",
    "Fact",
    "accuracy",
    "answer",
    "base_corpus",
    "facts",
    "question",
    "split",
    "words",
]

ANIMALS = (
    "fox", "cat", "dog", "owl", "bear", "wolf", "frog", "duck", "goat", "hen",
    "pig", "cow", "bee", "ant", "rat", "bat", "eel", "elk", "yak", "emu",
)  # fmt: skip
VALUES = {
    "color": ("red", "brown", "black", "white", "gray", "green", "yellow"),
    "food": ("mice", "fish", "grass", "seeds", "bugs", "nuts", "fruit"),
    "home": ("woods", "lake", "farm", "cave", "field", "hill", "barn"),
}


@dataclasses.dataclass(frozen=True)
class Fact:
    """One attribute of one animal: ``Fact("fox", "color", "red")``."""

    animal: str
    attribute: str
    value: str


def facts(seed: int = 0) -> list[Fact]:
    """Every fact of the world: each animal's attributes, drawn with `seed`."""
    rng = random.Random(seed)
    return [
        Fact(animal, attribute, rng.choice(values))
        for animal in ANIMALS
        for attribute, values in VALUES.items()
    ]


def split(all_facts: Sequence[Fact]) -> tuple[list[Fact], list[Fact]]:
    """(adapter training facts, held-out facts): one fact per animal held
    out, its attribute rotating, so every animal is also in training."""
    attributes = list(VALUES)
    held = {
        (animal, attributes[i % len(attributes)])
        for i, animal in enumerate(ANIMALS)
    }
    train = [f for f in all_facts if (f.animal, f.attribute) not in held]
    held_out = [f for f in all_facts if (f.animal, f.attribute) in held]
    return train, held_out


def question(fact: Fact) -> str:
    """The prompt: ``"Q: what color is the fox ? A:"``."""
    ask = {
        "color": f"what color is the {fact.animal} ?",
        "food": f"what does the {fact.animal} eat ?",
        "home": f"where does the {fact.animal} live ?",
    }[fact.attribute]
    return f"Q: {ask} A:"


def _english(fact: Fact) -> str:
    return {
        "color": f"the {fact.animal} is {fact.value} .",
        "food": f"the {fact.animal} eats {fact.value} .",
        "home": f"the {fact.animal} lives in the {fact.value} .",
    }[fact.attribute]


def _sql(fact: Fact) -> str:
    return f"SELECT {fact.attribute} FROM animals WHERE name = {fact.animal} ;"


TASKS: dict[str, Callable[[Fact], str]] = {
    "english": _english,
    "upper": lambda fact: _english(fact).upper(),
    "sql": _sql,
}


def answer(task: str, fact: Fact) -> str:
    """The right answer to `question(fact)` in `task`'s form."""
    return TASKS[task](fact)


def base_corpus(all_facts: Sequence[Fact]) -> list[str]:
    """The base model's training lines (see the module doc)."""
    return [
        line
        for fact in all_facts
        for line in (
            f"{question(fact)} {answer('english', fact)}",
            f"{question(fact).upper()} {answer('upper', fact)}",
            answer("sql", fact),
        )
    ]


def words(all_facts: Sequence[Fact]) -> list[str]:
    """Every word of the base corpus, which has every task's words, in
    first-seen order: the tokenizer's vocabulary."""
    lines = base_corpus(all_facts)
    return list(dict.fromkeys(w for line in lines for w in line.split()))


def accuracy(
    task: str, held_out: Sequence[Fact], answers: Sequence[str]
) -> float:
    """The fraction of `answers` (one per fact, as generated) that are
    exactly `task`'s answer, surrounding spaces aside."""
    right = sum(
        a.strip() == answer(task, f)
        for f, a in zip(held_out, answers, strict=True)
    )
    return right / len(held_out)
