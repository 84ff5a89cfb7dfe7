"""The trusted chess tools: python-chess cannot run in the sandbox (standard library only), so the rules
live here, in the evaluator process, and the harness reaches them over RPC with agent.tool(name, ...).

Host tools (stateless, offered to every episode; the harness decides whether to call them):
    legal_moves(fen)  ->  "d1d2 Rd2, d1d8 Rd8+, ..., g7g8q g8=Q#"   the legal moves of the side to move,
                          sorted by UCI, each with its SAN (which marks a check "+", a mate "#", a capture
                          "x", a promotion "=Q"), comma-separated
    board(fen)        ->  an 8x8 diagram, rank 8 on top, white upper case, "." for an empty square

The episode tool (one fresh environment per episode; it knows the reference line):
    move(uci)  plays the solver's next move (the first UCI move in the text, see verifier.uci_moves):
      "Correct. Opponent played g8h7. FEN: <fen>"             the game goes on, solver to move
      "Solved."                                               the whole line is played
      "Wrong: d1d7 is legal but not the solution. The puzzle is over."
      "Error: illegal move d1d9 in this position. The puzzle is over."
      "Error: no UCI move (like e2e4 or e7e8q) in 'Rd8'. The puzzle is over."
    After the puzzle is over every further call raises (the harness sees agent.ToolError), so a harness
    cannot find the answer by trying moves: check a move against legal_moves before playing it.
"""

from __future__ import annotations

from typing import Callable

import chess

from whale_ray.records import Task

from .verifier import PuzzleGame

MAX_FEN_CHARS = 100  # a FEN is under 90 characters; longer arguments are refused before parsing
OVER = "The puzzle is over."


def _board(fen: object, tool: str) -> chess.Board:
    if not isinstance(fen, str):
        raise TypeError(f"{tool}: fen must be a string, got {type(fen).__name__}")
    if len(fen) > MAX_FEN_CHARS:
        raise ValueError(f"{tool}: fen is {len(fen)} characters long; a FEN has at most {MAX_FEN_CHARS}")
    try:
        return chess.Board(fen.strip())
    except ValueError as e:
        raise ValueError(f"{tool}: not a valid FEN {fen!r} ({e})") from None


def legal_moves(fen: str) -> str:
    """The legal moves of the side to move in a FEN position, sorted by UCI, each as "<uci> <san>" (like
    "d1d8 Rd8#": the SAN marks checks +, mates #, captures x, promotions =Q), comma-separated."""
    board = _board(fen, "legal_moves")
    return ", ".join(f"{m.uci()} {board.san(m)}" for m in sorted(board.legal_moves, key=lambda m: m.uci()))


def board(fen: str) -> str:
    """The FEN position as an 8x8 text diagram: rank 8 on top, white pieces upper case, '.' an empty square."""
    return str(_board(fen, "board"))


def host_tools() -> dict[str, Callable[..., str]]:
    return {"legal_moves": legal_moves, "board": board}


def episode_tools(task: Task) -> dict[str, Callable[..., str]]:
    """A fresh move environment for one episode of `task` (start FEN in meta, reference line in answer)."""
    if not task.answer.split():  # a task from outside the data (the endpoint's agent): no opponent to play
        raise ValueError("the move environment plays the puzzle's reference line, a trusted field this task lacks")
    game = PuzzleGame(task.meta["fen"], task.answer.split())

    def move(uci: str) -> str:
        """Play your next move, in UCI (like e2e4 or e7e8q). Returns the opponent's reply and the new FEN, or
        'Solved.', or why the puzzle is over (a wrong, illegal or unparsable move ends it; later moves are refused)."""
        if not isinstance(uci, str):
            raise TypeError(f"move: uci must be a string, got {type(uci).__name__}")
        if game.over:
            raise ValueError(f"move: the puzzle is over ({game.status}); no more moves are accepted")
        text = uci[:200]
        verdict = game.play(text)
        if verdict == "correct":
            return f"Correct. Opponent played {game.reply}. FEN: {game.board.fen()}"
        if verdict == "solved":
            return "Solved."
        if verdict == "wrong":
            return f"Wrong: {game.last} is legal but not the solution. {OVER}"
        if verdict == "illegal":
            return f"Error: illegal move {game.last} in this position. {OVER}"
        return f"Error: no UCI move (like e2e4 or e7e8q) in {text.strip()[:40]!r}. {OVER}"

    return {"move": move}
