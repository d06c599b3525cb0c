"""scripts/generate.py on a tiny model with a tiny word-level tokenizer (and chat template), and
scripts/prepare_model.py / prepare_smollm2's folder handling."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from medusa_jax.text import encode_prompt, load_tokenizer
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate
from medusa_jax.demo_model import ModelPreparationError, prepare_smollm2

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
WORDS = [f"w{i}" for i in range(100)] + ["user", "assistant", ":"]
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir, tmp_path_factory):
    """The tiny llama (vocab 128) plus a word-level tokenizer over the same ids; EOS is </s> = 2."""
    import transformers

    folder = tiny_model_dir("llama")
    dst = tmp_path_factory.mktemp("tiny-cli") / "model"
    shutil.copytree(folder, dst)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                               eos_token="</s>", pad_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return dst


def run_generate(capsys, *args: str) -> tuple[int, str, str]:
    code = load_script("generate").main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_prompt_json_equals_the_engine(tiny_with_tokenizer, capsys):
    folder = tiny_with_tokenizer
    code, out, _ = run_generate(capsys, "--model", str(folder), "--prompt", "w1 w2 w3 w4", "--json",
                                "--max-new-tokens", "10")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    tok = load_tokenizer(folder)
    expect = generate(load_pretrained(folder), [encode_prompt(tok, "w1 w2 w3 w4", chat=False)],
                      max_new_tokens=10, eos_ids=(2,))[0]
    assert row["token_ids"] == expect.token_ids and row["new_tokens"] == len(expect.token_ids)
    assert row["text"] == tok.decode(expect.token_ids, skip_special_tokens=True)
    assert row["steps"] == expect.steps and row["tokens_per_step"] == pytest.approx(expect.tokens_per_step, abs=1e-3)
    assert row["prompt_tokens"] == 4  # four words (this tokenizer adds no BOS)
    assert row["tokens_per_s"] > 0 and row["seconds"] > 0


def test_generate_input_file_chat_batched(tiny_with_tokenizer, tmp_path, capsys):
    folder = tiny_with_tokenizer
    prompts = ["w5 w6", "w7 w8 w9 w10 w11 w12 w13", "w14"]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([json.dumps(prompts[0]), json.dumps({"prompt": prompts[1], "id": "b"}), "",
                              json.dumps({"prompt": prompts[2], "id": 7})]) + "\n")
    dst = tmp_path / "out" / "answers.jsonl"
    code, out, _ = run_generate(capsys, "--model", str(folder), "--input", str(src), "--output", str(dst), "--chat",
                                "--batch-size", "2", "--max-new-tokens", "6", "--json")
    assert code == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [json.loads(line) for line in out.strip().splitlines()] == rows
    assert [r["id"] for r in rows] == [0, "b", 7] and [r["prompt"] for r in rows] == prompts
    tok, model = load_tokenizer(folder), load_pretrained(folder)
    for text, row in zip(prompts, rows):
        ids = encode_prompt(tok, text, chat=True)
        assert ids[-3:] == tok.convert_tokens_to_ids(["<s>", "assistant", ":"])
        assert row["token_ids"] == generate(model, [ids], max_new_tokens=6, eos_ids=(2,))[0].token_ids


def test_generate_sampling_is_seeded(tiny_with_tokenizer, capsys):
    args = ["--model", str(tiny_with_tokenizer), "--prompt", "w3 w4", "--json", "--temperature", "1.5",
            "--top-p", "0.9", "--max-new-tokens", "12"]
    rows = [json.loads(run_generate(capsys, *args, "--seed", s)[1]) for s in ("1", "1", "2")]
    assert rows[0]["token_ids"] == rows[1]["token_ids"] != rows[2]["token_ids"]


@pytest.mark.parametrize("heads", [[], ["--heads", "recycle"]])
def test_generate_scan_layers_gives_the_per_layer_tokens(tiny_with_tokenizer, tmp_path, capsys, heads):
    """--scan-layers loads the layers stacked and decodes over a stacked KV cache, --attention xla runs prefill and
    verify through jax.nn.dot_product_attention: plain and Token Recycling decoding of a batched input file give
    the per-layer run's tokens."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(p) for p in ["w5 w6", "w7 w8 w9 w10 w11", "w14"]) + "\n")
    rows = {}
    for name, flags in (("per-layer", []), ("stacked", ["--scan-layers"]), ("xla", ["--attention", "xla"])):
        dst = tmp_path / f"{name}.jsonl"
        code, _, err = run_generate(capsys, "--model", str(tiny_with_tokenizer), "--input", str(src), "--output",
                                    str(dst), "--batch-size", "2", "--max-new-tokens", "12", *heads, *flags)
        assert code == 0, err
        rows[name] = [json.loads(line) for line in dst.read_text().splitlines()]
    for name in ("stacked", "xla"):
        assert [r["token_ids"] for r in rows[name]] == [r["token_ids"] for r in rows["per-layer"]], name
        assert [r["steps"] for r in rows[name]] == [r["steps"] for r in rows["per-layer"]], name
    assert all(len(r["token_ids"]) > 0 for r in rows["stacked"])
    with pytest.raises(SystemExit):  # a mix loads per layer
        run_generate(capsys, "--model", str(tiny_with_tokenizer), "--prompt", "w1", "--heads", "recycle+lookup",
                     "--scan-layers")
    assert "--scan-layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_generate(capsys, "--model", str(tiny_with_tokenizer), "--prompt", "w1", "--heads", "recycle+lookup",
                     "--attention", "xla")
    assert "--attention xla" in capsys.readouterr().err


def test_generate_errors(tiny_with_tokenizer, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"text": 3}\n')
    code, _, err = run_generate(capsys, "--model", str(tiny_with_tokenizer), "--input", str(bad),
                                "--output", str(tmp_path / "o.jsonl"))
    assert code == 2 and "bad.jsonl:2" in err and not (tmp_path / "o.jsonl").exists()
    code, _, err = run_generate(capsys, "--model", str(tmp_path / "nope"), "--prompt", "w1")
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit):
        run_generate(capsys, "--model", str(tiny_with_tokenizer), "--input", str(bad))  # no --output


@pytest.mark.slow
def test_prepare_model_prints_the_folder_last(smollm2_dir):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "prepare_model.py")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = Path(proc.stdout.strip().splitlines()[-1])
    assert last.is_dir() and last == Path(smollm2_dir)
    assert (last / "config.json").is_file() and (last / "model.safetensors").is_file()


def test_prepare_returns_a_prepared_folder_and_refuses_a_foreign_one(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (ready / name).write_text("{}")
    assert prepare_smollm2(ready) == ready.absolute()  # idempotent: no rebuild
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ModelPreparationError, match="not a prepared"):
        prepare_smollm2(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
