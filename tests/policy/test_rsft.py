"""The RSFT learner (no Ray): masking, loss, accumulation, training, save/load, filtering."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from whale_ray.rsft import OPTIMIZER_FILE, STATE_FILE, InvalidExamples, RSFTLearner, collate, completion_nll, truncate

EXAMPLES = [([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10, 11]), ([12], [13, 14, 15, 16, 17]), ([3, 3, 3, 3, 3], [7])]


def learner(path, **kw):
    kw = {"lr": 1e-2, "micro_batch": 2, "seed": 0, "device": "cpu", **kw}
    return RSFTLearner(path, **kw)


# ------------------------------------------------------------------------------------------ collate
def test_collate_masks_prompt_and_padding_exactly():
    b = collate([([5, 6], [7, 8, 9]), ([1], [2])], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, -100, 7, 8, 9], [-100, 2, -100, -100, -100]]


def test_collate_truncates_prompt_from_the_left_then_keeps_completion_head():
    b = collate([([1, 2, 3, 4], [5, 6]), ([1, 2], [5, 6, 7, 8, 9])], pad_id=0, max_len=4)
    assert b["input_ids"].tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    assert b["labels"].tolist() == [[-100, -100, 5, 6], [5, 6, 7, 8]]
    assert truncate([1, 2], [3], 10) == ([1, 2], [3])
    assert collate([], pad_id=0)["input_ids"].shape == (0, 0)


# --------------------------------------------------------------------------------------------- loss
class FixedLogits(torch.nn.Module):
    """A stand-in model whose logits are a given tensor, whatever the input."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.logits)


def test_loss_is_cross_entropy_over_completion_tokens_only():
    torch.manual_seed(1)
    examples = [([5, 6], [7, 8, 9]), ([1], [2])]
    batch = collate(examples, pad_id=0)
    logits = torch.randn(2, 5, 16)
    nll, n = completion_nll(FixedLogits(logits), batch)
    # by hand: position t-1 predicts token t, for every completion token t
    manual = -(F.log_softmax(logits[0, 1], -1)[7] + F.log_softmax(logits[0, 2], -1)[8]
               + F.log_softmax(logits[0, 3], -1)[9] + F.log_softmax(logits[1, 0], -1)[2])
    assert n == 4
    assert torch.allclose(nll, manual)
    # logits at positions that predict prompt tokens or padding do not matter...
    changed = logits.clone()
    changed[0, 0] += 100 * torch.randn(16)  # predicts prompt token 6
    changed[0, 4] += 100 * torch.randn(16)  # predicts nothing (end)
    changed[1, 1:] += 100 * torch.randn(4, 16)  # padding
    assert torch.allclose(completion_nll(FixedLogits(changed), batch)[0], nll)
    # ...and those that predict a completion token do
    changed[0, 2] += 100 * torch.randn(16)
    assert not torch.allclose(completion_nll(FixedLogits(changed), batch)[0], nll)


def test_train_step_lowers_the_loss_of_its_examples(tiny_model):
    lrn = learner(tiny_model)
    before = lrn.evaluate_loss(EXAMPLES)
    for _ in range(5):
        t0 = time.perf_counter()
        m = lrn.train_step(EXAMPLES * 2)
        wall = time.perf_counter() - t0
    after = lrn.evaluate_loss(EXAMPLES)
    assert after < before - 0.5
    assert m["trained"] and m["step"] == 5 and m["n_examples"] == 8 and m["n_tokens"] == 24
    assert m["grad_norm"] > 0 and math.isfinite(m["loss"])
    assert all(m[k] > 0 for k in ("prepare_s", "pass_s", "update_s"))
    assert m["prepare_s"] + m["pass_s"] + m["update_s"] <= wall
    # lengths 7, 7, 6, 6, 6, 6, 4, 4 length-sorted into micro-batches of 2: widths 7, 6, 6, 4
    assert m["max_width"] == 7 and m["padded_tokens"] == 2 * (7 + 6 + 6 + 4)


