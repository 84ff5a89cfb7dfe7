"""The chess_puzzles domain: Lichess loader, splits, generator, warm-start formats, verifier, environment,
tools, h0 (scripted and in the real sandbox), skill."""

from __future__ import annotations

import ast
import csv
import gzip
import inspect
import logging
import random
import re
from pathlib import Path
from types import SimpleNamespace

import chess
import pytest

from domains.chess_puzzles import DOMAIN, ChessDomain, data, env, generator, tools, verifier
from tests.helpers import load_harness
from tests.inprocess_agent import InProcessEpisode
from whale_ray.config import DataConfig
from whale_ray.domain import DataError, Domain, get_domain
from whale_ray.proposers.skill import parse_skill
from whale_ray.records import ModelCall, Task

FOLDER = Path(__file__).resolve().parents[2] / "domains" / "chess_puzzles"
HEADER = ",".join(data.COLUMNS)
H0_KNOBS = {
    "SYSTEM_PROMPT": ("Solve the chess puzzle. Answer with one move in UCI notation, the from square then the to "
                      "square, as d1d8 (e7e8q for a promotion)."),
    "MAX_TURNS": 2,
    "MAX_TOKENS": 16,
    "TEMPERATURE": 1.0,
    "TOP_K": 20,
    "N_SAMPLES": 1,
    "OFFER_LEGAL_MOVES": False,
    "POSITION_FORMAT": "{side} to move. The opponent played {last}.\nFEN: {fen}\n{pieces}",
    "LEGAL_MOVES_FORMAT": "\nLegal moves: {moves}",
}

# Rows in the public format. The first two are the first rows of the Lichess puzzle database.
CRUSHING = ("00008", "r6k/pp2r2p/4Rp1Q/3p4/8/1N1P2R1/PqP2bPP/7K b - - 0 24", "f2g3 e6e7 b2b1 b3c1 b1c1 h6c1", "1913",
            "crushing hangingPiece long middlegame")
ENDGAME = ("0000D", "5rk1/1p3ppp/pq3b2/8/8/1P1Q1N2/P4PPP/3R2K1 w - - 2 27", "d3d6 f8d8 d6d8 f6d8", "1426",
           "advantage endgame short")
BACK_RANK = ("bk001", "6k1/p4ppp/8/8/8/8/5PPP/3RR1K1 b - - 0 1", "a7a6 d1d8", "600", "mate mateIn1 oneMove")  # d1d8, e1e8 both mate
PROMOTION = ("pr002", "6k1/3P1p1p/7R/5P2/8/7K/8/8 b - - 0 1", "g8h8 f5f6 h8g8 d7d8q", "1300", "mate mateIn2")  # d7d8r mates too


def row(puzzle_id, fen, moves, rating, themes=""):
    return [puzzle_id, fen, moves, rating, "75", "94", "6230", themes, f"https://lichess.org/{puzzle_id}", ""]


def write_csv(path: Path, rows: list[list[str]], header: str = HEADER) -> Path:
    with open(path, "w", newline="") as f:
        f.write(header + "\n")
        csv.writer(f).writerows(rows)
    return path


def task_of(puzzle) -> Task:
    return data.parse_row(Path("t.csv"), 2, dict(zip(data.COLUMNS, row(*puzzle))))


def task(puzzle) -> Task:
    return generator.to_task(task_of(puzzle), puzzle[0], "test")


def load_h0(source: str | None = None) -> dict:
    return load_harness(FOLDER, source)


def episode(t: Task, completions) -> InProcessEpisode:
    """The sandbox's real Agent in process, replaying `completions`, with the domain's real host, episode and
    sandbox tools."""
    return InProcessEpisode(list(completions), tools_path=DOMAIN.sandbox_tools_path,
                            host_tools={**DOMAIN.host_tools({}), **DOMAIN.episode_tools(t, {})})


# --- the domain object -----------------------------------------------------------------------------------


def test_domain_object():
    assert isinstance(DOMAIN, ChessDomain) and isinstance(DOMAIN, Domain)
    assert get_domain("chess_puzzles") is DOMAIN
    assert DOMAIN.name == "chess_puzzles" and DOMAIN.folder == FOLDER and DOMAIN.warmstart_version == "3"
    assert DOMAIN.h0_path.is_file() and DOMAIN.sandbox_tools_path.is_file()
    t = task(BACK_RANK)
    assert DOMAIN.verify(t, "d1d8") == 1.0 and DOMAIN.verify(t, "d1d7") == 0.0 and DOMAIN.verify(t, None) == 0.0
    assert set(DOMAIN.host_tools({})) == {"legal_moves", "board"}
    assert set(DOMAIN.episode_tools(t, {})) == {"move"}


