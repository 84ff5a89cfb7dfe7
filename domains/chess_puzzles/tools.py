"""The chess domain's sandbox tools. STANDARD LIBRARY ONLY: this file is copied into the sandbox.

The chess rules need python-chess, which the sandbox does not have, so `legal_moves`, `board` and the
episode's `move` are host tools (domains/chess_puzzles/env.py) that the harness calls the same way,
agent.tool(name, ...). This file adds one pure helper that needs no round trip:

    uci_moves(text) -> "g8h7 d1d8"   the UCI moves written in `text`, in order, as the verifier reads them
"""

from __future__ import annotations

import re

# The verifier's pattern (tests check they agree): a UCI move as a token of its own, on lower-cased text.
UCI_MOVE = re.compile(r"(?<![a-z0-9])([a-h][1-8][a-h][1-8][qrbn]?)(?![a-z0-9])")

TOOL_SPECS = {
    "uci_moves": {
        "description": (
            "The UCI moves (like e2e4 or e7e8q) written in a text, in order, space-separated: "
            "what the verifier reads from a final answer."
        ),
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "any text"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    }
}


def uci_moves(text: str) -> str:
    """The UCI moves in `text`, in order, lower-cased and space-separated ('' when there is none)."""
    if not isinstance(text, str):
        raise TypeError(f"uci_moves: text must be a string, got {type(text).__name__}")
    return " ".join(UCI_MOVE.findall(text.lower()))
