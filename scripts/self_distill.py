"""Regenerate the assistant turns of a chat dataset with the base model (self-distillation data for heads).

Example:
  python scripts/self_distill.py --model default --data sharegpt \
      --output data/smollm2_distill.jsonl --limit 2000
Rerunning the same command resumes: ids already in --output are skipped.
  # with --save-hidden: also the Arrow store data/smollm2_distill.jsonl.arrow (train_heads.py --data it
  # --cache-hidden)
  # a pod: one process per host, each on its slice (writes data/d.shard-I-of-N.jsonl), slots over its devices;
  # the slice comes from --num-shards/--shard-index, or from the multi-host flags/env (--distributed-auto etc.)
  python scripts/self_distill.py ... --num-shards 4 --shard-index I --mesh data=8
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.training.self_distill import DistillConfig, read_done, self_distill, shard_output
from medusa_jax.training.hidden_store import store_path
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser
from medusa_jax.scripts.distributed import add_distributed_args, config_from_args, initialize
from medusa_jax.scripts.options import Option, add_fields, config_from


def build_parser() -> ArgumentParser:
    d = DistillConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, required=True)
    options.DATA.add(p, default="sharegpt", more="of the prompts")
    p.add_argument("--output", required=True,
                   help="JSONL file of ShareGPT records to write; appended to and resumed if it exists; one run per "
                        "file at a time (a second run stops at once); never the --data file nor inside --model")
    options.MAX_NEW_TOKENS.add(p, default=d.max_new_tokens, help="tokens generated per assistant turn")
    options.BATCH_SIZE.add(p, default=d.batch_size, more="decode slots run together; larger is faster "
                           "until memory runs out; on a mesh padded up to a multiple of data x fsdp with idle slots")
    add_fields(p, d, Option("--chunk-steps", "decode steps per jitted call; finished slots get new prompts between "
                            "calls"),
               Option("--max-prompt-tokens", "skip conversations whose first prompt (chat template applied) is "
                      "longer; with --max-new-tokens and --turns it sets the KV cache size, which must fit the "
                      "model's positions"),
               Option("--turns", "assistant turns regenerated per conversation, each seeing the earlier regenerated "
                      "ones"), Option("--temperature", "0 = greedy (matches greedy Medusa decoding); > 0 samples"))
    options.SEED_OPTION.add(p, default=d.seed, more="conversation order and sampling")
    add_fields(p, d, Option("--limit", "stop after this many conversations in total (>= 1), counting those already "
                            "written (default: all)", int),
               Option("--save-hidden", "also store the prompt/reply token ids, loss mask and the base model's hidden "
                      "state behind every generated token in the Arrow store OUTPUT.arrow/ (datasets.load_from_disk "
                      "opens it), so train_heads.py --data OUTPUT.arrow --cache-hidden trains the heads from it, "
                      "memory-mapped, without another pass over the backbone"),
               Option("--num-shards", "processes (hosts) splitting the conversations; each writes OUTPUT with "
                      ".shard-I-of-N before its suffix"),
               Option("--shard-index", "this process's shard, 0 .. num-shards - 1"))
    options.MESH.add(p, default="", more="of this process's devices for the decode slots (slots over data x "
                      "fsdp, weights over tensor) (default: one device)")
    options.NO_PROGRESS.add(p, action="store_true")
    add_distributed_args(p)
    return p


def check_paths(a, output) -> None:
    """--data readable, --output (and its .arrow store) writable and no input; before anything loads."""
    data = options.data_arg("--data", a.data)
    inputs = {"--data": data, "--model": options.model_location(a.model)}
    validate.output_file("--output", output, inputs)
    if Path(output).is_file():  # resumed: it must be a self-distilled JSONL (DataError), checked before any load
        read_done(Path(output))
    if a.save_hidden:
        validate.output_folder("--output", store_path(output), inputs)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        config = config_from(DistillConfig, a)
        output = shard_output(a.output, a.shard_index, a.num_shards)
        check_paths(a, output)
        if initialize(config_from_args(a)):  # the shard is this process's place in the job
            config = dataclasses.replace(config, num_shards=jax.process_count(), shard_index=jax.process_index())
            output = shard_output(a.output, config.shard_index, config.num_shards)
            check_paths(a, output)
        options.mesh_devices("--mesh", a.mesh, local=True)
        folder = options.model_arg("--model", a.model)
        needed = a.turns * (a.max_prompt_tokens + a.max_new_tokens)
        options.within_positions(f"--turns {a.turns} x (--max-prompt-tokens {a.max_prompt_tokens} + --max-new-tokens "
                                 f"{a.max_new_tokens}) = {needed}", needed, folder, "lower them")
        enable_compile_cache()
        stats = self_distill(str(folder), a.data, output, config, progress=not a.no_progress)
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
