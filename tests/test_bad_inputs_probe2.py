"""A second probe of bad inputs, of the kinds tests/test_bad_inputs.py tabulates but none of its rows: numbers
written oddly (hex, 1e309, unicode digits, empty), paths given as '', '.', links, hard links or spellings of an
input, files of broken or empty JSON, tree specs and question files that used to be read only after the model
loaded, flags that contradict each other, and messages holding a newline. Each case asserts what the first table
asserts: exit status 2, one `error:` line naming the flag, no traceback, no file of the world changed. The world
is the first table's (`world`), plus the files below."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from test_bad_inputs import CASES as FIRST, CHAT, offline_hub, run_case, snapshot, world  # noqa: F401 (fixtures)
from test_bad_inputs import BF, BT, D, EX, G2, GEN, H, M, PL, SD, TR  # the first table's shorthands (BM, BB differ)


@pytest.fixture(scope="module")
def world2(world) -> Path:
    w = world
    files = {
        "empty.json": "", "list0.json": "[]", "trunc.json": json.dumps(CHAT)[:25], "obj.json": '{"a": 1}',
        "p_empty.jsonl": "", "p_noprompt.jsonl": '{"id": 1}\n', "p_number.jsonl": '{"prompt": 5}\n',
        "p_trunc.jsonl": '{"prompt": "x"\n', "p_blank.jsonl": '""\n', "p_list.jsonl": '["a", "b"]\n',
        "tree_garbage.json": "not a tree", "tree_neg.json": "[[0], [-1]]", "tree_obj.json": '{"paths": [[0]]}',
        "tree_empty.json": "[]",
        "log_list.jsonl": "[1, 2]\n", "log_noloss.jsonl": json.dumps({"kind": "train", "step": 1, "head_loss": [1.0]}) + "\n",
        "log_nostep.jsonl": json.dumps({"kind": "train", "loss": 1.0, "head_loss": [1.0]}) + "\n",
        "log_eval.jsonl": json.dumps({"kind": "train", "step": 1, "loss": 1.0, "head_loss": [1.0]}) + "\n"
                          + json.dumps({"kind": "eval", "step": 1, "head_loss": [1.0]}) + "\n",
        "log_str.jsonl": json.dumps({"kind": "train", "step": 1, "loss": 1.0, "head_loss": "x"}) + "\n",
        "q_empty.jsonl": "",
    }
    for name, text in files.items():
        (w / name).write_text(text)
    (w / "binary.json").write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    (w / "link_data.json").symlink_to(w / "data.json")
    os.link(w / "data.json", w / "hard_data.json")
    (w / "link_model").symlink_to(w / "model", target_is_directory=True)
    (w / "link_heads").symlink_to(w / "heads", target_is_directory=True)
    (w / "link_log.png").symlink_to(w / "log.jsonl")
    links = w.parent / "probe2_links"  # outside the world: snapshot() reads every file, and this link dangles
    links.mkdir(exist_ok=True)
    (links / "into_model.jsonl").symlink_to(w / "model" / "new.jsonl")  # a dangling link into an input folder
    (w / "badtrees").mkdir()
    (w / "badtrees" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (w / "badtrees" / "trees.json").write_text("{ truncated")
    (w / "badcfg").mkdir()
    (w / "badcfg" / "config.json").write_text('{"medusa_num_heads": 2,')
    (w / "sub").mkdir()
    (w / "sub" / "x.txt").write_text("x")
    return w


GENH = ("generate", ["--model", M, "--prompt", "hi", "--heads", H])
BM = ("benchmark", ["--model", M, "--heads", H, "--out", "{w}/bm"])
QK = ("benchmark", ["quick", "--model", M])
TM = ("benchmark", ["teacher-mass", "--model", M, "--data", D])
HD = ("benchmark", ["heads", "--model", M, "--heads", "a=" + H, "--out", "{w}/hd"])
CA = ("benchmark", ["calibration", "--model", M, "--heads", H, "--out", "{w}/ca"])
BB = ("benchmark_batch", ["--model", M, "--heads", H, "--out", "{w}/bb"])
SC = ("benchmark_batch", ["scaling", "--model", M, "--out", "{w}/sc"])
DC = ("benchmark_batch", ["decode", "--model", M, "--out", "{w}/dc"])
GP = ("benchmark_batch", ["gpu", "--tiny", "--out", "{w}/gp"])
LD = ("benchmark_loading", ["--model", M, "--out", "{w}/ld"])
PT = ("plot_training", ["{w}/log.jsonl", "--output", "{w}/curves.png"])
SV = ("serve", ["--model", M, "--port", "65533"])  # a port no case binds
BX = ("benchmark_mixed", ["--model", M, "--heads", H, "--out", "{w}/bx"])


def cmd(name: str, *argv: str):
    return (name, list(argv))


CASES = [  # (command, extra args, text the error line must hold)
    # ---- generate: numbers written oddly
    (GEN, ["--temperature", "1e309"], "--temperature"), (GEN, ["--temperature", "-inf"], "--temperature"),
    (GEN, ["--temperature", ""], "--temperature"), (GEN, ["--temperature", "0x1"], "--temperature"),
    (GEN, ["--top-p", "-0.0"], "--top-p"), (GEN, ["--top-p", "1e-400"], "--top-p"),
    (GEN, ["--top-k", "1.5"], "--top-k"), (GEN, ["--top-k", "0x10"], "--top-k"), (GEN, ["--top-k", ""], "--top-k"),
    (GEN, ["--seed", str(2**31)], "--seed"), (GEN, ["--seed", "1e3"], "--seed"), (GEN, ["--seed", "٣" * 12], "--seed"),
    (GEN, ["--max-new-tokens", "-5"], "--max-new-tokens"), (GEN, ["--max-new-tokens", "512"], "--max-new-tokens"),
    (GEN, ["--max-new-tokens", "1e2"], "--max-new-tokens"), (GEN, ["--max-new-tokens", "²"], "--max-new-tokens"),
    (GEN, ["--batch-size", "-1"], "--batch-size"), (GEN, ["--batch-size", "nan"], "--batch-size"),
    (GEN, ["--temperature", "0.5", "--temperature", "nan"], "--temperature"),
    (GEN, ["--temp", "nan"], "--temperature"), (GEN, ["--to", "5"], "ambiguous option: --to"),
    (GEN, ["--bogus-flag"], "--bogus-flag"), (GEN, ["stray"], "stray"), (GEN, ["--model"], "--model"),
    # generate: meshes
    (GEN, ["--mesh", "data=2,data=2"], "--mesh"), (GEN, ["--mesh", "data=²"], "--mesh"),
    (GEN, ["--mesh", "dаta=2"], "--mesh"), (GEN, ["--mesh", ","], "--mesh"), (GEN, ["--mesh", "data=-1"], "--mesh"),
    (GEN, ["--mesh", "data=1.5"], "--mesh"), (GEN, ["--mesh", "data=2;tensor=2"], "--mesh"),
    (GEN, ["--mesh", "data=" + "9" * 30], "--mesh"), (GEN, ["--mesh", "foo\nbar=2"], "--mesh"),
    # generate: paths
    (GEN, ["--output", ""], "--output"), (GEN, ["--output", "."], "is a folder"), (GEN, ["--output", "{w}"], "is a folder"),
    (GEN, ["--output", "{w}/link_model/x.jsonl"], "inside the --model"),
    (GEN, ["--output", "{w}/../probe2_links/into_model.jsonl"], "inside the --model"),
    (GEN, ["--output", M + "/../model/config.json"], "inside the --model"),
    (GEN, ["--output", "{w}/afile/a\nb.jsonl"], "is a file, not a folder"),
    (GEN, ["--output", "/proc/medusa-probe/o.jsonl"], "--output"), (GEN, ["--output", "/proc/o.jsonl"], "--output"),
    (GEN, ["--output", "/sys/o.jsonl"], "--output"),
    (GEN, ["--output", "{w}/link_heads/o.jsonl", "--heads", H], "inside the --heads"),
    (cmd("generate", "--model", M, "--input", D, "--output", "{w}/link_data.json"), [], "is the --input file"),
    (cmd("generate", "--model", M, "--input", D, "--output", "{w}/hard_data.json"), [], "is the --input file"),
    (cmd("generate", "--model", M, "--input", D, "--output", "{w}/./data.json"), [], "is the --input file"),
    (cmd("generate", "--model", M, "--input", "", "--output", "{w}/o.jsonl"), [], "--input"),
    (cmd("generate", "--model", M, "--input", "{w}/empty", "--output", "{w}/o.jsonl"), [], "is a folder"),
    (cmd("generate", "--model", M, "--input", "{w}/p_empty.jsonl", "--output", "{w}/o.jsonl"), [], "no prompts"),
    (cmd("generate", "--model", M, "--input", "{w}/p_noprompt.jsonl", "--output", "{w}/o.jsonl"), [], "p_noprompt.jsonl:1"),
    (cmd("generate", "--model", M, "--input", "{w}/p_number.jsonl", "--output", "{w}/o.jsonl"), [], "p_number.jsonl:1"),
    (cmd("generate", "--model", M, "--input", "{w}/p_trunc.jsonl", "--output", "{w}/o.jsonl"), [], "p_trunc.jsonl:1"),
    (cmd("generate", "--model", M, "--input", "{w}/p_blank.jsonl", "--output", "{w}/o.jsonl"), [], "empty prompt"),
    (cmd("generate", "--model", M, "--input", "{w}/p_list.jsonl", "--output", "{w}/o.jsonl"), [], "p_list.jsonl:1"),
    (cmd("generate", "--model", M, "--input", "{w}/binary.json", "--output", "{w}/o.jsonl"), [], "binary.json"),
    (cmd("generate", "--model", M, "--prompt", "hi", "--input", D), [], "not allowed with"),
    (cmd("generate", "--model", "", "--prompt", "hi"), [], "--model"),
    (cmd("generate", "--model", M, "--prompt", ""), [], "--prompt"),
    (cmd("generate", "--model", M, "--prompt", "hi", "--max-new-tokens", "8"), [], "tokenizer does not load"),
    (cmd("generate", "--model", "{w}/model/config.json", "--prompt", "hi"), [], "is a file"),
    (cmd("generate", "--model", "{w}/heads", "--prompt", "hi"), [], "--model"),
    (cmd("generate", "--model", "NoOrg/No-Model.v2", "--prompt", "hi"), [], "HF_HUB_OFFLINE"),
    (cmd("generate", "--model", "{w}/NoOrg/NoModel", "--prompt", "hi"), [], "does not exist"),
    # generate: decoder flags
    (GEN, ["--heads", ""], "--heads"), (GENH, ["--tree", ""], "--tree"), (GEN, ["--heads", "{w}/afile"], "--heads"),
    (GEN, ["--heads", "NoOrg/NoHeads"], "NoOrg/NoHeads"), (GEN, ["--heads", "{w}/badtrees"], "trees.json"),
    (GEN, ["--heads", "{w}/badcfg"], "config.json"),
    (GENH, ["--tree", "{w}/tree_garbage.json"], "--tree"), (GENH, ["--tree", "{w}/tree_neg.json"], "--tree"),
    (GENH, ["--tree", "{w}/tree_obj.json"], "--tree"), (GENH, ["--tree", "{w}/tree_empty.json"], "--tree"),
    (GENH, ["--tree", "{w}/empty"], "is a folder"), (GENH, ["--tree", "dynamic:0"], "--tree"),
    (GENH, ["--tree", "dynamic:abc"], "--tree"), (GENH, ["--tree", "dynamic:8,k=0"], "--tree"),
    (GENH, ["--tree", "dynamic:8,q=2"], "--tree"), (GENH, ["--tree", "mc_sim_7b_99"], "--tree"),
    (GENH, ["--tree", "mc_sim_7b_16", "--calibration", "redo"], "--calibration"),
    (GENH, ["--acceptance", "typical", "--temperature", "0.7", "--top-p", "0.9"], "--acceptance"),
    (GENH, ["--acceptance", "typical", "--temperature", "0.7", "--top-k", "5"], "--acceptance"),
    (GENH, ["--acceptance", "exact"], "--acceptance"), (GEN, ["--acceptance", "exact", "--temperature", "1"], "need --heads"),
    (GENH, ["--acceptance", "bogus"], "--acceptance"),
    # generate: multi-host flags
    (GEN, ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "--coordinator"),
    (GEN, ["--coordinator", "host:port", "--num-processes", "2", "--process-id", "0"], "--coordinator"),
    (GEN, ["--coordinator", "host:99999", "--num-processes", "2", "--process-id", "0"], "--coordinator"),
    (GEN, ["--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"], "process_id"),
    (GEN, ["--num-processes", "2"], "--num-processes"),
    # ---- self_distill
    (SD, ["--temperature", "1e309"], "--temperature"), (SD, ["--limit", "0x5"], "--limit"),
    (SD, ["--batch-size", ""], "--batch-size"), (SD, ["--shard-index", "-1"], "--shard-index"),
    (SD, ["--num-shards", "3", "--shard-index", "5"], "--shard-index"), (SD, ["--seed", "1.0"], "--seed"),
    (SD, ["--mesh", "data=2,data=2"], "--mesh"), (SD, ["--chunk-steps", "-3"], "--chunk-steps"),
    (SD, ["--max-prompt-tokens", "600"], "positions"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/link_data.json"), [], "is the --data file"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/hard_data.json"), [], "is the --data file"),
    (cmd("self_distill", "--model", M, "--data", "{w}/link_data.json", "--output", D), [], "is the --data file"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", ""), [], "--output"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "."), [], "is a folder"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/link_model/d.jsonl"), [], "inside the --model"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "/proc/d.jsonl"), [], "--output"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/afile/a\nb/c.jsonl"), [], "is a file"),
    (cmd("self_distill", "--model", M, "--data", M, "--output", "{w}/d.jsonl"), [], "not a saved dataset"),
    (cmd("self_distill", "--model", M, "--data", H, "--output", "{w}/d.jsonl"), [], "not a saved dataset"),
    (cmd("self_distill", "--model", M, "--data", "", "--output", "{w}/d.jsonl"), [], "--data"),
    (cmd("self_distill", "--model", M, "--data", "{w}/empty.json", "--output", "{w}/d.jsonl", "--max-new-tokens", "16"),
     [], "empty.json"),
    (cmd("self_distill", "--model", M, "--data", "{w}/list0.json", "--output", "{w}/d.jsonl", "--max-new-tokens", "16"),
     [], "list0.json"),
    (cmd("self_distill", "--model", M, "--data", "{w}/trunc.json", "--output", "{w}/d.jsonl", "--max-new-tokens", "16"),
     [], "trunc.json"),
    (cmd("self_distill", "--model", M, "--data", "{w}/obj.json", "--output", "{w}/d.jsonl", "--max-new-tokens", "16"),
     [], "obj.json"),
    (cmd("self_distill", "--model", M, "--data", "{w}/binary.json", "--output", "{w}/d.jsonl", "--max-new-tokens",
         "16"), [], "binary.json"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/garbage.txt", "--max-new-tokens", "16"), [],
     "garbage.txt"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/prompts.jsonl"), [], "prompts.jsonl"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/log.jsonl"), [], "log.jsonl"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/binary.json"), [], "binary.json"),
    (cmd("self_distill", "--model", "{w}/link_model/config.json", "--data", D, "--output", "{w}/d.jsonl"), [], "--model"),
    (cmd("self_distill", "--model", "NoOrg/NoModel", "--data", D, "--output", "{w}/d.jsonl"), [], "HF_HUB_OFFLINE"),
    (cmd("self_distill", "--model", M, "--data", D, "--output", "{w}/d.jsonl", "--coordinator", "h:1"), [],
     "--coordinator"),
    # ---- train_heads
    (TR, ["--learning-rate", "1e309"], "--learning-rate"), (TR, ["--learning-rate", "-1e-4"], "--learning-rate"),
    (TR, ["--heldout-fraction", "-0.1"], "--heldout-fraction"), (TR, ["--batch-size", "0x8"], "--batch-size"),
    (TR, ["--num-layers", "-1"], "--num-layers"), (TR, ["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (TR, ["--eval-every", "0"], "--eval-every"), (TR, ["--log-every", "-1"], "--log-every"),
    (TR, ["--num-proc", "0"], "--num-proc"), (TR, ["--cached-batch-size", "0"], "--cached-batch-size"),
    (TR, ["--ce-weight", "nan"], "--ce-weight"), (TR, ["--lm-loss-weight", "-1"], "--lm-loss-weight"),
    (TR, ["--seq-len", "100000"], "--seq-len"), (TR, ["--seq-len", "513"], "--seq-len"),
    (TR, ["--lm-head", "truncated:"], "--lm-head"), (TR, ["--lm-head", "truncated:-5"], "--lm-head"),
    (TR, ["--lm-head", "truncated:²"], "--lm-head"), (TR, ["--lm-head", "shared:5"], "--lm-head"),
    (TR, ["--lm-head", ""], "--lm-head"), (TR, ["--head-type", "bogus"], "--head-type"),
    (TR, ["--head-type", "eagle", "--cache-hidden"], "--head-type eagle"),
    (TR, ["--head-loss", "ce", "--ce-weight", "0"], "--head-loss"),
    (TR, ["--head-loss", "ce+kl", "--ce-weight", "0", "--kl-weight", "0"], "--head-loss"),
    (TR, ["--cache-hidden", "--mesh", "data=2", "--cached-batch-size", "3"], "--cached-batch-size"),
    (TR, ["--mesh", "data=2,fsdp=2", "--batch-size", "6"], "does not split"),
    (TR, ["--checkpoint-dir", ""], "--checkpoint-dir"), (TR, ["--checkpoint-dir", D], "is a file"),
    (TR, ["--checkpoint-dir", "{w}/link_model/ckpt"], "inside the --model"),
    (TR, ["--checkpoint-dir", "{w}/afile/ckpt"], "is a file"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", "{w}/link_model"), [], "is the --model folder"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", M + "/."), [], "is the --model folder"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", M + "/heads"), [], "inside the --model"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", M, "--force-output"), [], "is the --model folder"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", ""), [], "--output"),
    (cmd("train_heads", "--model", M, "--data", D, "--output", "/proc/heads"), [], "--output"),
    (cmd("train_heads", "--model", M, "--data", "{w}/sub", "--output", "{w}/t"), [], "not a saved dataset"),
    (cmd("train_heads", "--model", M, "--data", "{w}/nope.arrow", "--output", "{w}/t"), [], "--data"),
    (cmd("train_heads", "--model", M, "--data", "./nope/data.jsonl", "--output", "{w}/t"), [], "--data"),
    (cmd("train_heads", "--model", "{w}/notok", "--data", D, "--output", "{w}/t"), [], "no tokenizer"),
    (cmd("train_heads", "--model", "", "--data", D, "--output", "{w}/t"), [], "--model"),
    # ---- export_heads
    (EX, ["--format", ""], "--format"), (EX, ["--dtype", "float64"], "--dtype"),
    (EX, ["--format", "eagle"], "--model"), (EX, ["--format", "eagle-sglang"], "--model"),
    (EX, ["--model", "NoOrg/NoModel"], "HF_HUB_OFFLINE"), (EX, ["--model", "{w}/empty"], "no config.json"),
    (cmd("export_heads", "--heads", H, "--out", ""), [], "--out"),
    (cmd("export_heads", "--heads", H, "--out", "", "--overwrite"), [], "--out"),
    (cmd("export_heads", "--heads", H, "--out", "{w}/link_heads"), [], "is the --heads folder"),
    (cmd("export_heads", "--heads", "{w}/link_heads", "--out", H), [], "is the --heads folder"),
    (cmd("export_heads", "--heads", H, "--out", H + "/../heads/"), [], "is the --heads folder"),
    (cmd("export_heads", "--heads", H, "--out", "{w}/link_model", "--model", M), [], "is the --model folder"),
    (cmd("export_heads", "--heads", H, "--out", M + "/exported", "--model", M), [], "inside the --model"),
    (cmd("export_heads", "--heads", H, "--out", "/proc/exported"), [], "--out"),
    (cmd("export_heads", "--heads", H, "--out", "{w}/sub", "--overwrite"), [], "--out"),
    (cmd("export_heads", "--heads", "", "--out", "{w}/x"), [], "--heads"),
    (cmd("export_heads", "--heads", "{w}/afile", "--out", "{w}/x"), [], "--heads"),
    (cmd("export_heads", "--heads", "NoOrg/NoHeads", "--out", "{w}/x"), [], "NoOrg/NoHeads"),
    # ---- build_tree
    (BT, ["--batch-sizes", "1,,0"], "--batch-sizes"), (BT, ["--batch-sizes", ","], "--batch-sizes"),
    (BT, ["--batch-sizes", "5000"], "--batch-sizes"), (BT, ["--batch", "x"], "--batch"),
    (BT, ["--tree-tokens", ""], "--tree-tokens"), (BT, ["--tree-tokens", "2,5000"], "--tree-tokens"),
    (BT, ["--accuracy-scale", "1.01"], "--accuracy-scale"), (BT, ["--min-speedup", "inf"], "--min-speedup"),
    (BT, ["--max-nodes", "5000"], "--max-nodes"), (BT, ["--out", ""], "--out"), (BT, ["--out", "{w}/empty"], "is a folder"),
    (BT, ["--out", "{w}/link_model/trees.json"], "inside the --model"), (BT, ["--out", "/proc/trees.json"], "--out"),
    (BT, ["--data", D, "--out", "{w}/link_data.json"], "is the --data file"),
    (BT, ["--data", "{w}/empty"], "not a saved dataset"), (BT, ["--data", "{w}/garbage.txt"], "--data"),
    (BT, ["--data", "{w}/list0.json"], "--data"), (BT, ["--data", "{w}/binary.json"], "--data"),
    (cmd("build_tree", "--model", M, "--heads", "{w}/badtrees"), [], "trees.json"),
    (cmd("build_tree", "--model", M, "--heads", ""), [], "--heads"),
    (cmd("build_tree", "--model", G2, "--heads", H), [], "gpt2"),
    # ---- build_features
    (BF, ["--max-tokens", "1e6"], "--max-tokens"), (BF, ["--seq-len", "513"], "--seq-len"),
    (BF, ["--mesh", "fsdp=2", "--rows-per-call", "3"], "does not split"), (BF, ["--mesh", "data=64", "--rows-per-call", "64"], "needs 64 devices"),
    (BF, ["--limit", "-1"], "--limit"),
    (cmd("build_features", "--model", M, "--data", D, "--output", ""), [], "--output"),
    (cmd("build_features", "--model", M, "--data", D, "--output", "{w}/link_model"), [], "is the --model folder"),
    (cmd("build_features", "--model", M, "--data", D, "--output", "{w}/hard_data.json"), [], "is a file"),
    (cmd("build_features", "--model", M, "--data", D, "--output", "/proc/features"), [], "--output"),
    (cmd("build_features", "--model", M, "--data", "{w}/garbage.txt", "--output", "{w}/f"), [], "garbage.txt"),
    (cmd("build_features", "--model", M, "--data", "{w}/list0.json", "--output", "{w}/f"), [], "list0.json"),
    (cmd("build_features", "--model", "{w}/notok", "--data", D, "--output", "{w}/f"), [], "no tokenizer"),
    # ---- plan
    (PL, ["--batch", "1e3"], "--batch"), (PL, ["--seq", "-1"], "--seq"), (PL, ["--heads", "65"], "--heads"),
    (PL, ["--num-heads", "0"], "--num-heads"), (PL, ["--num-heads", "65"], "--num-heads"),
    (cmd("plan", "vs-device", "--heads", "4"), [], "--num-heads"),
    (PL, ["--headroom", "1e309"], "--headroom"), (PL, ["--device", "0"], "--device"), (PL, ["--device", "-5"], "--device"),
    (PL, ["--device", "1e9"], "--device"), (PL, ["--device", "²"], "--device"), (PL, ["--device", ""], "--device"),
    (PL, ["--mesh", "data=2,data=2"], "--mesh"), (PL, ["--tree", "bogus"], "--tree"), (PL, ["--tree", "dynamic:0"], "--tree"),
    (PL, ["--tree", "{w}/tree_garbage.json"], "--tree"), (PL, ["--job", ""], "--job"), (PL, ["--lm-head", "truncated"], "--lm-head"),
    (cmd("plan", "--model", "{w}/gpt2"), [], "--model"), (cmd("plan", "--model", "{w}/afile"), [], "--model"),
    (cmd("plan", "--model", "{w}/sub"), [], "--model"), (cmd("plan", "--model", ""), [], "--model"),
    (cmd("plan", "--model", M, "--seq", "513"), [], "--seq"),
    (cmd("plan", "table", "--out", ""), [], "--out"), (cmd("plan", "table", "--out", "{w}/x", "--models", ""), [], "--models"),
    (cmd("plan", "table", "--out", "{w}/x", "--models", "llama3-8b,bogus"), [], "--models"),
    (cmd("plan", "table", "--out", "/proc/x"), [], "--out"),
    (cmd("plan", "vs-device", "--batch", "0"), [], "--batch"),
    # ---- benchmark (every mode)
    (BM, ["--questions", "-1"], "--questions"), (BM, ["--questions", "1e3"], "--questions"),
    (BM, ["--temperatures", ""], "--temperatures"), (BM, ["--temperatures", "0.7,inf"], "--temperatures"),
    (BM, ["--temperatures", "0.7;1.0"], "--temperatures"), (BM, ["--batched-sizes", "1,0"], "--batched-sizes"),
    (BM, ["--sweep-sizes", "x"], "--sweep-sizes"), (BM, ["--sweep-questions", "-1"], "--sweep-questions"),
    (BM, ["--tree", "bogus"], "--tree"), (BM, ["--tree", "{w}/tree_garbage.json"], "--tree"),
    (BM, ["--tree", "mc_sim_7b_16", "--calibration", "redo"], "--calibration"),
    (BM, ["--out", ""], "--out"), (BM, ["--out", "{w}/link_heads"], "is the --heads folder"),
    (BM, ["--out", "/proc/bm"], "--out"), (BM, ["--question-file", "{w}/garbage.txt"], "garbage.txt"),
    (BM, ["--question-file", "{w}/q_empty.jsonl"], "q_empty.jsonl"), (BM, ["--question-file", "{w}/empty"], "is a folder"),
    (BM, ["--heads", "{w}/empty"], "--heads"), (BM, ["--heads", "{w}/nope"], "--heads"),
    (BM, ["--dtype", "float16"], "--dtype"),
    (QK, ["--trees", "bogus"], "--trees"), (QK, ["--trees", ","], "--trees"), (QK, ["--batch-sizes", ""], "--batch-sizes"),
    (QK, ["--max-new-tokens", "0x10"], "--max-new-tokens"), (QK, ["--heads", "{w}/nope"], "--heads"),
    (QK, ["--heads", "{w}/empty"], "--heads"), (QK, ["--model", "{w}/nope"], "--model"),
    (TM, ["--sizes", ""], "--sizes"), (TM, ["--heldout-fraction", "1"], "--heldout-fraction"),
    (TM, ["--max-positions", "0"], "--max-positions"), (TM, ["--seed", "-1"], "--seed"), (TM, [], "--data"),
    (cmd("benchmark", "teacher-mass", "--model", M, "--data", "{w}/nope.arrow"), [], "--data"),
    (cmd("benchmark", "teacher-mass", "--model", M), [], "--data"),
    (HD, ["--tree-sizes", "0"], "--tree-sizes"), (HD, ["--batch-sizes", "1,-1"], "--batch-sizes"),
    (HD, ["--dynamic-top-k", "0"], "--dynamic-top-k"), (HD, ["--dynamic-depth", ""], "--dynamic-depth"),
    (HD, ["--continuation-tokens", "3"], "--continuation-tokens"), (HD, ["--heads", "=" + H], "LABEL=FOLDER"),
    (HD, ["--heads", "a=" + H], "given twice"), (HD, ["--heads", "b={w}/nope"], "--heads"),
    (HD, ["--heads", "b={w}/empty"], "--heads"), (HD, ["--question-file", "{w}/garbage.txt"], "garbage.txt"),
    (HD, ["--data", "{w}/garbage.txt"], "--data"), (HD, ["--out", "{w}/afile"], "is a file"),
    (CA, ["--max-new-tokens", "-1"], "--max-new-tokens"), (CA, ["--question-file", "{w}/garbage.txt"], "garbage.txt"),
    (CA, ["--out", ""], "--out"), (CA, ["--out", "{w}/link_heads/c"], "inside the --heads"),
    (cmd("benchmark", "calibration", "--model", M, "--heads", "{w}/badtrees", "--out", "{w}/ca"), [], "trees.json"),
    # ---- benchmark_batch (every mode)
    (BB, ["--methods", "bogus"], "--methods"), (BB, ["--methods", ""], "--methods"), (BB, ["--methods", ","], "--methods"),
    (BB, ["--batch-sizes", ""], "--batch-sizes"), (BB, ["--tree", "bogus"], "--tree"),
    (BB, ["--tree", "{w}/tree_garbage.json"], "--tree"), (BB, ["--heads", "{w}/empty"], "no config.json"),
    (BB, ["--heads", "random", "--random-heads", "-1"], "--random-heads"),
    (BB, ["--question-file", "{w}/garbage.txt"], "garbage.txt"), (BB, ["--out", ""], "--out"),
    (BB, ["--out", "{w}/link_model"], "is the --model folder"), (BB, ["--mesh", "data=2,data=2"], "--mesh"),
    (SC, ["--batch-sizes", "0"], "--batch-sizes"), (SC, ["--context-fraction", "0"], "--context-fraction"),
    (SC, ["--heads", H, "--tree", "bogus"], "--tree"), (SC, ["--heads", H, "--tree", "{w}/tree_neg.json"], "--tree"),
    (SC, ["--heads", "{w}/empty"], "--heads"), (SC, ["--heads", "{w}/nope"], "--heads"),
    (SC, ["--out", "{w}/link_model/s"], "inside the --model"),
    (DC, ["--rounds", "0"], "--rounds"), (DC, ["--prompts", "-2"], "--prompts"), (DC, ["--torch-threads", ""], "--torch-threads"),
    (DC, ["--max-new-tokens", "512"], "--max-new-tokens"), (DC, ["--out", "{w}/link_model"], "is the --model folder"),
    (DC, ["--model", "{w}/empty"], "no config.json"),
    (GP, ["--models", "bogus"], "--models"), (GP, ["--models", ""], "--models"), (GP, ["--repeats", "0"], "--repeats"),
    (GP, ["--tree-tokens", "1"], "--tree-tokens"), (GP, ["--budget-seconds", "-1"], "--budget-seconds"),
    (GP, ["--out", ""], "--out"), (GP, ["--out", "/proc/gp"], "--out"), (GP, ["--heads-lm-head", "bogus"], "--heads-lm-head"),
    # ---- benchmark_loading, prepare_model, plot_training
    (LD, ["--runs", "²::sharded"], "--runs"), (LD, ["--runs", "1:data=²:sharded"], "--runs"),
    (LD, ["--runs", "1:data=1"], "--runs"), (LD, ["--runs", "8:data=2,data=4:sharded"], "--runs"),
    (LD, ["--out", ""], "--out"), (LD, ["--out", "{w}/link_model"], "is the --model folder"),
    (LD, ["--model", "{w}/afile"], "is a file"),
    (cmd("prepare_model", "--out", ""), [], "--out"), (cmd("prepare_model", "--out", "/proc/m"), [], "--out"),
    (cmd("prepare_model", "--out", "{w}/full"), [], "--out"),
    (PT, ["--output", ""], "--output"), (PT, ["--output", "{w}/link_data.json"], "--output"),
    (PT, ["--output", "{w}/curves.txt"], "--output"), (PT, ["--output", "/proc/curves.png"], "--output"),
    (cmd("plot_training", ""), [], "log"), (cmd("plot_training", "{w}/binary.json"), [], "binary.json"),
    (cmd("plot_training", "{w}/log_list.jsonl"), [], "log_list.jsonl"),
    (cmd("plot_training", "{w}/log_noloss.jsonl"), [], "loss"),
    (cmd("plot_training", "{w}/log_nostep.jsonl"), [], "step"),
    (cmd("plot_training", "{w}/log_eval.jsonl"), [], "top1"),
    (cmd("plot_training", "{w}/log_str.jsonl"), [], "head_loss"),
    (cmd("plot_training", "{w}/log.jsonl", "--output", "{w}/link_log.png"), [], "--output"),
    # ---- serve, benchmark_mixed: numbers written oddly, empty values, outputs inside inputs
    (SV, ["--port", "1e3"], "--port"), (SV, ["--port", "-1"], "--port"), (SV, ["--batch-size", "nan"], "--batch-size"),
    (SV, ["--max-queue", "²"], "--max-queue"), (SV, ["--context", ""], "--context"),
    (SV, ["--chunk-steps", "0x10"], "--chunk-steps"), (SV, ["--heads", "{w}/badcfg"], "--heads"),
    (SV, ["--mesh", "data=0"], "--mesh"), (SV, ["--mesh", "data=64"], "needs 64 devices"),
    (BX, ["--budgets", ""], "--budgets"), (BX, ["--budgets", "1e3"], "--budgets"),
    (BX, ["--questions", "1.5"], "--questions"), (BX, ["--max-new-tokens", "²"], "--max-new-tokens"),
    (BX, ["--mixes", ""], "--mixes"), (BX, ["--out", ""], "--out"), (BX, ["--grounded", "-1"], "--grounded"),
    (BX, ["--out", "{w}/link_model"], "is the --model folder"),
]


@pytest.mark.parametrize("command, extra, expected", CASES,
                         ids=[f"{c[0]}:{' '.join(c[1][-2:] + e)}"[:90] for c, e, _ in CASES])
def test_a_probed_bad_input_is_one_error_line_and_changes_nothing(world2, offline_hub, capsys, command, extra,
                                                                  expected):
    name, base = command
    argv = [a.replace("{w}", str(world2)) for a in base + extra]
    before = snapshot(world2)
    code, err = run_case(world2, name, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert expected.replace("{w}", str(world2)) in errors[0], errors[0]
    assert snapshot(world2) == before, "an input or output changed"


def test_the_probe_covers_every_command_and_about_180_new_inputs():
    names = {c[0][0] for c in CASES}
    assert names == {c[0][0] for c in FIRST}
    first = {(c[0][0], tuple(c[0][1] + c[1])) for c in FIRST}
    assert not first & {(c[0][0], tuple(c[0][1] + c[1])) for c in CASES}, "a case repeats the first table"
    assert len(CASES) >= 180
