"""The chess puzzle verifier, and the line-by-line judge that the move environment shares. Trusted side only.

A puzzle starts after the opponent's first move. `line` is the rest of the reference solution in UCI,
solver first: solver, reply, solver, ..., solver. The solver's moves are judged one at a time:
  * the reference move is correct (UCI spellings of one move compare equal: e1h1 is castling e1g1);
  * any checkmating move is correct too and ends the puzzle as solved, as on Lichess (so a mate-in-one
    accepts every mate, and so does a line's last move);
  * a legal move that is neither is wrong; a move that is not legal here is illegal; text without a UCI
    move is unparsable. Each of these ends the puzzle.
After a correct move that does not end the puzzle the opponent plays the line's next move.

A response is read as the UCI moves it contains, in order (`uci_moves`: anything else in the text is
ignored). It scores 1.0 when they play the whole line; a response may also repeat the opponent's
replies (the full line "d1d8 g8h7 d8h8"), which are then skipped. Moves after the puzzle is solved are
ignored. None, no moves, a partial line, or any wrong, illegal move scores 0.0.
"""

from __future__ import annotations

import re

import chess

from whale_ray.records import Task

# A UCI move as a token of its own (so "Qd1d8" or "e2e45" are not moves); matched on lower-cased text.
UCI_MOVE = re.compile(r"(?<![a-z0-9])([a-h][1-8][a-h][1-8][qrbn]?)(?![a-z0-9])")


def uci_moves(text: str) -> list[str]:
    """The UCI moves written in `text`, in order, lower-cased."""
    return UCI_MOVE.findall(text.lower())


class PuzzleGame:
    """One puzzle being played from its start position: the solver's moves against the reference line."""

    def __init__(self, fen: str, line: list[str]):
        self.board = chess.Board(fen)
        self.line = list(line)
        self.ply = 0  # index into `line` of the solver's next move
        self.status = "playing"  # then "solved", "wrong", "illegal" or "unparsable"
        self.reply: str | None = None  # the opponent's answer to the last correct move
        self.last: str | None = None  # the solver's last move as read from its text

    @property
    def over(self) -> bool:
        return self.status != "playing"

    def play(self, text: str) -> str:
        """Judge the first UCI move in `text`; returns "correct" (the opponent replied), or the final status."""
        if self.over:
            raise ValueError(f"the puzzle is over ({self.status})")
        moves = uci_moves(text)
        if not moves:
            self.status = "unparsable"
            return self.status
        self.last = moves[0]
        try:
            move = self.board.parse_uci(self.last)
        except ValueError:  # chess.IllegalMoveError
            self.status = "illegal"
            return self.status
        expected = self.board.parse_uci(self.line[self.ply])
        self.board.push(move)
        if self.board.is_checkmate() or (move == expected and self.ply + 1 >= len(self.line)):
            self.status = "solved"
        elif move != expected:
            self.status = "wrong"
        else:
            self.reply = self.line[self.ply + 1]
            self.board.push_uci(self.reply)
            self.ply += 2
            return "correct"
        return self.status


def score_line(fen: str, line: list[str], response: str | None) -> float:
    """1.0 when the UCI moves of `response` play the whole `line` from `fen`, else 0.0."""
    if not response:
        return 0.0
    moves = uci_moves(response)
    game = PuzzleGame(fen, line)
    i = 0
    while i < len(moves):
        verdict = game.play(moves[i])
        i += 1
        if verdict != "correct":
            return 1.0 if verdict == "solved" else 0.0
        if i < len(moves) and moves[i] == game.reply:  # the full-line form repeats the reply
            i += 1
    return 0.0  # the moves ran out before the line did


def verify(task: Task, response: str | None) -> float:
    """The reward: the task's gold answer is the line (UCI moves from the puzzle start, space-separated),
    played from its private meta["fen"]."""
    return score_line(task.meta["fen"], task.answer.split(), response)
