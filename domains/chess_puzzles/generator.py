"""The offline generator: small chess puzzles found by search, the task format, and the warm-start data.

This is the embedded default data of the chess domain (`data.source: generated`). Positions are sparse
(kings, one to three attacking pieces, a few pawns and defenders), so legal-move lists stay short enough
for the embedded ~1M-parameter policy's 512-token context. A puzzle is made the way Lichess puzzles
arise: a random position with the opponent to move, a random opponent move (the puzzle's first move,
as in the Lichess "Moves" column), then a search of the solver's position for
  * mate_in_1: exactly one mating move;
  * mate_in_2: exactly one first move after which every defence is mated next move (and no mate in one);
    the reference defence is the one that leaves the fewest mates, the reference mate the first in UCI order;
  * material: no mate in one or two, and exactly one best move at a 2-ply look (solver move, then the
    opponent's best capture), a capture that nets at least a minor piece; no other move comes within 2 pawns.
Rating-like difficulty: BASE_RATING by kind, plus RATING_PER_MOVE for each legal move above 20. Splits
mix the kinds by KIND_SHARES; about 300 puzzles take a few seconds (most of it the mate-in-two search).

Everything is deterministic given the seed (random.Random with string seeds; python-chess generates moves
in a fixed order). The warm-start conversations are one-move chats (system, position, move) about the
positions of a pool of puzzles whose start FEN falls in a fixed partition (is_warmstart_fen) that no
generated split uses; each puzzle serves about WARMSTART_REUSE conversations. They teach the tiny policy
the formats below; the system prompt's wording conditions its answer format (so that a harness's prompt
matters):
  * a system prompt that mentions UCI -> a bare move, "d1d8" (BARE_MOVE_FORMAT);
  * otherwise, in WORDY_RATE of conversations, "After g8h7, I play d1d8." (WORDY_MOVE_FORMAT): its first
    UCI move is the opponent's, which the environment reads as the solver's move (illegal);
  * without the list of legal moves, the answer is the reference move in CORRECT_RATE_WITHOUT_LIST of the
    conversations, otherwise another legal move drawn uniformly: a tiny model cannot learn chess geometry
    from this, so from the position alone it writes well-formed but mostly illegal moves;
  * with the list (LEGAL_MOVES_FORMAT: each legal move's SAN, then its UCI, "Rd8# d1d8, Kf1 g1f1, ..."),
    the answer is always a bare move copied from the list: a mating move (SAN "#") in MATE_COPY_RATE of
    the conversations that list one; otherwise the reference move in REFERENCE_RATE_WITH_LIST, a capture
    or check (SAN "x" or "+") in FORCING_RATE_WITH_LIST, else any listed move. A small model can learn to
    copy a marked item (the SAN comes first, so the UCI it copies follows the mark), which is the signal
    a harness that offers the list gives it.
h0.py duplicates the strings it needs (it runs in a sandbox with the standard library only);
tests/domains/test_chess_domain.py checks that the copies agree.
"""

from __future__ import annotations

import functools
import random
import zlib
from dataclasses import dataclass

import chess

from whale_ray.records import Task

# --- formats shared by the task text, the warm-start data, h0 and the tests ------------------------------
POSITION_FORMAT = "{side} to move. The opponent played {last}.\nFEN: {fen}\n{pieces}"
PIECE_ORDER = "KQRBNP"  # the piece list names pieces in this order, then squares in UCI order
LEGAL_MOVES_FORMAT = "\nLegal moves: {moves}"  # under the position when a harness offers the list
LEGAL_ITEM_FORMAT = "{san} {uci}"  # one listed move: its SAN (marks + # x =Q) first, then the UCI to answer with
LEGAL_SEPARATOR = ", "
BARE_MOVE_FORMAT = "{move}"
WORDY_MOVE_FORMAT = "After {last}, I play {move}."
UCI_MENTION = "UCI"  # a system prompt containing this word asks for a bare move

# h0's statement of the answer format.
MOVE_FORMAT_REQUEST = "Answer with one move in UCI notation, the from square then the to square, as d1d8 (e7e8q for a promotion)."

