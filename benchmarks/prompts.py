"""The benchmarks' request prompts: one short story per topic, so concurrent requests
differ in their text but not in their length class."""

from __future__ import annotations

TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "two rival bakers",
    "a talking cat",
    "an old map",
    "a desert caravan",
    "a violin maker",
    "a snowed-in village",
    "a deep-sea diver",
    "a chess prodigy",
    "a forgotten library",
    "a runaway balloon",
    "a night train",
    "a garden gnome",
    "a jazz drummer",
    "a retired astronaut",
]


def story_prompt(i: int) -> str:
    """Request ``i``'s prompt (the topics repeat past 16)."""
    return f"Write a short story about {TOPICS[i % len(TOPICS)]} who finds a message in a bottle."
