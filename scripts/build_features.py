"""Build the teacher-forced feature store: chat conversations -> the frozen base model's final hidden state at
every token (float16, Arrow), one forward per conversation and no generation. The EAGLE-style drafter trains on
it: train_heads.py --head-type eagle --data STORE.

Example (SmolLM2 + ShareGPT, 5M tokens; its build rate on a 2-core CPU is in docs/training.md): it resumes, so it
can grow across sessions:
  python scripts/build_features.py --model default --data sharegpt --output features/smollm2-sharegpt \
      --max-tokens 5000000
Rerunning the same command resumes (the shards already written are kept); a larger --max-tokens grows the
store, and its first 1M tokens are the 1M store of the same settings (train_heads.py --max-tokens takes a prefix).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model import sharding as shd
from medusa_jax.text import eos_token_ids, load_tokenizer
from medusa_jax.training.teacher_forced import FeatureStoreConfig, build_feature_store
from medusa_jax.training.output_folder import FileLock, made_folders
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least
from medusa_jax.scripts.options import Option, add_fields, config_from


def build_parser() -> ArgumentParser:
    d = FeatureStoreConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    options.DATA.add(p, default="sharegpt", more="to take the features of")
    p.add_argument("--output", required=True,
                   help="the store folder: new, empty, or a store to resume or grow; one build per store at a time; "
                        "never inside --model or --data")
    add_fields(p, d, Option("--max-tokens", "stop once the store holds this many tokens"),
               Option("--seq-len", "a conversation keeps its first SEQ_LEN tokens; forward rows are this wide; at "
                      "most the model's positions", check=at_least(8)),
               Option("--rows-per-call", "packed rows per forward call; on a mesh it must divide over the data axes"),
               Option("--chunk-tokens", "tokens per written shard, about"))
    options.SEED_OPTION.add(p, default=d.seed, more="the order conversations are taken in")
    add_fields(p, d, Option("--limit", "read only the first N usable conversations (default: all)", int))
    options.MESH.add(p, default="", more="for the forward, e.g. data=8 (default: one device)")
    options.NO_PROGRESS.add(p, action="store_true")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        config = config_from(FeatureStoreConfig, a)
        data = options.data_arg("--data", a.data)
        validate.output_folder("--output", a.output, {"--model": options.model_location(a.model), "--data": data})
        shd.check_rows_split("--rows-per-call", a.rows_per_call, a.mesh)
        options.mesh_devices("--mesh", a.mesh)
        model_dir = options.model_arg("--model", a.model)
        options.within_positions(f"--seq-len {a.seq_len}", a.seq_len, model_dir)
        with made_folders(a.output, include_path=True), FileLock(a.output, "--output"):
            enable_compile_cache()
            mesh = shd.MeshConfig.parse(a.mesh).make_mesh()
            base = load_pretrained(model_dir, sharding_for=shd.sharding_for(mesh) if mesh.size > 1 else None)
            put = (lambda x: jax.device_put(x, shd.batch_sharding(mesh))) if mesh.size > 1 else jnp.asarray
            tokenizer = load_tokenizer(model_dir)
            folder = build_feature_store(base, tokenizer, eos_token_ids(model_dir, tokenizer), a.data, a.output,
                                         config, model_name=model_dir.name, put=put, progress=not a.no_progress)
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)
    print(json.dumps({"store": str(folder)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
