"""The built-in text teacher's captions: a few phrasings of each digit's name, and the digit a prompt asks for.

The teacher (`builtin:digits-sd3`) is trained on scikit-learn's digits with these captions, so the prompts
that make sense to it name one digit; `digit_of` reads that digit back, which is how its samples' prompt
following is scored (the digits classifier's prediction against the digit asked for).
"""

import re

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = ("a handwritten digit {}", "the number {}", "a picture of the digit {}", "{}")
CAPTION_WORDS = sorted({word for phrasing in PHRASINGS for word in phrasing.split() if word != "{}"}
                       | set(DIGIT_NAMES))


def captions(digit: int) -> list[str]:
    """Every phrasing of ``digit``'s caption, the first the canonical one (the eval prompts')."""
    return [phrasing.format(DIGIT_NAMES[digit]) for phrasing in PHRASINGS]


def eval_prompts() -> list[str]:
    """One canonical caption per digit, zero to nine."""
    return [captions(digit)[0] for digit in range(len(DIGIT_NAMES))]


def digit_of(prompt: str) -> int | None:
    """The digit ``prompt`` names (its first digit word, or a numeral 0-9), None when it names none."""
    for word in re.findall(r"[a-z]+|\d", prompt.lower()):
        if word in DIGIT_NAMES:
            return DIGIT_NAMES.index(word)
        if word.isdigit():
            return int(word)
    return None
