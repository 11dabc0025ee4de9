"""The GRPO demo's verifiable task: copy a three-letter word over the alphabet abcd.

A prompt reads ``copy cab: ``; the reward is the share of the word's letters the response gets
right in place (its first three characters against ``row["answer"]``), so 0, 1/3, 2/3 or 1. A
random byte-level model starts near 0 (each character is one of 256 bytes); learning the alphabet
alone is worth about 1/4 and copying the word all of it.
"""


def reward(prompt: str, response: str, row: dict) -> float:
    answer = row["answer"]
    return sum(a == b for a, b in zip(response, answer)) / len(answer)