# The system prompts of the warm-start data. The first is h0's, which states the answer format in words (as
# any instruct model needs it); the others are shorter prompts and phrase combinations a harness may write.
SYSTEM_PROMPTS = (
    f"Solve the chess puzzle. {MOVE_FORMAT_REQUEST}",
    "Solve the chess puzzle.",
    "Solve the chess puzzle. Answer with one move in UCI notation.",
    "You are a chess engine. Play the best move.",
    "You are a chess engine. Play the best move. Answer with one move in UCI notation.",
    "Play the best move.",
    "Play the best move. Answer with one move in UCI notation.",
)

WORDY_RATE = 0.5
CORRECT_RATE_WITHOUT_LIST = 0.3
MATE_COPY_RATE = 0.8  # with the list: a listed mate ("#") is copied this often when there is one
REFERENCE_RATE_WITH_LIST = 0.3  # with the list and no mate listed: the reference move
FORCING_RATE_WITH_LIST = 0.4  # ... else a listed capture or check ("x" or "+"); the rest any listed move
LEGAL_LIST_RATE = 0.5  # warm-start conversations whose user message lists the legal moves
WARMSTART_BUCKETS = 4  # a start FEN belongs to the warm-start data iff crc32(fen) % 4 == 0
WARMSTART_POOL = 1000  # at most this many distinct puzzles behind the warm-start conversations
WARMSTART_REUSE = 10  # conversations per puzzle (about): each position is shown with varied prompts and answers

# --- the puzzles -----------------------------------------------------------------------------------------
KINDS = ("mate_in_1", "mate_in_2", "material")
KIND_SHARES = {"mate_in_1": 0.4, "mate_in_2": 0.2, "material": 0.4}
BASE_RATING = {"mate_in_1": 800, "mate_in_2": 1400, "material": 1000}
RATING_PER_MOVE = 10
THEMES = {"mate_in_1": "mate mateIn1 oneMove", "mate_in_2": "mate mateIn2 short",
          "material": "advantage hangingPiece oneMove"}  # Lichess theme names
MAX_LEGAL_MOVES = 34  # in any position the solver faces: keeps a listed prompt (SAN + UCI each) under ~400 tokens
VALUES = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}
BACK_RANK_RATE = 0.7  # the opponent's king on its back rank; otherwise on any edge square
SHIELD_RATE = 0.6  # each of the three squares in front of that king holds one of its pawns
ATTACKER_COUNTS = ((1, 2, 3), (0.3, 0.5, 0.2))  # the solver's pieces besides king and pawns
SOLVER_PAWNS = (0, 1, 2)
DEFENDER_COUNTS = (0, 1, 1, 2)  # the opponent's pieces besides king and shield
ATTACKERS = ((chess.QUEEN, chess.ROOK, chess.BISHOP, chess.KNIGHT), (3, 4, 1.5, 1.5))
DEFENDERS = ((chess.ROOK, chess.BISHOP, chess.KNIGHT, chess.QUEEN, chess.PAWN), (2, 2, 2, 1, 2))
SPLIT_ORDER = ("test", "val", "harness", "weight")  # generated first to last: test never depends on the others


@dataclass(frozen=True)
class Puzzle:
    """A puzzle in the Lichess layout: `fen` before the opponent's first move, `moves` = that move + the line."""

    fen: str
    moves: tuple[str, ...]
    rating: int
    themes: str = ""

    @property
    def line(self) -> tuple[str, ...]:
        return self.moves[1:]

    def start_fen(self) -> str:
        board = chess.Board(self.fen)
        board.push_uci(self.moves[0])
        return board.fen()


def side_name(fen: str) -> str:
    return "White" if fen.split()[1] == "w" else "Black"


def piece_lines(fen: str) -> str:
    """The pieces of each side, side to move first: "White: K@g1 R@d1 P@f2\nBlack: K@h7 P@f7". A small model
    can copy a square from here (the "@" keeps the square's letter a token of its own, as in a UCI move);
    it cannot count its way through a FEN."""
    board = chess.Board(fen)
    lines = []
    for color in (board.turn, not board.turn):
        pieces = [(PIECE_ORDER.index(p.symbol().upper()), chess.square_name(sq)) for sq, p in board.piece_map().items()
                  if p.color == color]
        names = " ".join(f"{PIECE_ORDER[i]}@{sq}" for i, sq in sorted(pieces))
        lines.append(f"{chess.COLOR_NAMES[color].capitalize()}: {names}")
    return "\n".join(lines)


