"""Bad input to `whale run`: a one-line error naming the input, exit code 2, and no run directory."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def whale(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {"COLUMNS": "400", "PATH": "/usr/bin:/bin", "HF_HUB_CACHE": f"{cwd}/hf-cache"}  # empty: no hub id is there
    return subprocess.run([sys.executable, "-m", "whale_ray.cli", "run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)


def dapo_file(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def files(tmp_path):
    good_row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}}
    train = dapo_file(tmp_path / "train.parquet", [good_row])
    no_column = dapo_file(tmp_path / "nocol.parquet", [{"prompt": good_row["prompt"]}])
    aime = tmp_path / "aime.jsonl"
    aime.write_text('{"Problem": "What is 1 + 1?", "Answer": "2"}\n')
    syntax = tmp_path / "broken.py"
    syntax.write_text("def run(task, agent):\n    return (\n")
    no_run = tmp_path / "norun.py"
    no_run.write_text("def solve(task):\n    return None\n")
    questions = tmp_path / "questions.jsonl"  # Search-R1 questions, not passages
    questions.write_text('{"question": "Where is Velmora?", "golden_answers": ["Norvessa"]}\n'
                         '{"question": "Who founded it?", "golden_answers": ["Oren"]}\n')
    return {"train": train, "nocol": no_column, "aime": aime, "syntax": syntax, "norun": no_run, "questions": questions}


def yaml_file(path, text) -> str:
    path.write_text(text)
    return str(path)


def data_config(tmp_path, name, train, test) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"data:\n  source: files\n  train_path: {train}\n  test_paths: [{test}]\n")
    return str(path)


@pytest.mark.parametrize(
    "case, needle",
    [
        (["--domain", "chemistry"], "unknown domain 'chemistry'"),
        (["--condition", "bogus"], "unknown condition 'bogus'"),
        (["--E", "0"], "E must be a positive"),
        (["--E", "-0.5"], "E must be a positive"),
        (["--I", "0"], "I must be a positive"),
        (["--harness", "{syntax}"], "syntax error at line"),
        (["--harness", "{norun}"], "run"),
        (["--harness", "{missing}"], "missing.py"),
        (["--model", "{missing}"], "missing.py: no such directory"),
        (["--model", "nobody/No-Such-Model"], "policy checkpoint nobody/No-Such-Model: no such directory, and the "
         "Hugging Face hub cache {cwd}/hf-cache holds no model nobody/No-Such-Model (whale-ray never downloads: on a "
         "machine with internet run `hf download nobody/No-Such-Model`"),
        (["--config", "{missing_data}"], "nothere.parquet"),
        (["--config", "{no_column}"], "missing column 'reward_model'"),
        (["--domain", "search_qa", "--config", "{missing_corpus}"], "retrieval.corpus_path"),
        # real files that are not a corpus: one line naming the file and its first bad line
        (["--domain", "search_qa", "--config", "{questions_corpus}"],
         'questions.jsonl: not a Search-R1 JSONL corpus, no usable passage in 2 lines; line 1: no "contents" string'),
        (["--domain", "search_qa", "--config", "{parquet_corpus}"], "train.parquet: line 1 is not UTF-8 text"),
        (["--config", "{foreign_section}"], "config key 'retrieval' belongs to domain 'search_qa'"),
        (["--config", "{serve_layout}"], "serve: engine_layout is no longer a setting: serve.preset chooses where the "
         "engine runs"),
        (["--domain", "tests.no_such_domain"], "unknown domain 'tests.no_such_domain'"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_run_dir(case, needle, tmp_path, files):
    subs = {
        "syntax": files["syntax"], "norun": files["norun"], "missing": tmp_path / "missing.py",
        "missing_data": data_config(tmp_path, "missing_data", tmp_path / "nothere.parquet", files["aime"]),
        "no_column": data_config(tmp_path, "no_column", files["nocol"], files["aime"]),
        "missing_corpus": yaml_file(tmp_path / "corpus.yaml", f"retrieval:\n  corpus_path: {tmp_path}/wiki.jsonl\n"),
        "questions_corpus": yaml_file(tmp_path / "q.yaml", f"retrieval:\n  corpus_path: {files['questions']}\n"),
        "parquet_corpus": yaml_file(tmp_path / "p.yaml", f"retrieval:\n  corpus_path: {files['train']}\n"),
        "foreign_section": yaml_file(tmp_path / "f.yaml", "retrieval:\n  kind: bm25\n"),
        "serve_layout": yaml_file(tmp_path / "s.yaml", "serve:\n  engine_layout: shared\n"),
    }
    args = [a.format(**subs) for a in case] + ["--run-dir", str(tmp_path / "run")]
    result = whale(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr + result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("whale: error:"), result.stdout
    assert needle.format(cwd=tmp_path) in lines[0]
    assert not (tmp_path / "run").exists()


def test_doctor_lists_every_layer(tmp_path):
    result = subprocess.run([sys.executable, "-m", "whale_ray.cli", "doctor"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"})
    for layer in ("bubblewrap", "per-slot uids", "rlimits", "seccomp", "Landlock", "wall-clock kill"):
        assert layer in result.stdout
    layers = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert result.returncode == (0 if all(line.startswith("[ok]") for line in layers) else 1), result.stdout


def test_build_policy_fills_the_cache_and_names_a_bad_domain(tmp_path):
    env = {"COLUMNS": "400", "PATH": "/usr/bin:/bin", "WHALE_CACHE": str(tmp_path / "cache")}

    def build(*args):
        return subprocess.run([sys.executable, "-m", "whale_ray.cli", "build-policy", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)

    bad = build("--domain", "chemistry")
    assert bad.returncode == 2 and "unknown domain 'chemistry'" in bad.stdout
    assert not (tmp_path / "cache").exists()
    good = build("--domain", "math_reasoning", "--steps", "0")
    assert good.returncode == 0, good.stdout + good.stderr
    built = list((tmp_path / "cache").glob("tiny-math_reasoning-*"))
    assert len(built) == 1 and (built[0] / "config.json").is_file()
    assert f"{built[0]}  (built on cpu" in good.stdout
