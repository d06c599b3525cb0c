"""Generate text with a local HF Llama/Mistral/Qwen2 model folder (plain or Medusa jitted decoding).

Examples:
  python scripts/generate.py --model default --chat --prompt "Write a haiku about JAX."
  python scripts/generate.py --model default --chat --prompt "Write a haiku about JAX." --heads HEADS_DIR \
      --tree mc_sim_7b_16 --json      (Medusa decoding; greedy output is identical to plain greedy)
  python scripts/generate.py --model default --chat --prompt "Tell a story." --heads default --temperature 0.7 \
      --top-p 0.9      (Medusa sampling, --acceptance exact: the same distribution as without --heads)
  python scripts/generate.py --model DIR --input prompts.jsonl --output answers.jsonl --batch-size 4 --json
  python scripts/generate.py --model DIR --input prompts.jsonl --output answers.jsonl --batch-size 16 \
      --mesh data=2,tensor=4      (sharded; add --coordinator/--num-processes/--process-id for several hosts)
Every run goes through batch generation on a device mesh (one device unless --mesh): prompts that fit one
batch keep their order, more are sorted by length into batches of --batch-size (bounding padding and
recompiles), one jitted call per batch, results in input order (with --input, a progress bar).
Input JSONL: one prompt per line, a JSON string or {"prompt": TEXT, "id": ...}. Each output row (and each
--json line) holds the id, prompt, text, token_ids, new_tokens, steps, tokens_per_step, prompt_tokens,
finish_reason ("eos" or "length"), batch, seconds, tokens_per_s and compile_seconds (seconds exclude JAX
compilation, which is reported apart), accept_lengths with Medusa decoding, the run's compiles /
compile_cache_hits: executables XLA compiled afresh / read from the persistent compilation cache
($MEDUSA_JAX_CACHE/jax_compile, see medusa_jax/compile_cache.py); with --heads also decoder ("medusa", or
"plain" where the heads' trees.json says no tree pays at this batch size) and tree (where the tree came from).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.compile_cache import CompileCounter, enable_compile_cache
from medusa_jax.text import eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads import recycle, recycle_file
from medusa_jax.trees.tree import DEFAULT_TREE, DYNAMIC_PREFIX, PRESETS, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig
from medusa_jax.inference.api import HEADS_TREE, BatchSettings
from medusa_jax.inference.mixed_decoding import is_mix, load_mixed
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.sharded import load_sharded
from medusa_jax.inference.text_generation import PromptRecord, generate_rows, read_prompts, write_jsonl
from medusa_jax.progress import heartbeat
from medusa_jax.scripts import distributed, options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, in_range
from medusa_jax.scripts.distributed import add_distributed_args
from medusa_jax.scripts.options import Option, add_fields, config_from


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that choose the decoder: plain decoding, or Medusa decoding with --heads."""
    options.HEADS.add(p, more="enables Medusa decoding; 'recycle' (Token Recycling: drafts from a table of the "
                      "tokens the model last ranked after each token, refreshed as it decodes; no heads needed; "
                      "SmolLM2 starts from the shipped warm table); 'lookup' (prompt lookup, no heads) or drafters "
                      "joined by '+' (e.g. default+recycle+lookup): mixed drafts, merged into one tree per step whose "
                      "size is chosen per step from this machine's measured step costs (default: plain decoding)")
    p.add_argument("--recycle-table", default=None,
                   help="with --heads recycle: the table file to start from (.npz, scripts/build_recycle_table.py "
                        "or --save-recycle-table; its vocabulary must be the model's) (default: the shipped SmolLM2 "
                        "table where the model is SmolLM2-135M-Instruct, else an empty table)")
    p.add_argument("--save-recycle-table", default=None,
                   help="with --heads recycle: write the table as it is after the run to this file (.npz), to start "
                        "a later run from it with --recycle-table")
    options.TREE.add(p, more=f"; needs --heads (default: the heads' own tree for this backend and --batch-size from "
                             f"their trees.json (scripts/build_tree.py), which may be plain decoding where no tree "
                             f"pays; {DEFAULT_TREE} for heads without trees.json); with --heads recycle also a "
                             f"recycling template ({', '.join(recycle.TEMPLATES)}; default "
                             f"{recycle.DEFAULT_TEMPLATE}), never a dynamic tree")
    p.add_argument("--calibration", default=None, choices=("auto", "redo", "skip"),
                   help="without --tree, how the heads' own tree is chosen: auto times the plain and tree steps on "
                        "this machine the first time (seconds; cached per machine, model, heads and batch size "
                        "under $MEDUSA_JAX_CACHE/calibration) and picks the tree with the most predicted tokens/s "
                        "from the accuracy stored with the heads, or plain decoding where no tree pays; redo times "
                        "again; skip takes the shipped trees.json as it is; with a --heads mix, the step costs its "
                        "draft sizes are chosen by, likewise: auto times them once (cached), redo times again, skip "
                        "times nothing and takes a 2-core CPU's default costs (default: $MEDUSA_JAX_CALIBRATION, "
                        "else auto)")
    p.add_argument("--acceptance", default=None, choices=("greedy", "exact", "typical"),
                   help="Medusa acceptance: greedy (output identical to plain greedy decoding; needs "
                        "--temperature 0), exact (lossless sampling: the output has exactly the distribution of "
                        "plain sampling at --temperature/--top-k/--top-p) or typical (the official Medusa's "
                        "posterior threshold 0.09, alpha 0.3, at --temperature; changes the distribution; no "
                        "--top-p/--top-k); needs --heads (default: greedy at temperature 0, exact otherwise)")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--input", help="JSONL file of prompts (a JSON string or {\"prompt\", \"id\"} per line)")
    p.add_argument("--output", help="JSONL file for the results, one row per prompt in input order "
                                    "(required with --input, optional with --prompt; written atomically; "
                                    "must not be the --input file nor inside the --model or --heads folder)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the tokenizer's chat template")
    options.MAX_NEW_TOKENS.add(p, default=128)
    add_fields(p, SamplingConfig(), Option("--temperature", "sampling temperature; 0 means greedy", check=at_least(0.0)),
               Option("--top-p", "nucleus sampling: keep the smallest set of tokens with this much probability",
                      check=in_range(0.0, 1.0, low_open=True)),
               Option("--top-k", "sample only among the k most likely tokens (applied before --top-p); 0 means no "
                      "cut", check=at_least(0)))
    options.SEED_OPTION.add(p, default=0, more="sampling")
    options.BATCH_SIZE.add(p, default=1, more="prompts per jitted call; rows of different lengths are fine; on a "
                           "mesh the rows are padded up to a multiple of data x fsdp with inactive rows")
    options.DTYPE.add(p, default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    add_decoder_arguments(p)
    options.MESH.add(p, more="for sharded decoding (a batch that does not divide by data*fsdp is padded with "
                         "inactive rows; for decoding prefer data x tensor) (default: one device)")
    options.SCAN_LAYERS.add(p, action="store_true", more="; not with a mix of drafters in --heads")
    add_fields(p, LayerExecution(), options.ATTENTION)

    add_distributed_args(p)
    a = p.parse_args(argv)
    with p.checking():
        check(a)
    return a


def check_decoder(a: argparse.Namespace) -> None:
    """The decoder flags fit together (--tree, --acceptance, --calibration need --heads, ...); --acceptance
    resolved (greedy at temperature 0, exact otherwise)."""
    if a.heads != recycle.HEAD_TYPE and (a.recycle_table is not None or a.save_recycle_table is not None):
        raise validate.UsageError("--recycle-table and --save-recycle-table need --heads recycle")
    if a.heads is None and (a.tree is not None or a.acceptance is not None or a.calibration is not None):
        raise validate.UsageError("--tree, --acceptance and --calibration need --heads (Medusa decoding)")
    if is_mix(a.heads) and a.tree is not None:
        raise validate.UsageError(f"--heads {a.heads} (mixed drafts) chooses its draft size per step: drop --tree")
    if a.heads == recycle.HEAD_TYPE and a.calibration is not None:
        raise validate.UsageError(f"--calibration {a.calibration} chooses a heads folder's own tree; --heads recycle "
                                  f"drafts a fixed template (--tree, default {recycle.DEFAULT_TEMPLATE}): drop "
                                  f"--calibration")
    if a.tree is not None and a.calibration is not None:
        raise validate.UsageError(f"--calibration {a.calibration} chooses the heads' own tree, so it does nothing "
                                  f"with --tree {a.tree}: drop one of them")
    if a.heads is not None:
        try:
            a.acceptance = DecodeConfig(config_from(SamplingConfig, a), AcceptanceConfig(a.acceptance)).kind
        except ValueError as e:
            raise validate.UsageError(f"--acceptance {a.acceptance}: {e}") from None  # only an explicit choice


def check(a: argparse.Namespace) -> None:
    """The decoder flags (check_decoder), inputs readable, --output writable and no input (nor inside the model
    or heads folder), --tree a preset, a dynamic spec or a tree file that parses: before anything loads. A flag
    given as '' is refused."""
    if a.input and not a.output:
        raise validate.UsageError("--input needs --output")
    check_decoder(a)
    if a.scan and is_mix(a.heads):
        raise validate.UsageError("--scan-layers: a mix of drafters in --heads loads the layers one by one; "
                                  "drop --scan-layers")
    if a.attention != LayerExecution.attention and is_mix(a.heads):
        raise validate.UsageError(f"--attention {a.attention}: a mix of drafters in --heads runs the default "
                                  f"attention; drop --attention")
    if a.prompt == "":  # as in an --input file, an empty prompt is refused
        raise validate.UsageError("--prompt: empty; give some text")
    validate.given("--input", a.input, "a JSONL file of prompts")
    validate.given("--output", a.output, "a file name")
    validate.given("--heads", a.heads, "a heads folder, 'default', 'recycle' or a Hub id")
    if a.input:
        validate.input_file("--input", a.input)
    recycling = a.heads == recycle.HEAD_TYPE
    (options.recycle_tree if recycling else options.tree_arg)("--tree", a.tree)
    validate.recycle_table_file("--recycle-table", a.recycle_table)
    tree_file = (a.tree if a.tree and a.tree not in PRESETS and a.tree not in recycle.TEMPLATES
                 and not a.tree.startswith(DYNAMIC_PREFIX) else None)
    heads_folder = options.heads_mix_arg("--heads", a.heads) if is_mix(a.heads) else \
        options.heads_location(a.heads)
    inputs = {"--input": a.input, "--model": options.model_location(a.model),
              "--heads": heads_folder, "--tree": tree_file, "--recycle-table": a.recycle_table}
    if a.output is not None:
        validate.output_file("--output", a.output, inputs)
    if a.save_recycle_table is not None:
        validate.output_file("--save-recycle-table", a.save_recycle_table, {**inputs, "--output": a.output})


def recycle_drafter(base, table_file: str | None):
    """The Token Recycling drafter; a --recycle-table that does not fit the model is a usage error."""
    try:
        return recycle.recycle_drafter(base, table_file)
    except recycle_file.RecycleFileError as e:
        raise validate.UsageError(f"--recycle-table {e}") from None


def decoder_fields(chosen) -> dict:
    """With --heads, each row says how it was decoded: {"decoder": "medusa" | "plain", "tree": origin/why}."""
    return {} if chosen is None else {"decoder": "plain" if chosen.tree is None else "medusa", "tree": chosen.note}


def run(a: argparse.Namespace, folder, records, tokenizer, eos) -> int:
    """Generation on the mesh (a mesh of one device without --mesh); process 0 prints and writes the output."""
    recycling = a.heads == recycle.HEAD_TYPE
    drafter = (lambda base: recycle_drafter(base, a.recycle_table)) if recycling else None
    tree = None
    if is_mix(a.heads):
        model, tree = load_mixed(folder, a.heads, MeshConfig.parse(a.mesh), a.dtype, batch=a.batch_size,
                                 calibration=a.calibration)
    else:
        model = load_sharded(folder, resolve_heads_dir(a.heads) if a.heads and not recycling else None,
                             MeshConfig.parse(a.mesh), a.dtype, drafter=drafter,
                             layers=LayerExecution(scan=a.scan, attention=a.attention))
    if a.heads and not is_mix(a.heads):
        hc = model.heads_config
        if recycling and (a.tree is None or a.tree in recycle.TEMPLATES):
            tree = recycle.template_tree(a.tree or recycle.DEFAULT_TEMPLATE, hc.top_k)
        else:
            tree = load_tree(a.tree, num_heads=hc.num_heads, max_top_k=hc.head_vocab_size) if a.tree else HEADS_TREE
    settings = BatchSettings(batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, tree=tree,
                             acceptance=AcceptanceConfig(a.acceptance),
                             sampling=config_from(SamplingConfig, a), seed=a.seed, eos_ids=tuple(eos),
                             pad_id=pad_token_id(tokenizer, eos), calibration=a.calibration)
    with CompileCounter() as compiles, heartbeat("generating", enabled=not a.input):
        rows, run = generate_rows(model, tokenizer, records, settings, chat=a.chat, progress=bool(a.input))
    rows = [{**row, **compiles.summary()} for row in rows]
    if recycling and a.save_recycle_table and jax.process_index() == 0:  # the table is the same on every process
        recycle_file.save_table(a.save_recycle_table, model.heads.table, model=model.heads.fingerprint,
                                note=f"after --heads recycle on {len(rows)} prompt(s)")
    if jax.process_index() != 0:
        return 0
    rows = [{**row, **decoder_fields(run.tree_choice)} for row in rows]
    if a.output:
        write_jsonl(a.output, rows)
    for row in rows:
        if a.json:
            print(json.dumps(row, ensure_ascii=False))
        elif not a.input:
            print(row["text"])
    if not a.json:
        how = (f"{a.batch_size} refilled slots ({run.num_batches} decode chunks)" if run.engine == "refill" else
               f"{run.num_batches} batch(es) of {a.batch_size}")
        print(f"[{run.new_tokens} new tokens for {len(rows)} prompt(s) in {how} on mesh {dict(model.mesh.shape)}: "
              f"{run.seconds:.2f} s, "
              f"{run.decode_tokens_per_second:.1f} tokens/s without the {run.compile_seconds:.1f} s of JIT "
              f"compilation ({run.num_shapes} shape(s); {compiles.compiles} XLA compilation(s), "
              f"{compiles.cache_hits} from the persistent cache), {run.tokens_per_step:.2f} tokens/step]")
        if run.tree_choice:
            print(f"[tree: {run.tree_choice.note}]")
        if recycling:
            print(f"[drafter: Token Recycling, started from {model.heads.origin}]")
        if a.save_recycle_table:
            print(f"wrote {a.save_recycle_table}")
        if a.output:
            print(f"wrote {a.output}")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)

    try:  # before any other JAX call
        distributed.initialize(distributed.config_from_args(a))
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    enable_compile_cache()

    try:
        options.mesh_devices("--mesh", a.mesh)
        options.attention_here("--attention", a.attention)
        folder = options.model_arg("--model", a.model)
        positions = options.max_positions(folder)
        if a.max_new_tokens >= positions:
            raise validate.UsageError(f"--max-new-tokens {a.max_new_tokens}: the model has {positions} positions in "
                                      f"all; lower it to at most {positions - 1} (less the prompt's tokens)")
        if a.heads and a.heads != recycle.HEAD_TYPE and not is_mix(a.heads):
            options.heads_arg("--heads", a.heads)
        records = read_prompts(a.input) if a.input else [PromptRecord(0, a.prompt)]
        tokenizer = load_tokenizer(folder)
        return run(a, folder, records, tokenizer, eos_token_ids(folder, tokenizer))
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)


if __name__ == "__main__":
    sys.exit(main())