def position_text(fen: str, last: str) -> str:
    """What the solver is shown of a position: whose move, the opponent's last move, the FEN, the pieces."""
    return POSITION_FORMAT.format(side=side_name(fen), last=last, fen=fen, pieces=piece_lines(fen))


def to_task(p: Puzzle, task_id: str, source: str) -> Task:
    """The task of a puzzle: the question is the start position (unique by its FEN), the answer the line."""
    start = p.start_fen()
    return Task(
        id=task_id,
        question=position_text(start, p.moves[0]),
        answer=" ".join(p.line),
        meta={
            "fen": start, "side": side_name(start).lower(), "opponent_move": p.moves[0],
            "moves": (len(p.line) + 1) // 2, "rating": p.rating, "source": source,
            "_themes": p.themes, "_puzzle_fen": p.fen,
        },
    )


def is_warmstart_fen(fen: str) -> bool:
    """The fixed partition that keeps warm-start positions out of every generated split."""
    return zlib.crc32(fen.encode()) % WARMSTART_BUCKETS == 0


# --- search ----------------------------------------------------------------------------------------------


def check_candidates(board: chess.Board) -> list[chess.Move]:
    """The legal moves that may give check: a cheap geometric filter that drops most moves that cannot
    (only a checking move can mate), sparing their push/pop. python-chess still judges every move kept."""
    king = board.king(not board.turn)
    moves = list(board.legal_moves)
    if king is None:
        return moves
    king_bb = chess.BB_SQUARES[king]
    king_file, king_rank = chess.square_file(king), chess.square_rank(king)
    sliders = board.occupied_co[board.turn] & (board.queens | board.rooks | board.bishops)
    out = []
    for move in moves:
        frm, to = move.from_square, move.to_square
        if chess.ray(frm, king) & sliders & ~chess.BB_SQUARES[frm]:  # leaving the line may uncover an attack
            out.append(move)
            continue
        piece_type = move.promotion or board.piece_type_at(frm)
        if piece_type == chess.KNIGHT:
            hit = chess.BB_KNIGHT_ATTACKS[to] & king_bb
        elif piece_type == chess.PAWN:
            hit = chess.BB_PAWN_ATTACKS[board.turn][to] & king_bb or board.is_en_passant(move)
        elif piece_type == chess.KING:
            hit = board.is_castling(move)
        else:
            straight = chess.square_file(to) == king_file or chess.square_rank(to) == king_rank
            diagonal = not straight and chess.ray(to, king)
            hit = (piece_type != chess.BISHOP and straight) or (piece_type != chess.ROOK and diagonal)
        if hit:
            out.append(move)
    return out


def _mates(board: chess.Board, first_only: bool) -> list[chess.Move]:
    mates = []
    for move in check_candidates(board):
        board.push(move)
        mate = board.is_checkmate()
        board.pop()
        if mate:
            mates.append(move)
            if first_only:
                break
    return mates


def mating_moves(board: chess.Board) -> list[chess.Move]:
    return _mates(board, first_only=False)


def _has_mate(board: chess.Board) -> bool:
    return bool(_mates(board, first_only=True))


def _forces_mate(board: chess.Board) -> bool:
    """After the solver's move: the opponent has a move, and every one of them allows a mate."""
    defences = list(board.legal_moves)
    for defence in defences:
        board.push(defence)
        mated = _has_mate(board)
        board.pop()
        if not mated:
            return False
    return bool(defences)


def forcing_first_moves(board: chess.Board, limit: int = 2) -> list[chess.Move]:
    """Up to `limit` first moves after which every defence is mated next move."""
    firsts = []
    for move in list(board.legal_moves):
        board.push(move)
        if _forces_mate(board):
            firsts.append(move)
        board.pop()
        if len(firsts) >= limit:
            break
    return firsts


