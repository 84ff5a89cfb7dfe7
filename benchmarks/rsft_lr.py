"""RSFT learning rates on a real checkpoint, on CPU: what a few steps on the model's own accepted samples do.

    python benchmarks/rsft_lr.py --model /tmp/smollm2-hf --lrs 1e-6,1e-5,1e-4,3e-4 --out /tmp/rsft_lr.json

The task is "What is a ± b?" (a, b in 2..20) after two worked examples that box the answer (a world where a
small instruct model has a non-zero pass@k, so rejection sampling keeps something). θ0 samples k completions
per training prompt (T 1, top-k 20); those the math verifier accepts are the training examples. For each
learning rate a fresh `RSFTLearner`, with every other setting as whale-ray chooses it for the checkpoint
(rsft_defaults: warm-up, clipping, precision), makes the same `--steps` steps on the same examples, and is then
measured on prompts it never trained on:
- `heldout_nll`: mean completion-token NLL of θ0's own accepted samples on held-out prompts (what RSFT should
  make more likely);
- `general_nll`: mean NLL of θ0's greedy answers to general chat prompts (drift away from the model's own
  behaviour elsewhere: forgetting);
- `greedy_acc`: greedy pass@1 on the held-out prompts;
- two greedy completions of general prompts, to read for coherence.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from domains.math_reasoning.verifier import answers_match, last_boxed
from whale_ray.rsft import RSFTLearner
from whale_ray.rsft_defaults import chosen, describe_checkpoint

SHOTS = [("What is 7 + 5?", "7 + 5 = 12. The answer is \\boxed{12}."),
         ("What is 15 - 9?", "15 - 9 = 6. The answer is \\boxed{6}.")]
GENERAL = ["What is the capital of France, and what is it known for?", "Write one sentence about the ocean.",
           "Give me two tips for sleeping better.", "Explain what a verb is in one sentence.",
           "Name three fruits that are red.", "How do I boil an egg?"]


def problems(rng: random.Random, n: int, exclude: set) -> list[tuple[str, int]]:
    out = []
    while len(out) < n:
        a, b, op = rng.randint(2, 20), rng.randint(2, 20), rng.choice("+-")
        q = f"What is {a} {op} {b}?"
        if q not in exclude and q not in {p for p, _ in SHOTS}:
            exclude.add(q)
            out.append((q, a + b if op == "+" else a - b))
    return out


def messages(question: str) -> list[dict[str, str]]:
    turns = []
    for q, a in SHOTS:
        turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*turns, {"role": "user", "content": question}]


def prompt_ids(tok, msgs) -> list[int]:
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@torch.no_grad()
def generate(model, tok, prompts: list[list[int]], *, sample: bool, max_new: int, batch: int = 32,
             seed: int = 0) -> list[list[int]]:
    """Completion ids (up to and including the end-of-turn token) for each prompt, left-padded batches."""
    torch.manual_seed(seed)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[end] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        kw = {"do_sample": True, "temperature": 1.0, "top_k": 20} if sample else {"do_sample": False}
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=end,
                             pad_token_id=end, **kw)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(end) + 1] if end in row else row)
    return out


def accepted(tok, completion: list[int], gold: int) -> bool:
    box = last_boxed(tok.decode(completion, skip_special_tokens=True))
    return box is not None and answers_match(box, str(gold))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/smollm2-hf")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4,3e-4")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--heldout-prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--examples-per-step", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rsft_lr.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng, seen = random.Random(0), set()
    train, heldout = problems(rng, args.train_prompts, seen), problems(rng, args.heldout_prompts, seen)

    def sample_accepted(tasks):
        prompts = [prompt_ids(tok, messages(q)) for q, _ in tasks for _ in range(args.k)]
        golds = [g for _, g in tasks for _ in range(args.k)]
        comps = generate(base, tok, prompts, sample=True, max_new=40)
        return [(p, c) for p, c, g in zip(prompts, comps, golds) if accepted(tok, c, g)], len(prompts)

    train_ex, n_train = sample_accepted(train)
    held_ex, n_held = sample_accepted(heldout)
    general_prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in GENERAL]
    general_ex = list(zip(general_prompts, generate(base, tok, general_prompts, sample=False, max_new=60)))
    held_prompts = [prompt_ids(tok, messages(q)) for q, _ in heldout]
    print(f"theta0: {len(train_ex)}/{n_train} training samples accepted, {len(held_ex)}/{n_held} held-out; "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    settings = chosen(describe_checkpoint(args.model), use_gpu=False)
    result = {"model": args.model, "settings": settings, "train_accepted": [len(train_ex), n_train],
              "heldout_accepted": [len(held_ex), n_held], "steps": args.steps, "runs": []}

    for lr in [None] + [float(x) for x in args.lrs.split(",")]:
        learner = RSFTLearner(args.model, lr=lr or 1.0, micro_batch=8,  # lr None: θ0, never stepped seed=0, device="cpu",
                              warmup_steps=settings["warmup_steps"], max_grad_norm=settings["max_grad_norm"],
                              precision=settings["precision"])
        steps = []
        for s in range(args.steps if lr else 0):
            batch = [train_ex[(s * args.examples_per_step + j) % len(train_ex)] for j in range(args.examples_per_step)]
            m = learner.train_step(batch)
            steps.append({k: m[k] for k in ("loss", "grad_norm", "clipped", "lr")})
        learner.model.eval()
        greedy = generate(learner.model, tok, held_prompts, sample=False, max_new=24)
        general = generate(learner.model, tok, general_prompts[:2], sample=False, max_new=32)
        run = {"lr": lr, "step_losses": [round(x["loss"], 4) for x in steps],
               "grad_norms": [round(x["grad_norm"], 2) for x in steps],
               "heldout_nll": round(learner.evaluate_loss(held_ex), 4),
               "general_nll": round(learner.evaluate_loss(general_ex), 4),
               "greedy_acc": sum(accepted(tok, c, g) for c, (_, g) in zip(greedy, heldout)) / len(heldout),
               "general_greedy": [tok.decode(c, skip_special_tokens=True) for c in general]}
        result["runs"].append(run)
        print(json.dumps(run), f"{time.perf_counter() - t0:.0f} s", flush=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
