"""Moved to ``gpu_engine.decode.grammar_worker``; ``python -m gpu_engine.grammar_worker``
still starts it."""

from .decode.grammar_worker import main

if __name__ == "__main__":
    main()