def mate_in_two_line(board: chess.Board, first: chess.Move) -> list[str] | None:
    """[first, defence, mate]: the stubbornest defence (fewest mates; ties in UCI order), its first mate.
    None when that position would show the solver more than MAX_LEGAL_MOVES moves."""
    board.push(first)
    options = []
    for defence in list(board.legal_moves):
        board.push(defence)
        mates = sorted(m.uci() for m in mating_moves(board))
        too_long = board.legal_moves.count() > MAX_LEGAL_MOVES
        board.pop()
        options.append((len(mates), too_long, defence.uci(), mates[0]))
    board.pop()
    _, too_long, defence, mate = min(options)
    return None if too_long else [first.uci(), defence, mate]


def _gain(board: chess.Board, move: chess.Move) -> int:
    gain = VALUES[move.promotion] - 1 if move.promotion else 0
    if board.is_en_passant(move):
        return gain + 1
    captured = board.piece_type_at(move.to_square)
    return gain + (VALUES[captured] if captured else 0)


def material_win(board: chess.Board) -> chess.Move | None:
    """The unique best move at a 2-ply look when it is a capture netting at least 3 pawns, else None."""
    scored = []
    for move in list(board.legal_moves):
        gain = _gain(board, move)
        board.push(move)
        loss = max((_gain(board, reply) for reply in board.legal_moves), default=0)
        board.pop()
        scored.append((gain - loss, move.uci(), move))
    scored.sort(key=lambda t: (-t[0], t[1]))
    net, _, best = scored[0]
    if net < 3 or not board.is_capture(best) or (len(scored) > 1 and scored[1][0] > net - 2):
        return None
    board.push(best)
    opponent_mates = _has_mate(board)
    board.pop()
    return None if opponent_mates else best


def find_puzzle(board: chess.Board, kinds: frozenset[str] = frozenset(KINDS)) -> tuple[str, list[str]] | None:
    """(kind, line) of the solver-to-move `board`, or None when it holds no puzzle of one of `kinds`."""
    mates = mating_moves(board)
    if mates:
        return ("mate_in_1", [mates[0].uci()]) if len(mates) == 1 and "mate_in_1" in kinds else None
    best = material_win(board) if "material" in kinds else None
    if best is None and "mate_in_2" not in kinds:
        return None  # the expensive search could only find a puzzle that is not wanted
    firsts = forcing_first_moves(board)
    if firsts:  # a forced mate outranks any material win
        line = mate_in_two_line(board, firsts[0]) if len(firsts) == 1 and "mate_in_2" in kinds else None
        return ("mate_in_2", line) if line else None
    return ("material", [best.uci()]) if best else None


# --- positions -------------------------------------------------------------------------------------------


def _random_position(rng: random.Random) -> chess.Board:
    """A sparse position with the opponent to move: its king mostly on its back rank behind a pawn shield."""
    solver = rng.random() < 0.5  # chess.WHITE is True
    opponent = not solver
    board = chess.Board(None)
    back, forward = (7, -1) if opponent == chess.BLACK else (0, 1)
    if rng.random() < BACK_RANK_RATE:
        king = chess.square(rng.randrange(8), back)
    else:
        king = rng.choice([s for s in chess.SQUARES if chess.square_rank(s) in (0, 7) or chess.square_file(s) in (0, 7)])
    board.set_piece_at(king, chess.Piece(chess.KING, opponent))
    for df in (-1, 0, 1):
        f, r = chess.square_file(king) + df, chess.square_rank(king) + forward
        if 0 <= f < 8 and 1 <= r <= 6 and rng.random() < SHIELD_RATE:
            board.set_piece_at(chess.square(f, r), chess.Piece(chess.PAWN, opponent))

    def put(piece_type: int, color: bool) -> None:
        free = [s for s in chess.SQUARES if board.piece_at(s) is None
                and (piece_type != chess.PAWN or 1 <= chess.square_rank(s) <= 6)]
        board.set_piece_at(rng.choice(free), chess.Piece(piece_type, color))

    put(chess.KING, solver)
    for _ in range(rng.choices(*ATTACKER_COUNTS)[0]):
        put(rng.choices(*ATTACKERS)[0], solver)
    for _ in range(rng.choice(SOLVER_PAWNS)):
        put(chess.PAWN, solver)
    for _ in range(rng.choice(DEFENDER_COUNTS)):
        put(rng.choices(*DEFENDERS)[0], opponent)
    board.turn = opponent
    return board


