"""A small built-in English corpus.

It trains the tiny byte-level BPE tokenizer and calibrates the tiny SAEs. It lives in
code rather than in a data file so the builders need nothing from disk or network,
and changing it changes ``BUILDER_VERSION`` (it is part of every asset's identity).
"""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "The weather is sunny and warm this afternoon.",
    "It rained all night, and the streets are still wet in the morning.",
    "She opened the window and let the cold air into the room.",
    "We walked along the beach and watched the waves roll in from the ocean.",
    "The ship sailed across the sea for many days before it reached the island.",
    "Fish swim in the deep blue water, far below the surface of the ocean.",
    "The mountain was covered with snow, and the climbers moved slowly.",
    "A small river runs through the green valley near the old village.",
    "The children played in the park until the sun went down.",
    "My friend likes to read books about history and science.",
    "The library is open from nine in the morning until six in the evening.",
    "Please send me the report before the meeting on Monday.",
    "Thank you for your message. I will reply as soon as possible.",
    "The committee will review the proposal and announce its decision next week.",
    "We are pleased to inform you that your application has been accepted.",
    "Could you tell me the way to the train station, please?",
    "The train leaves at half past eight and arrives at noon.",
    "He bought bread, milk, eggs and apples at the market.",
    "Cooking dinner together is one of our favourite things to do.",
    "The soup needs more salt, and the bread should be warm.",
    "Music filled the hall as the orchestra began to play.",
    "The painter mixed red and yellow to make a bright orange.",
    "Computers process information very quickly using simple instructions.",
    "A program is a list of instructions that a computer can follow.",
    "The model reads a sentence one token at a time and predicts the next word.",
    "Learning a new language takes time, patience and practice.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The moon moves around the earth, and the earth moves around the sun.",
    "Plants need light, water and air to grow strong and healthy.",
    "The doctor told him to rest for a few days and drink plenty of water.",
    "She was very happy when she heard the good news from her family.",
    "He felt sad and lonely after his best friend moved to another city.",
    "What a wonderful day! Everything went perfectly and everyone smiled.",
    "The old house was quiet, dark and a little frightening at night.",
    "Our team worked hard and finally won the championship game.",
    "The city was busy with cars, buses and people hurrying to work.",
    "At the end of the day, the shop owner counted the money and closed the door.",
    "I think that we should leave early to avoid the traffic.",
    "Do you want tea or coffee with your breakfast?",
    "Yes, I would like a cup of tea with a little milk, please.",
    "No, thank you. I have already eaten.",
    "The students asked many questions, and the teacher answered each one.",
    "Once upon a time, there was a little girl who lived near a forest.",
    "The king and the queen ruled the kingdom with kindness and wisdom.",
    "In the summer we go swimming; in the winter we go skiing.",
    "The numbers one, two, three, four and five are small numbers.",
    "There are seven days in a week and twelve months in a year.",
    "Assistant: Sure, here is a short answer to your question.",
    "User: Can you explain what a sparse autoencoder is?",
    "System: You are a helpful assistant that answers briefly and clearly.",
    "A sparse autoencoder finds a few features that explain an activation.",
    "Steering adds a direction to the hidden state to change what the model says.",
    "The server answers requests, streams tokens, and reports its health.",
    "Good morning! Good afternoon! Good evening! Good night!",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "They laughed, sang songs and danced until late in the night.",
    "The garden was full of roses, tulips and tall sunflowers.",
    "Be careful when you cross the road, and always look both ways.",
)


def corpus_text() -> str:
    """The corpus as one newline-joined string, for hashing into the builder version."""
    return "\n".join(CORPUS)