def test_task_fields_and_what_the_harness_sees():
    t = task(CRUSHING)
    start = "r6k/pp2r2p/4Rp1Q/3p4/8/1N1P2b1/PqP3PP/7K w - - 0 25"
    assert t.question == (f"White to move. The opponent played f2g3.\nFEN: {start}\n"
                          "White: K@h1 Q@h6 R@e6 N@b3 P@a2 P@c2 P@d3 P@g2 P@h2\n"
                          "Black: K@h8 Q@b2 R@a8 R@e7 B@g3 P@a7 P@b7 P@d5 P@f6 P@h7")
    assert t.answer == "e6e7 b2b1 b3c1 b1c1 h6c1"
    public = t.public()
    assert public == {"id": "00008", "question": t.question, "fen": start, "side": "white", "opponent_move": "f2g3",
                      "moves": 3, "rating": 1913, "source": "test"}
    assert t.meta["_themes"] == "crushing hangingPiece long middlegame"


# --- loading Lichess CSV files ---------------------------------------------------------------------------


def test_lichess_csv_loads(tmp_path):
    path = write_csv(tmp_path / "puzzles.csv", [row(*CRUSHING), row(*ENDGAME), row(*BACK_RANK)])
    tasks = data.load_tasks(path)
    assert [t.id for t in tasks] == ["puzzles-00008", "puzzles-0000D", "puzzles-bk001"]
    assert [t.meta["moves"] for t in tasks] == [3, 2, 1]
    assert [t.meta["side"] for t in tasks] == ["white", "black", "white"]
    assert all(t.meta["source"] == "lichess" and DOMAIN.verify(t, t.answer) == 1.0 for t in tasks)


def test_gzip_csv_loads(tmp_path):
    plain = write_csv(tmp_path / "p.csv", [row(*ENDGAME)])
    packed = tmp_path / "p.csv.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert [t.answer for t in data.load_tasks(packed)] == ["f8d8 d6d8 f6d8"]


def test_missing_column_names_file_and_column(tmp_path):
    header = HEADER.replace("Moves,", "")
    path = write_csv(tmp_path / "nomoves.csv", [[c for i, c in enumerate(row(*ENDGAME)) if i != 2]], header=header)
    with pytest.raises(DataError, match=r"nomoves\.csv: missing column 'Moves'"):
        data.load_tasks(path)
    headerless = tmp_path / "old.csv"  # the database's old layout had no header line
    headerless.write_text(",".join(row(*ENDGAME)) + "\n")
    with pytest.raises(DataError, match=r"old\.csv: missing column 'PuzzleId' \(the first line must be the header"):
        data.load_tasks(headerless)