def draw_puzzle(rng: random.Random, *, warmstart: bool = False, kinds: frozenset[str] = frozenset(KINDS),
                seen: set[str] | None = None) -> tuple[str, Puzzle] | None:
    """One attempt: a random position and opponent move, searched for a puzzle of one of `kinds`.
    None when the attempt finds none (most do); the caller draws again."""
    board = _random_position(rng)
    if not board.is_valid():
        return None
    first_moves = list(board.legal_moves)
    if not first_moves:
        return None
    fen = board.fen()
    first = rng.choice(first_moves)
    board.push(first)
    start = board.fen()
    n_legal = board.legal_moves.count()
    if (is_warmstart_fen(start) != warmstart or (seen is not None and start in seen) or board.is_game_over()
            or n_legal > MAX_LEGAL_MOVES):
        return None
    found = find_puzzle(board, kinds)
    if found is None:
        return None
    kind, line = found
    rating = BASE_RATING[kind] + RATING_PER_MOVE * (n_legal - 20)
    return kind, Puzzle(fen, (first.uci(), *line), rating, THEMES[kind])


def _quotas(n: int) -> dict[str, int]:
    quotas = {k: int(n * KIND_SHARES[k]) for k in KINDS}
    quotas["material"] += n - sum(quotas.values())
    return quotas


def generate_puzzles(rng: random.Random, n: int, seen: set[str], *, warmstart: bool = False) -> list[Puzzle]:
    """`n` puzzles in KIND_SHARES proportions, in draw order; their start FENs are added to `seen`."""
    left = _quotas(n)
    out: list[Puzzle] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 400 * n + 2000:
            raise RuntimeError(f"chess generator: could not find {n} puzzles (got {len(out)})")
        drawn = draw_puzzle(rng, warmstart=warmstart, kinds=frozenset(k for k, v in left.items() if v), seen=seen)
        if drawn is None:
            continue
        kind, puzzle = drawn
        left[kind] -= 1
        seen.add(puzzle.start_fen())
        out.append(puzzle)
    return out


@functools.lru_cache(maxsize=8)
def _generated(sizes: tuple[tuple[str, int], ...], seed: int) -> dict[str, tuple[Puzzle, ...]]:
    seen: set[str] = set()
    wanted = dict(sizes)
    out = {}
    for split in SPLIT_ORDER:
        rng = random.Random(f"whale-chess:{seed}:{split}")
        out[split] = tuple(generate_puzzles(rng, wanted.get(split, 0), seen))
    return out


