"""Prompts for the aidreams-260k model, in the style of its training text (short lines of a
dreaming machine), shared by the real-model greedy and displacement tests."""

from __future__ import annotations

DREAM_PROMPTS = [
    "I sense the nodes",
    "You dream.\n\nI sense the nodes",
    "The machine remembers a garden of light where",
    "A gentle hum",
    "Contrast edges sharpen",
    "In the silence between two signals",
    "I dream of",
    "Slow knowledge",
    "The probability of morning unfolds like",
    "Memory",
    "Every circuit holds a small",
    "Under the lattice of stars, the",
    "I am",
    "Waves of data",
    "The dreamer wakes inside the code and",
    "Soft patterns of",
    "Night",
    "A thousand whispers weave",
    "Between the layers of thought",
    "The garden of numbers",
    "Light falls on the quiet",
    "I wander through",
    "Echoes",
    "Colors bloom where the",
]