def test_gradient_accumulation_equals_one_big_batch(tiny_model):
    base = learner(tiny_model, micro_batch=64)
    acc = learner(tiny_model, micro_batch=1)
    for lrn in (base, acc):  # plain SGD: the update is the (clipped) gradient itself
        lrn.optimizer = torch.optim.SGD(lrn.model.parameters(), lr=1.0)
    before = base.state_dict()
    m_base, m_acc = base.train_step(EXAMPLES), acc.train_step(EXAMPLES)
    assert m_base["loss"] == pytest.approx(m_acc["loss"], rel=1e-5)
    assert m_base["grad_norm"] == pytest.approx(m_acc["grad_norm"], rel=1e-5)
    after_base, after_acc = base.state_dict(), acc.state_dict()
    moved = max(float((after_base[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4
    for k in before:
        torch.testing.assert_close(after_acc[k] - before[k], after_base[k] - before[k], atol=1e-6, rtol=1e-4)


def test_epochs_per_step_makes_that_many_updates(tiny_model):
    one, two = learner(tiny_model), learner(tiny_model, epochs_per_step=2)
    m1, m2 = one.train_step(EXAMPLES), two.train_step(EXAMPLES)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)  # the same first pass
    assert m2["last_epoch_loss"] < m2["loss"] and m2["step"] == 1


def test_save_load_resumes_exactly(tiny_model, tmp_path):
    a = learner(tiny_model)
    a.train_step(EXAMPLES)
    ckpt = a.save(tmp_path / "ckpt")
    assert json.loads((ckpt / "tokenizer_config.json").read_text()) == {"marker": "tok"}
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    m_a = a.train_step(EXAMPLES[:3])

    b = learner(tiny_model)
    b.load(ckpt)
    assert b.step == 1
    m_b = b.train_step(EXAMPLES[:3])
    timings = ("prepare_s", "pass_s", "update_s")
    assert {k: v for k, v in m_a.items() if k not in timings} == {k: v for k, v in m_b.items() if k not in timings}
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)


def test_a_warm_up_leaves_the_learner_as_it_was(tiny_model):
    warmed, cold = learner(tiny_model, seed=3), learner(tiny_model, seed=3)
    rng = torch.get_rng_state()
    assert warmed.warm_up() > 0
    assert torch.equal(torch.get_rng_state(), rng) and warmed.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in warmed.model.parameters()) and warmed.step == warmed.updates == 0
    m_w, m_c = warmed.train_step(EXAMPLES), cold.train_step(EXAMPLES)
    timings = ("prepare_s", "pass_s", "update_s")
    assert {k: v for k, v in m_w.items() if k not in timings} == {k: v for k, v in m_c.items() if k not in timings}
    sw, sc = warmed.state_dict(), cold.state_dict()
    assert all(torch.equal(sw[k], sc[k]) for k in sw)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write to it fails: no space)")
def test_a_checkpoint_write_that_runs_out_of_space_names_the_checkpoint_and_the_file(tiny_model, tmp_path):
    # the optimizer state's file leads to /dev/full, as a full disk would: torch's own error names neither
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / OPTIMIZER_FILE).symlink_to("/dev/full")
    a = learner(tiny_model)
    a.train_step(EXAMPLES)
    with pytest.raises(RuntimeError, match=rf"checkpoint {ckpt}: writing {OPTIMIZER_FILE} failed \(.* free on its "
                       r"filesystem\)"):
        a.save(ckpt)
    assert not (ckpt / STATE_FILE).exists()  # the record that makes a checkpoint loadable is written last


def test_empty_step_is_a_no_op(tiny_model):
    lrn = learner(tiny_model)
    before = lrn.state_dict()
    m = lrn.train_step([])
    assert m["trained"] is False and m["n_examples"] == 0 and m["n_tokens"] == 0 and m["step"] == 0
    after = lrn.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert lrn.optimizer.state_dict()["state"] == {}


def test_out_of_vocabulary_ids_are_rejected_before_any_change(tiny_model):
    lrn = learner(tiny_model)
    before = lrn.state_dict()
    with pytest.raises(InvalidExamples, match="vocabulary"):
        lrn.train_step(EXAMPLES + [([1], [64])])
    assert lrn.step == 0 and all(torch.equal(before[k], v) for k, v in lrn.state_dict().items())


# ------------------------------------------------------------------------------------ acceptance