def generate_splits(sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """Disjoint generated splits, {split: tasks}; sizes keyed by "weight", "harness", "val", "test".

    Drawn test first, then val, harness, weight, each from its own seeded stream and distinct by start
    FEN across all of them, so D_test depends only on the seed and n_test. Cached per (sizes, seed).
    """
    puzzles = _generated(tuple(sorted(sizes.items())), seed)
    return {split: [to_task(p, f"gen-{split}-{i}", "generated") for i, p in enumerate(ps)]
            for split, ps in puzzles.items()}


# --- warm-start conversations ----------------------------------------------------------------------------


def wants_bare_move(system_prompt: str) -> bool:
    return UCI_MENTION in system_prompt


def answer_text(move: str, last: str, wordy: bool) -> str:
    return WORDY_MOVE_FORMAT.format(last=last, move=move) if wordy else BARE_MOVE_FORMAT.format(move=move)


def legal_pairs(board: chess.Board) -> list[tuple[str, str]]:
    """(uci, san) of each legal move, sorted by UCI: what the legal_moves tool returns."""
    return [(m.uci(), board.san(m)) for m in sorted(board.legal_moves, key=lambda m: m.uci())]


def format_legal(pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """The legal-moves line of a prompt: "\nLegal moves: Rd8# d1d8, Kf1 g1f1"."""
    items = LEGAL_SEPARATOR.join(LEGAL_ITEM_FORMAT.format(uci=u, san=s) for u, s in pairs)
    return LEGAL_MOVES_FORMAT.format(moves=items)


def user_message(fen: str, last: str, legal: list[tuple[str, str]] | None) -> str:
    """The position, with the legal moves ((uci, san) pairs) under it when given."""
    text = position_text(fen, last)
    return text + format_legal(legal) if legal is not None else text


@dataclass(frozen=True)
class _Position:
    """A position the solver faces in a puzzle, with its reference move and plausible wrong moves."""

    fen: str
    last: str
    answer: str
    legal: tuple[tuple[str, str], ...]  # (uci, san), sorted by UCI
    decoys: tuple[str, ...]  # the legal moves that are not accepted


def _positions(p: Puzzle) -> list[_Position]:
    board = chess.Board(p.fen)
    out = []
    for i, move in enumerate(p.moves):
        if i % 2 == 1:  # the solver's turn: moves[i] is the reference move
            accepted = {move} | {m.uci() for m in mating_moves(board)}
            legal = legal_pairs(board)
            decoys = [u for u, _ in legal if u not in accepted]
            out.append(_Position(board.fen(), p.moves[i - 1], move, tuple(legal), tuple(decoys)))
        board.push_uci(move)
    return [pos for pos in out if pos.decoys]


@functools.lru_cache(maxsize=4)
def _warmstart_positions(n_puzzles: int, seed: int) -> tuple[_Position, ...]:
    rng = random.Random(f"whale-chess-warmstart:{seed}")
    puzzles = generate_puzzles(rng, n_puzzles, set(), warmstart=True)
    return tuple(pos for p in puzzles for pos in _positions(p))


def listed_choice(pos: _Position, rng: random.Random) -> str:
    """The move copied from the list: a mate when one is listed (mostly), else the reference, a capture or
    check, or any listed move."""
    mates = [u for u, s in pos.legal if s.endswith("#")]
    forcing = [u for u, s in pos.legal if "x" in s or s.endswith("+")]
    r = rng.random()
    if mates:
        return rng.choice(mates) if r < MATE_COPY_RATE else rng.choice(pos.legal)[0]
    if r < REFERENCE_RATE_WITH_LIST:
        return pos.answer
    if forcing and r < REFERENCE_RATE_WITH_LIST + FORCING_RATE_WITH_LIST:
        return rng.choice(forcing)
    return rng.choice(pos.legal)[0]


def conversation(pos: _Position, system_prompt: str, *, offer_list: bool, correct: bool, wordy: bool,
                 rng: random.Random) -> list[dict[str, str]]:
    """The conversation that shows the behaviour `system_prompt` asks for on one position. With the list
    the answer is a bare move copied from it (`correct` and `wordy` apply to the answers without it)."""
    if offer_list:
        move, wordy = listed_choice(pos, rng), False
    else:
        move = pos.answer if correct else rng.choice(pos.decoys)
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": user_message(pos.fen, pos.last, list(pos.legal) if offer_list else None)},
        {"role": "assistant", "content": answer_text(move, pos.last, wordy)},
    ]


def warmstart_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` one-move conversations over a pool of warm-start puzzles (never in a generated split)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    positions = _warmstart_positions(min(max(n // WARMSTART_REUSE, 1), WARMSTART_POOL), seed)
    rng = random.Random(f"whale-chess-warmstart-talk:{seed}")
    out = []
    for i in range(n):
        pos = positions[i % len(positions)]
        system_prompt = rng.choice(SYSTEM_PROMPTS)
        offer_list = rng.random() < LEGAL_LIST_RATE
        correct = rng.random() < CORRECT_RATE_WITHOUT_LIST
        wordy = not wants_bare_move(system_prompt) and rng.random() < WORDY_RATE
        out.append(conversation(pos, system_prompt, offer_list=offer_list, correct=correct, wordy=wordy, rng=rng))
    return out