def test_empty_and_header_only_files(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.csv: empty"):
        data.load_tasks(empty)
    header_only = write_csv(tmp_path / "header.csv", [])
    with pytest.raises(DataError, match=r"header\.csv: no puzzle rows"):
        data.load_tasks(header_only)


def test_wrong_path_or_extension(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data.load_tasks(tmp_path / "missing.csv")
    with pytest.raises(DataError, match="unsupported extension"):
        data.load_tasks(write_csv(tmp_path / "p.parquet", [row(*ENDGAME)]))
    with pytest.raises(DataError, match="zstd -d"):
        data.load_tasks(tmp_path / "lichess_db_puzzle.csv.zst")


BAD_ROWS = [
    (row("", ENDGAME[1], ENDGAME[2], "1500"), r": empty PuzzleId"),
    (row("b1", "5rk1/1p3ppp/pq3b2/8/8 w - - 2 27", ENDGAME[2], "1500"), r" \(puzzle b1\): unparsable FEN"),
    (row("b2", "8/8/8/8/8/8/8/8 w - - 0 1", "a1a2 a2a3", "1500"), r" \(puzzle b2\): FEN .* not a possible"),
    (row("b3", ENDGAME[1], "d3d6", "1500"), r"Moves needs the opponent's move and at least one solver move"),
    (row("b4", ENDGAME[1], "d3d6 f8d8 d6d8", "1500"), r"Moves has 3 moves; a puzzle ends with the solver's move"),
    (row("b5", ENDGAME[1], "d3d6 f8d8 d6d9 f6d8", "1500"), r"move 3 'd6d9' is not a UCI move"),
    (row("b6", ENDGAME[1], "d3d6 f8d8 d6e8 f6d8", "1500"), r"move 3 'd6e8' is illegal after the moves before it"),
    (row("b7", ENDGAME[1], ENDGAME[2], "high"), r"Rating 'high' is not an integer"),
]


@pytest.mark.parametrize("bad,message", BAD_ROWS, ids=[f"bad{i}" for i in range(len(BAD_ROWS))])
def test_bad_row_is_a_data_error_naming_file_and_line(bad, message):
    with pytest.raises(DataError, match=r"^data file t\.csv: line 2\b.*" + message):
        data.parse_row(Path("t.csv"), 2, dict(zip(data.COLUMNS, bad)))


def test_bad_rows_are_skipped_with_a_count(tmp_path, caplog):
    rows = [row(*CRUSHING)] + [bad for bad, _ in BAD_ROWS] + [row(*ENDGAME)]
    path = write_csv(tmp_path / "mixed.csv", rows)
    with caplog.at_level(logging.WARNING, logger="domains.chess_puzzles.data"):
        tasks = data.load_tasks(path)
    assert [t.id for t in tasks] == ["mixed-00008", "mixed-0000D"]
    messages = [r.getMessage() for r in caplog.records]
    assert f"data file {path}: skipped 8 of 10 rows examined" in messages
    assert any("mixed.csv: line 3: empty PuzzleId; skipped" in m for m in messages)
    assert sum("; skipped" in m for m in messages) == data.MAX_ROW_WARNINGS  # the rest only in the count


def test_all_rows_bad(tmp_path):
    path = write_csv(tmp_path / "bad.csv", [bad for bad, _ in BAD_ROWS[:3]])
    with pytest.raises(DataError, match=r"bad\.csv: no usable puzzle rows \(3 read\); the first problem: .*line 2"):
        data.load_tasks(path)


def test_repeated_start_positions_are_kept_once(tmp_path):
    path = write_csv(tmp_path / "rep.csv", [row(*ENDGAME), row("again", *ENDGAME[1:])])
    assert [t.id for t in data.load_tasks(path)] == ["rep-0000D"]


# --- splits ----------------------------------------------------------------------------------------------


def puzzle_rows(n: int, seed: int) -> list[list[str]]:
    """n generated puzzles as rows of the public format (ids p0, p1, ...)."""
    puzzles = generator.generate_puzzles(random.Random(f"rows:{seed}"), n, set())
    return [row(f"p{i}", p.fen, " ".join(p.moves), str(p.rating), p.themes) for i, p in enumerate(puzzles)]


@pytest.fixture(scope="module")
def lichess_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lichess")
    rows = puzzle_rows(40, 0)
    train = write_csv(root / "train.csv", rows[:34] + [bad for bad, _ in BAD_ROWS])
    test = write_csv(root / "test.csv", rows[30:])  # 4 puzzles also in train: kept out of training
    return train, test


def test_file_splits_disjoint_sized_and_seeded(lichess_files):
    train, test = lichess_files
    cfg = DataConfig(source="files", train_path=train, test_paths=[test], n_weight=20, n_harness=5, n_val=4, n_test=6)
    splits = DOMAIN.load_splits(cfg, seed=0)  # Splits checks disjointness by question text
    assert splits.sizes() == {"weight": 20, "harness": 5, "val": 4, "test": 6}
    test_ids = {t.id.split("-")[1] for t in splits.test}
    train_ids = {t.id.split("-")[1] for role in ("weight", "harness", "val") for t in getattr(splits, role)}
    assert not test_ids & train_ids and train_ids <= {f"p{i}" for i in range(34)}
    again = DOMAIN.load_splits(cfg, seed=0)
    assert [t.id for t in again.weight] == [t.id for t in splits.weight]
    other = DOMAIN.load_splits(cfg, seed=1)
    assert [t.id for t in other.val] != [t.id for t in splits.val]


def test_file_splits_weight_gets_the_rest(lichess_files):
    train, test = lichess_files
    cfg = DataConfig(source="files", train_path=train, test_paths=[test], n_weight=500, n_harness=5, n_val=4, n_test=10)
    splits = DOMAIN.load_splits(cfg, seed=0)
    assert splits.sizes() == {"weight": 30 - 9, "harness": 5, "val": 4, "test": 10}  # 34 minus 4 test puzzles
    cfg = DataConfig(source="files", train_path=train, test_paths=[test], n_harness=20, n_val=20, n_test=10)
    with pytest.raises(DataError, match="too few"):
        DOMAIN.load_splits(cfg, seed=0)


def test_sample_looks_wider_when_the_first_rows_are_bad(tmp_path):
    bad = [row(f"x{i}", "not a fen", "a1a2 a2a3", "1500") for i in range(60)]
    path = write_csv(tmp_path / "mostly_bad.csv", bad + puzzle_rows(6, 1))
    assert len(data.sample_tasks([path], 5, seed=0)) == 5


# --- the generator ---------------------------------------------------------------------------------------

SIZES = {"weight": 12, "harness": 4, "val": 4, "test": 5}


@pytest.fixture(scope="module")
def generated():
    return generator.generate_splits(SIZES, seed=3)


def test_generated_splits_sized_disjoint_and_deterministic(generated):
    splits = DOMAIN.load_splits(DataConfig(n_weight=12, n_harness=4, n_val=4, n_test=5), seed=3)
    assert splits.sizes() == SIZES
    assert [t.question for t in splits.test] == [t.question for t in generated["test"]]
    fens = [t.meta["fen"] for ts in generated.values() for t in ts]
    assert len(set(fens)) == len(fens) and not any(generator.is_warmstart_fen(f) for f in fens)
    other = generator.generate_splits({**SIZES, "weight": 3}, seed=3)  # D_test depends only on seed and n_test
    assert [t.question for t in other["test"]] == [t.question for t in generated["test"]]
    assert [t.question for t in generator.generate_splits(SIZES, seed=4)["test"]] != [t.question for t in generated["test"]]


def _mates_by_brute_force(board: chess.Board) -> list[str]:
    out = []
    for move in list(board.legal_moves):
        board.push(move)
        if board.is_checkmate():
            out.append(move.uci())
        board.pop()
    return out


def test_generated_puzzles_are_what_they_claim(generated):
    kinds = [t.meta["_themes"].split()[1] for t in generated["weight"]]
    assert kinds.count("mateIn1") == 4 and kinds.count("mateIn2") == 2 and kinds.count("hangingPiece") == 6
    for t in [t for ts in generated.values() for t in ts]:
        board = chess.Board(t.meta["fen"])
        line = t.answer.split()
        assert 2 <= board.legal_moves.count() <= generator.MAX_LEGAL_MOVES
        theme = t.meta["_themes"]
        if "mateIn1" in theme:
            assert _mates_by_brute_force(board) == line
        elif "mateIn2" in theme:
            assert len(line) == 3 and not _mates_by_brute_force(board)
            board.push_uci(line[0])
            for defence in list(board.legal_moves):  # every defence is mated next move
                board.push(defence)
                assert _mates_by_brute_force(board)
                board.pop()
            board.push_uci(line[1])
            assert line[2] in _mates_by_brute_force(board)
        else:
            assert len(line) == 1 and board.is_capture(board.parse_uci(line[0])) and not _mates_by_brute_force(board)
        assert DOMAIN.verify(t, t.answer) == 1.0
        assert 400 <= t.meta["rating"] <= 2000


def test_check_candidates_keep_every_checking_move():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        board = generator._random_position(rng)
        if not board.is_valid():
            continue
        kept = set(generator.check_candidates(board))
        checks = {m for m in board.legal_moves if board.gives_check(m)}
        assert checks <= kept
        checked += len(checks)
    assert checked > 50


# --- warm-start conversations ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warmstart():
    return generator.warmstart_conversations(600, seed=0)


def test_warmstart_formats(warmstart):
    assert generator.warmstart_conversations(20, seed=0) == generator.warmstart_conversations(20, seed=0)
    user = re.compile(r"(White|Black) to move\. The opponent played (\S+)\.\nFEN: ([^\n]+)\n"
                      r"(White: [^\n]*\nBlack: [^\n]*|Black: [^\n]*\nWhite: [^\n]*)(?:\nLegal moves: (.+))?")
    wordy = plain_prompts = listed = 0
    for conv in warmstart:
        assert [m["role"] for m in conv] == ["system", "user", "assistant"]
        assert sum(len(m["content"]) for m in conv) < 900  # the tiny policy has 512 positions
        system, prompt, reply = (m["content"] for m in conv)
        assert system in generator.SYSTEM_PROMPTS
        side, last, fen, pieces, legal = user.fullmatch(prompt).groups()
        board = chess.Board(fen)
        assert side == generator.side_name(fen) and pieces.startswith(side) and pieces == generator.piece_lines(fen)
        if legal is not None:
            listed += 1
            assert legal.split(", ") == [f"{board.san(m)} {m.uci()}" for m in sorted(board.legal_moves, key=lambda m: m.uci())]
            assert chess.Move.from_uci(reply) in board.legal_moves  # copied bare from the list
            continue
        plain_prompts += "UCI" not in system
        quoted = re.fullmatch(r"After (\S+), I play (\S+)\.", reply)
        if quoted:
            assert quoted.group(1) == last and "UCI" not in system
            wordy += 1
        move = quoted.group(2) if quoted else reply
        assert chess.Move.from_uci(move) in board.legal_moves
    assert abs(wordy / plain_prompts - generator.WORDY_RATE) < 0.1
    assert abs(listed / len(warmstart) - generator.LEGAL_LIST_RATE) < 0.1


def test_warmstart_answers_are_sometimes_the_solution(warmstart):
    positions = {p.fen: p for p in generator._warmstart_positions(60, 0)}
    right: list[bool] = []
    mate_copied: list[bool] = []
    forcing: list[bool] = []
    for system, prompt, reply in warmstart:
        fen = prompt["content"].split("FEN: ")[1].split("\n")[0]
        move = reply["content"].rstrip(".").split()[-1]
        if "Legal moves" not in prompt["content"]:
            right.append(move == positions[fen].answer)
            continue
        board = chess.Board(fen)
        sans = {m.uci(): board.san(m) for m in board.legal_moves}
        if any(san.endswith("#") for san in sans.values()):
            mate_copied.append(sans[move].endswith("#"))
        else:
            forcing.append("x" in sans[move] or sans[move].endswith("+"))
    assert abs(sum(right) / len(right) - generator.CORRECT_RATE_WITHOUT_LIST) < 0.1
    # a listed mate is copied most of the time (a random listed move is rarely a mate)
    assert len(mate_copied) > 30 and abs(sum(mate_copied) / len(mate_copied) - generator.MATE_COPY_RATE) < 0.12
    # without a mate, captures and checks are preferred over a random listed move
    assert len(forcing) > 30 and sum(forcing) / len(forcing) > 0.6


def test_warmstart_positions_never_in_generated_splits(warmstart, generated):
    split_fens = {t.meta["fen"] for ts in generated.values() for t in ts}
    warm_fens = {m["content"].split("FEN: ")[1].split("\n")[0] for conv in warmstart for m in conv if m["role"] == "user"}
    assert not warm_fens & split_fens and not any(generator.is_warmstart_fen(f) for f in split_fens)


def test_warmstart_fits_the_tiny_policy_context(warmstart):
    from whale_ray.policy.tiny import TinyConfig, _render_chat, encode_sft_examples, train_tokenizer

    cfg = TinyConfig()
    tokenizer = train_tokenizer([_render_chat(c, False) for c in warmstart], cfg.vocab_size)
    examples, dropped = encode_sft_examples(tokenizer, warmstart, cfg.max_position_embeddings)
    assert dropped == 0 and max(len(ids) for ids, _ in examples) < 400


# --- the verifier ----------------------------------------------------------------------------------------

VERIFIER_CASES = [
    (BACK_RANK, "d1d8", 1.0),  # the reference mate
    (BACK_RANK, "e1e8", 1.0),  # another mate: accepted
    (BACK_RANK, "I play D1D8.", 1.0),  # only the moves count
    (BACK_RANK, "d1d8 a1a2 h1h8", 1.0),  # moves after the solution are ignored
    (BACK_RANK, "d1d7", 0.0),  # wrong
    (BACK_RANK, "e2e4", 0.0),  # illegal
    (BACK_RANK, "Rd8#", 0.0),  # unparsable: SAN is not UCI
    (BACK_RANK, "Qd1d8", 0.0),  # not a UCI token
    (BACK_RANK, "After a7a6, I play d1d8.", 0.0),  # the first move read is the opponent's
    (BACK_RANK, "", 0.0),
    (BACK_RANK, None, 0.0),
    (CRUSHING, "e6e7 b3c1 h6c1", 1.0),  # the solver's moves
    (CRUSHING, "e6e7 b2b1 b3c1 b1c1 h6c1", 1.0),  # the whole line with the replies
    (CRUSHING, "e6e7 b3c1", 0.0),  # a partial line
    (CRUSHING, "e6e7", 0.0),
    (CRUSHING, "e6e7 h1g1 h6c1", 0.0),  # second move wrong
    (PROMOTION, "f5f6 d7d8q", 1.0),
    (PROMOTION, "f5f6 d7d8r", 1.0),  # another mate on the last move: accepted
    (PROMOTION, "f5f6 d7d8b", 0.0),  # a legal promotion that does not mate
    (PROMOTION, "f5f6 d7d8", 0.0),  # a pawn must promote: illegal
    (PROMOTION, "h6h7", 0.0),  # wrong first move
]


@pytest.mark.parametrize("puzzle,response,expected", VERIFIER_CASES)
def test_verifier(puzzle, response, expected):
    assert DOMAIN.verify(task(puzzle), response) == expected


def test_a_mate_anywhere_in_the_line_ends_it_solved():
    game = verifier.PuzzleGame("6k1/5ppp/8/8/8/8/5PPP/1Q1R2K1 w - - 0 1", ["b1b2", "h7h6", "d1d8"])  # a made-up line
    assert game.play("d1d8") == "solved"  # mates at once: nothing is better


def test_uci_moves_agree_with_the_sandbox_helper():
    text = "After g8h7, I play d1d8. Not Qd1d8, not e2e45, but E7E8Q (e1g1)"
    assert verifier.uci_moves(text) == ["g8h7", "d1d8", "e7e8q", "e1g1"]
    assert tools.uci_moves(text) == "g8h7 d1d8 e7e8q e1g1"
    assert tools.UCI_MOVE.pattern == verifier.UCI_MOVE.pattern


# --- the environment -------------------------------------------------------------------------------------


def test_move_tool_plays_the_line():
    t = task(CRUSHING)
    move = DOMAIN.episode_tools(t, {})["move"]
    board = chess.Board(t.meta["fen"])
    for mine, reply in (("e6e7", "b2b1"), ("b3c1", "b1c1")):
        board.push_uci(mine)
        board.push_uci(reply)
        assert move(mine) == f"Correct. Opponent played {reply}. FEN: {board.fen()}"
    assert move("I play h6c1") == "Solved."
    with pytest.raises(ValueError, match="the puzzle is over \\(solved\\)"):
        move("h6c1")
    fresh = DOMAIN.episode_tools(t, {})["move"]  # one environment per episode
    assert fresh("e6e7").startswith("Correct.")


@pytest.mark.parametrize("played,output,status", [
    ("h6f6", "Wrong: h6f6 is legal but not the solution. The puzzle is over.", "wrong"),
    ("a1a8", "Error: illegal move a1a8 in this position. The puzzle is over.", "illegal"),
    ("Rxe7", "Error: no UCI move (like e2e4 or e7e8q) in 'Rxe7'. The puzzle is over.", "unparsable"),
])
def test_a_bad_move_ends_the_puzzle(played, output, status):
    move = DOMAIN.episode_tools(task(CRUSHING), {})["move"]
    assert move(played) == output
    with pytest.raises(ValueError, match=f"the puzzle is over \\({status}\\)"):
        move("e6e7")  # no probing for the answer after a miss
    with pytest.raises(TypeError):
        DOMAIN.episode_tools(task(CRUSHING), {})["move"](7)


def test_host_tools():
    fen = task(BACK_RANK).meta["fen"]
    board = chess.Board(fen)
    assert env.legal_moves(fen) == ", ".join(f"{m.uci()} {board.san(m)}" for m in sorted(board.legal_moves, key=lambda m: m.uci()))
    assert "d1d8 Rd8#" in env.legal_moves(fen).split(", ")  # the SAN marks mates (and + checks, x captures)
    diagram = env.board(fen).splitlines()
    assert len(diagram) == 8 and diagram[0] == ". . . . . . k ." and diagram[7] == ". . . R R . K ."
    with pytest.raises(ValueError, match="legal_moves: not a valid FEN 'nonsense'"):
        env.legal_moves("nonsense")
    with pytest.raises(ValueError, match="at most"):
        env.board("8/" * 60)
    with pytest.raises(TypeError):
        env.legal_moves(None)


def test_episode_metrics():
    calls = [{"name": "legal_moves", "args": {}, "output": "Error: whatever"},
             {"name": "move", "args": {"uci": "x"}, "output": "Error: no UCI move ..."},
             {"name": "move", "args": {"uci": "e6e7"}, "error": "the puzzle is over"}]
    t = task(CRUSHING)
    assert DOMAIN.episode_metrics(t, SimpleNamespace(tool_calls=calls)) == {"illegal_move": 1.0, "env_solved": 0.0}
    solved = [{"name": "move", "args": {"uci": "d1d8"}, "output": "Solved."}]
    assert DOMAIN.episode_metrics(t, SimpleNamespace(tool_calls=solved)) == {"illegal_move": 0.0, "env_solved": 1.0}
    assert DOMAIN.episode_metrics(t, SimpleNamespace()) == {"illegal_move": 0.0, "env_solved": 0.0}


def test_sandbox_tools_file():
    tree = ast.parse((FOLDER / "tools.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "re"}
    assert set(tools.TOOL_SPECS) == {"uci_moves"} and tools.TOOL_SPECS["uci_moves"]["parameters"]["required"] == ["text"]
    assert tools.uci_moves("no move here") == ""


# --- h0 --------------------------------------------------------------------------------------------------


def test_h0_contract_and_knobs():
    source = (FOLDER / "h0.py").read_text()
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert imported <= {"re", "collections"}
    h0 = load_h0(source)
    assert list(inspect.signature(h0["run"]).parameters) == ["task", "agent"]
    knobs = {k: v for k, v in h0.items() if k.isupper() and not isinstance(v, re.Pattern)}
    assert knobs == H0_KNOBS and all(type(knobs[k]) is type(v) for k, v in H0_KNOBS.items())
    for name in ("build_messages", "parse_move", "ask_move", "play_move", "read_reply", "extract_answer",
                 "run_episode", "run"):
        assert callable(h0[name])


def test_h0_shares_the_warmstart_formats():
    h0 = load_h0()
    t = task(CRUSHING).public()
    assert h0["SYSTEM_PROMPT"] == generator.SYSTEM_PROMPTS[0]
    assert h0["POSITION_FORMAT"] == generator.POSITION_FORMAT
    assert h0["build_messages"](t["fen"], t["opponent_move"]) == [
        {"role": "system", "content": H0_KNOBS["SYSTEM_PROMPT"]}, {"role": "user", "content": t["question"]}]
    legal = env.legal_moves(t["fen"])
    pairs = h0["legal_pairs"](legal)
    assert pairs == generator.legal_pairs(chess.Board(t["fen"]))
    assert h0["build_messages"](t["fen"], "f2g3", legal)[1]["content"] == generator.user_message(t["fen"], "f2g3", pairs)
    assert h0["LEGAL_MOVES_FORMAT"] == generator.LEGAL_MOVES_FORMAT
    move = DOMAIN.episode_tools(task(CRUSHING), {})["move"]
    board = chess.Board(t["fen"])
    board.push_uci("e6e7")
    board.push_uci("b2b1")
    assert h0["read_reply"](move("e6e7")) == (board.fen(), "b2b1")
    assert h0["read_reply"]("Solved.") is None


def test_h0_reads_the_pieces_from_the_fen_like_the_generator(generated):
    piece_lines = load_h0()["piece_lines"]
    fens = [t.meta["fen"] for ts in generated.values() for t in ts] + [task(p).meta["fen"] for p in (CRUSHING, ENDGAME)]
    for fen in fens:
        assert piece_lines(fen) == generator.piece_lines(fen)
    assert generator.piece_lines(task(BACK_RANK).meta["fen"]) == "White: K@g1 R@d1 R@e1 P@f2 P@g2 P@h2\nBlack: K@g8 P@a6 P@f7 P@g7 P@h7"


def test_h0_plays_a_mate_in_two():
    h0 = load_h0()
    t = task(PROMOTION)
    ep = episode(t, ["f5f6", "d7d8r"])
    answer = h0["run"](t.public(), ep.agent)
    assert answer == "f5f6 d7d8r" and DOMAIN.verify(t, answer) == 1.0
    assert ep.prompts[1][1]["content"] == generator.position_text("6k1/3P1p1p/5P1R/8/8/7K/8/8 w - - 1 3", "h8g8")
    assert ep.sampling[0] == {"max_tokens": 16, "temperature": 1.0, "top_k": 20, "top_p": 1.0, "stop": []}
    assert [e["output"] for e in ep.events] == [
        "Correct. Opponent played h8g8. FEN: 6k1/3P1p1p/5P1R/8/8/7K/8/8 w - - 1 3", "Solved."]


def test_h0_wordy_answer_is_read_as_the_opponents_move():
    h0 = load_h0()
    t = task(PROMOTION)
    ep = episode(t, ["After g8h8, I play f5f6."])
    answer = h0["run"](t.public(), ep.agent)
    assert answer == "After g8h8, I play f5f6." and DOMAIN.verify(t, answer) == 0.0
    assert ep.events[0]["output"] == "Error: illegal move g8h8 in this position. The puzzle is over."


def test_h0_turn_budget_exhausted():
    h0 = load_h0()
    t = task(CRUSHING)
    ep = episode(t, ["e6e7", "b3c1"])
    answer = h0["run"](t.public(), ep.agent)
    assert answer == "e6e7 b3c1" and DOMAIN.verify(t, answer) == 0.0
    assert ep.events[-1] == {"type": "turn_budget_exhausted", "max_turns": 2}


def test_h0_with_legal_moves_and_votes():
    source = (FOLDER / "h0.py").read_text().replace("OFFER_LEGAL_MOVES = False", "OFFER_LEGAL_MOVES = True")
    h0 = load_h0(source.replace("N_SAMPLES = 1", "N_SAMPLES = 3"))
    t = task(BACK_RANK)
    ep = episode(t, ["d1d7", "e1e8", "e1e8"])
    assert h0["run"](t.public(), ep.agent) == "e1e8"
    board = chess.Board(t.meta["fen"])
    assert ep.prompts[0][1]["content"].endswith(
        "\nLegal moves: " + ", ".join(f"{board.san(m)} {m.uci()}" for m in sorted(board.legal_moves, key=lambda m: m.uci())))
    assert len(ep.prompts) == 3


# --- h0 in the real sandbox ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limits():
    from whale_ray.sandbox import SandboxLimits, isolation

    try:
        isolation.bwrap_launcher()
        mode = "bwrap"
    except isolation.SetupError:  # depends on the machine: the child protocol is the same without it
        mode = "unsafe_none"
    return SandboxLimits(wall_s=20, isolation=mode)


class Script:
    """The caller's generate callback: replays completions as ModelCalls."""

    def __init__(self, completions):
        self.completions = list(completions)

    def __call__(self, messages, sampling):
        text = self.completions.pop(0)
        return ModelCall(messages=messages, text=text, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1],
                         weight_version=0, finish_reason="stop")


def sandboxed(source: str, t: Task, completions, limits):
    from whale_ray.sandbox import run_episode

    return run_episode(source, t.public(), generate=Script(completions), tools_path=DOMAIN.sandbox_tools_path,
                       host_tools={**DOMAIN.host_tools({}), **DOMAIN.episode_tools(t, {})}, limits=limits, seed=0)


def test_h0_in_the_sandbox(limits):
    t = task(CRUSHING)
    result = sandboxed((FOLDER / "h0.py").read_text().replace("MAX_TURNS = 2", "MAX_TURNS = 3"), t,
                       ["e6e7", "b3c1", "h6c1"], limits)
    assert result.status == "ok", result.reason
    assert result.answer == "e6e7 b3c1 h6c1" and DOMAIN.verify(t, result.answer) == 1.0
    assert [e["output"][:8] for e in result.events] == ["Correct.", "Correct.", "Solved."]
    result = sandboxed((FOLDER / "h0.py").read_text(), t, ["After f2g3, I play e6e7."], limits)
    assert result.status == "ok" and DOMAIN.verify(t, result.answer) == 0.0
    assert result.events[0]["output"].startswith("Error: illegal move f2g3")


def test_the_env_refuses_moves_after_a_miss_in_the_sandbox(limits):
    probe = '''
def run(task, agent):
    legal = agent.tool("legal_moves", fen=task["fen"]).split(", ")
    first = agent.tool("move", uci=legal[0])
    try:
        agent.tool("move", uci="e6e7")
    except agent.ToolError as e:
        return first + " | " + agent.tool("uci_moves", text="then e6e7") + " | " + str(e)
    return "the environment accepted a second try"
'''
    t = task(CRUSHING)
    first = env.legal_moves(t.meta["fen"]).split()[0]  # "<uci> <san>, ...": the first UCI
    assert first != "e6e7"
    result = sandboxed(probe, t, [], limits)
    assert result.status == "ok", result.reason
    assert result.answer.startswith(f"Wrong: {first} is legal but not the solution")
    assert result.answer.endswith("| e6e7 | tool 'move' raised ValueError: move: the puzzle is over (wrong); no more "
                                  "moves are accepted")


# --- skill.md --------------------------------------------------------------------------------------------


def test_skill_parses_for_the_offline_proposer():
    skill = parse_skill(DOMAIN.skill_text)
    assert not skill.warnings
    assert "Answer with one move in UCI notation." in skill.phrases
    h0_functions = {k for k, v in load_h0().items() if inspect.isfunction(v)}
    assert len(skill.variants) >= 4 and all(v.name in h0_functions for v in skill.variants)
    for prompt in generator.SYSTEM_PROMPTS:  # every warm-start prompt is a concatenation of phrases
        rest = prompt
        for phrase in sorted(skill.phrases, key=len, reverse=True):
            rest = rest.replace(phrase, "")
        assert not rest.strip(), prompt


def test_skill_variants_work_in_h0():
    variants: dict[str, list[str]] = {}
    for v in parse_skill(DOMAIN.skill_text).variants:
        variants.setdefault(v.name, []).append(v.code)
    base = (FOLDER / "h0.py").read_text()
    listed = base.replace("OFFER_LEGAL_MOVES = False", "OFFER_LEGAL_MOVES = True")
    last_move, snap = variants["parse_move"]

    h = load_h0(base + "\n" + last_move)
    assert h["parse_move"]("After g8h8, I play f5f6.") == "f5f6" and h["parse_move"]("Rd8") == "Rd8"
    t = task(PROMOTION)
    assert DOMAIN.verify(t, h["run"](t.public(), episode(t, ["After g8h8, I play f5f6.", "d7d8q"]).agent)) == 1.0

    h = load_h0(listed + "\n" + snap)
    t = task(BACK_RANK)
    legal = env.legal_moves(t.meta["fen"])
    assert h["parse_move"]("e1e8", legal) == "e1e8" and h["parse_move"]("a7e8", legal) == "e1e8"
    assert h["parse_move"]("d1d9", None) == "d1d9"
    assert h["run"](t.public(), episode(t, ["After g8h7, I play b1e8."]).agent) == "e1e8"

    (build,) = variants["build_messages"]
    h = load_h0(base + "\n" + build)
    example, answer, puzzle = h["build_messages"]("8/8/8/8/8/8/8/k6K w - - 0 1", "a2a1")[1:]
    board = chess.Board(example["content"].split("FEN: ")[1].split("\n")[0])
    board.push_uci(answer["content"])
    assert board.is_checkmate() and puzzle["content"].startswith("White to move. The opponent played a2a1.")

    always_list, mate_first, retry = variants["ask_move"]
    h = load_h0(base + "\n" + always_list)
    t = task(BACK_RANK)
    ep = episode(t, ["e1e8"])
    assert h["run"](t.public(), ep.agent) == "e1e8" and "Legal moves: " in ep.prompts[0][1]["content"]

    h = load_h0(base + "\n" + mate_first)
    ep = episode(t, [])
    answer = h["run"](t.public(), ep.agent)
    assert DOMAIN.verify(t, answer) == 1.0 and ep.prompts == [] and ep.events[0]["type"] == "listed_mate"
    t = task(CRUSHING)  # no mate listed: the model is asked
    ep = episode(t, ["e6e7", "b3c1"])
    assert h["run"](t.public(), ep.agent) == "e6e7 b3c1" and len(ep.prompts) == 2

    h = load_h0(base + "\n" + retry)
    t = task(BACK_RANK)
    ep = episode(t, ["Rd8#", "e1e8"])
    assert h["run"](t.public(), ep.agent) == "e1e8"
    assert "Legal moves:" not in ep.prompts[0][1]["content"] and "Legal moves:" in ep.prompts[1][1]["content"]
    assert ep.events[0]["type"] == "retry"

    (run_episode,) = variants["run_episode"]
    h = load_h0(base + "\n" + run_episode)
    t = task(CRUSHING)
    assert DOMAIN.verify(t, h["run"](t.public(), episode(t, ["e6e7", "b3c1", "h6c1"]).agent)) == 1.0

    (extract,) = variants["extract_answer"]
    h = load_h0(base + "\n" + extract)
    assert h["extract_answer"](["d1d8 h7h6", "After g8h8, I play f5f6."]) == "d1d8 g8h8"
