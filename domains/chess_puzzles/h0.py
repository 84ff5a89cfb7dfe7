"""h0, the base harness of the chess domain: deliberately weak.

One episode plays the puzzle one move at a time. Each move is a fresh chat about the current position
(the position is all the model needs); the `move` tool answers with the opponent's reply:

    user:       White to move. The opponent played a7a6.
                FEN: 6k1/5ppp/p7/8/8/8/5PPP/3R2K1 w - - 0 2
                White: K@g1 R@d1 P@f2 P@g2 P@h2
                Black: K@g8 P@a6 P@f7 P@g7 P@h7
    assistant:  d1d8
    move tool:  Solved.                  (or "Correct. Opponent played h7h6. FEN: ...", and the next move)

With OFFER_LEGAL_MOVES = True the position is followed by the legal_moves tool's list, each move's SAN
(which marks checks +, mates #, captures x) then its UCI: "Legal moves: Qh5# d1h5, Ke2 e1e2, ...".

A wrong, illegal or unparsable move ends the puzzle, and the response is the moves played. h0 is weak
on purpose: its system prompt states the answer format and nothing more, it never shows the model the
legal moves (OFFER_LEGAL_MOVES = False), parse_move passes the model's text on unchanged (the
environment reads its first UCI move: an answer in SAN, or one that quotes the opponent's move first,
"After a7a6, I play d1d8.", is an illegal move), and it plays at most MAX_TURNS = 2 moves whatever the
puzzle needs.

Standard library only: this file runs inside the sandbox.
"""

import collections
import re

SYSTEM_PROMPT = ("Solve the chess puzzle. Answer with one move in UCI notation, the from square then the to square, "
                 "as d1d8 (e7e8q for a promotion).")
MAX_TURNS = 2  # model calls (one per move) per episode
MAX_TOKENS = 16  # per model call
TEMPERATURE = 1.0
TOP_K = 20
N_SAMPLES = 1  # completions per move; above 1, the most common answer is played
OFFER_LEGAL_MOVES = False  # list the legal moves (the legal_moves tool) under the position

POSITION_FORMAT = "{side} to move. The opponent played {last}.\nFEN: {fen}\n{pieces}"
LEGAL_MOVES_FORMAT = "\nLegal moves: {moves}"  # one item per legal move: "{san} {uci}", ", " between
REPLY = re.compile(r"Correct\. Opponent played (\S+)\. FEN: (.+)")


def piece_lines(fen):
    """The pieces of each side read from the FEN, side to move first: "White: K@g1 R@d1\nBlack: K@h7 P@f7"."""
    placement, turn = fen.split()[:2]
    pieces = {"White": [], "Black": []}
    for row, rank_text in enumerate(placement.split("/")):
        file = 0
        for char in rank_text:
            if char.isdigit():
                file += int(char)
                continue
            side = "White" if char.isupper() else "Black"
            pieces[side].append(("KQRBNP".index(char.upper()), "abcdefgh"[file] + str(8 - row)))
            file += 1
    order = ("White", "Black") if turn == "w" else ("Black", "White")
    return "\n".join(side + ": " + " ".join("KQRBNP"[i] + "@" + sq for i, sq in sorted(pieces[side])) for side in order)


def position_text(fen, last):
    """Whose move, the opponent's last move, the FEN and the pieces."""
    side = "White" if fen.split()[1] == "w" else "Black"
    return POSITION_FORMAT.format(side=side, last=last, fen=fen, pieces=piece_lines(fen))


def legal_pairs(legal_moves):
    """[(uci, san), ...] from the legal_moves tool's text "d1d8 Rd8#, g1f1 Kf1" (SAN: + check, # mate, x capture)."""
    pairs = []
    for item in (legal_moves or "").split(","):
        parts = item.split()
        if parts:
            pairs.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return pairs


def format_legal(legal_moves):
    """The legal moves, each one's SAN then its UCI: "\nLegal moves: Rd8# d1d8, Kf1 g1f1"."""
    return LEGAL_MOVES_FORMAT.format(moves=", ".join(san + " " + uci for uci, san in legal_pairs(legal_moves)))


def build_messages(fen, last, legal_moves=None):
    """The chat for one move: the system prompt and the position (with the legal moves when given)."""
    user = position_text(fen, last)
    if legal_moves is not None:
        user += format_legal(legal_moves)
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


def parse_move(text, legal_moves=None):
    """The move to play from the model's text (legal_moves: the tool's list when offered, else None).
    h0: the text itself (the move tool reads its first UCI move)."""
    return text.strip()


def ask_move(agent, fen, last, legal_moves):
    """The model's move for one position: the most common parsed answer of N_SAMPLES completions."""
    messages = build_messages(fen, last, legal_moves)
    answers = []
    for _ in range(max(1, N_SAMPLES)):
        completion = agent.generate(messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
        answers.append(parse_move(completion, legal_moves))
    return collections.Counter(answers).most_common(1)[0][0]


def play_move(agent, move):
    """Play `move` with the environment's move tool; a refused call becomes the observation."""
    try:
        output = agent.tool("move", uci=move)
    except agent.ToolError as error:
        output = "Error: " + str(error)
    agent.log("tool_call", name="move", move=move, output=output)
    return output


def read_reply(output):
    """(fen, opponent's move) after a correct move, from the move tool's output; None when the puzzle ended."""
    match = REPLY.match(output.strip())
    return (match.group(2).strip(), match.group(1)) if match else None


def extract_answer(moves):
    """The final response: the moves played, space-separated (the verifier reads the UCI moves in it)."""
    return " ".join(moves)


def run_episode(task, agent):
    """Play the puzzle from its start; the moves played (the last one may have ended it)."""
    fen, last = task["fen"], task["opponent_move"]
    played = []
    for _ in range(MAX_TURNS):
        legal_moves = agent.tool("legal_moves", fen=fen) if OFFER_LEGAL_MOVES else None
        move = ask_move(agent, fen, last, legal_moves)
        played.append(move)
        reply = read_reply(play_move(agent, move))
        if reply is None:
            return extract_answer(played)
        fen, last = reply
    agent.log("turn_budget_exhausted", max_turns=MAX_TURNS)
    return extract_answer(played)


def run(task, agent):
    return run_episode(task, agent)
