"""Serve a model over an OpenAI-compatible HTTP API (continuous batching; plain decoding, or tree decoding with
--heads: greedy and sampled requests share its steps).

Examples:
  python scripts/serve.py --model default                       (SmolLM2 on http://127.0.0.1:8000)
  python scripts/serve.py --model DIR --port 8080 --batch-size 16 --context 1024 --max-queue 64
  python scripts/serve.py --model default --heads default --tree mc_sim_7b_8
  python scripts/serve.py --model default --heads recycle                  (Token Recycling: one warm table)
  python scripts/serve.py --model default --heads default+recycle+lookup   (mixed drafts, a size per step)
  python scripts/serve.py --model DIR --mesh data=2,tensor=4 --batch-size 16    (sharded over 8 devices)
Then any OpenAI client talks to it, e.g. openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none"):
POST /v1/completions and /v1/chat/completions (stream true or false; temperature, top_p, top_k, seed,
max_tokens, stop, stop_token_ids), GET /v1/models, /health, /metrics (Prometheus text).
One generation engine (inference/generation_engine.py) decodes --batch-size requests at once in rows of
--context KV-cache slots, in jitted chunks of --chunk-steps steps; a request waits in a queue of at most
--max-queue for a free row (a full queue answers 429). Every call shape is compiled before the port opens
(JAX's persistent compilation cache makes a second start fast). SIGTERM or Ctrl-C: the server stops taking
connections, finishes the requests it has, prints "drained" and ends by that signal (uvicorn's convention).
It binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from medusa_jax.compile_cache import CompileCounter, enable_compile_cache
from medusa_jax.text import eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads import recycle
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.mixed_decoding import is_mix
from medusa_jax.inference.served_drafter import served_drafter
from medusa_jax.scripts import options, validate
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import MeshConfig, check_rows_split
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, in_range
from medusa_jax.scripts.options import Option, add_fields, config_from

DEFAULT_CONTEXT = 1024  # --context when not given (or the model's positions if fewer)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 opens the server to the network (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, check=in_range(1, 65535), help="TCP port (default: %(default)s)")
    options.BATCH_SIZE.add(p, default=16, more="requests decoded at once (rows of the decode batch)")
    p.add_argument("--context", type=int, default=None, check=at_least(2),
                   help="KV-cache slots per row: a request's prompt tokens plus max_tokens must fit; at most the "
                        "model's max_position_embeddings (default: 1024, or the model's positions if fewer)")
    add_fields(p, EngineConfig(), Option("--chunk-steps", "decode steps between two admissions of queued requests; "
                                         "streamed text arrives in pieces of up to this many tokens", check=at_least(1)),
               Option("--max-queue", "requests waiting for a row at most; beyond, requests are answered 429",
                      check=at_least(1)))
    options.DTYPE.add(p, default="float32")
    options.HEADS.add(p, more=": Medusa, Hydra, EAGLE or EAGLE-3 heads; or 'recycle' (Token Recycling: one table "
                      "for all rows, warm across requests) or a mix such as default+recycle+lookup (mixed drafts, "
                      "a draft size per step from this machine's step costs at --batch-size rows); every row "
                      "decodes with the drafter (greedy output equals plain decoding's; sampled requests accept "
                      "per --acceptance) (default: plain decoding)")
    options.TREE.add(p, more="; needs --heads, never with a mix; with --heads recycle a template "
                     f"({', '.join(recycle.TEMPLATES)}) or a static tree (default: the heads' own trees.json choice "
                     f"for --batch-size, which may be plain decoding; {recycle.DEFAULT_TEMPLATE} for recycle)")
    p.add_argument("--acceptance", default=None, choices=("exact", "typical"),
                   help="how sampled requests accept drafted tokens (OpenAI's API has no field for it; greedy "
                        "requests accept greedily): exact (lossless: the law of plain sampling at the request's "
                        "temperature/top_p/top_k) or typical (the official Medusa's posterior threshold 0.09, "
                        "alpha 0.3, at the temperature; changes the distribution; requests with top_p or top_k "
                        "are refused); needs --heads (default: exact)")
    add_fields(p, LayerExecution(), options.ATTENTION)
    options.MESH.add(p, more="for sharded decoding; data x fsdp must divide --batch-size; for decoding prefer "
                     "data x tensor (default: one device)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the model folder's name)")
    a = p.parse_args(argv)
    with p.checking():
        validate.given("--host", a.host, "an address such as 127.0.0.1")
        validate.given("--served-model-name", a.served_model_name, "a model id")
        validate.given("--heads", a.heads, "a heads folder, 'default', 'recycle', a mix such as "
                                           "default+recycle+lookup, or a Hub id")
        for flag, value in (("--tree", a.tree), ("--acceptance", a.acceptance)):
            if value is not None and a.heads is None:
                raise validate.UsageError(f"{flag} {value}: needs --heads (tree decoding)")
        if a.tree is not None and is_mix(a.heads):
            raise validate.UsageError(f"--tree {a.tree}: --heads {a.heads} (mixed drafts) chooses its draft size "
                                      f"per step; drop --tree")
        if a.attention != LayerExecution.attention and is_mix(a.heads):
            raise validate.UsageError(f"--attention {a.attention}: a mix of drafters in --heads runs the default "
                                      f"attention; drop --attention")
        (options.recycle_tree if a.heads == recycle.HEAD_TYPE else options.tree_arg)("--tree", a.tree)
        options.mesh_devices("--mesh", a.mesh)
        options.attention_here("--attention", a.attention)
        check_rows_split("--batch-size", a.batch_size, a.mesh)
        check_listen(a.host, a.port)
    return a


def check_listen(host: str, port: int) -> None:
    """The address resolves and the port can be bound now (checked before the model loads)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise validate.UsageError(f"--host {host}: cannot be resolved ({e}); give an address such as 127.0.0.1")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise validate.UsageError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pick another "
                                      f"port or stop what uses it") from None


def build_engine(a: argparse.Namespace):
    """(engine, tokenizer, model id) from checked flags; every call shape of the engine compiled."""
    folder = options.model_arg("--model", a.model)
    heads_dir = None if a.heads is None or a.heads == recycle.HEAD_TYPE else \
        options.heads_mix_arg("--heads", a.heads) if is_mix(a.heads) else options.heads_arg("--heads", a.heads)
    positions = options.max_positions(folder)
    if a.context is not None:
        options.within_positions(f"--context {a.context}", a.context, folder)
    context = a.context or min(DEFAULT_CONTEXT, positions)
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, tokenizer)
    model = load_pretrained(folder, a.dtype, layers=LayerExecution(attention=a.attention))
    drafter = served_drafter(model, a.heads, heads_dir, a.tree, a.batch_size, a.dtype)
    if a.heads is not None:
        print(f"medusa-serve: {drafter.note}", file=sys.stderr, flush=True)
    config = config_from(EngineConfig, a, rows=a.batch_size, context=context,
                         acceptance=AcceptanceConfig(a.acceptance if a.acceptance == "typical" else None))
    engine = GenerationEngine(model, config, eos_ids=tuple(eos), pad_id=pad_token_id(tokenizer, eos),
                              heads=drafter.heads, tree=drafter.tree,
                              mesh=MeshConfig.parse(a.mesh).make_mesh() if a.mesh else None)
    start = time.perf_counter()
    with CompileCounter() as compiles:
        shapes = engine.warm_up(fix="lower --batch-size or --context")
    print(f"medusa-serve: {shapes} call shapes ready in {time.perf_counter() - start:.1f} s ({compiles.compiles} "
          f"compiled, {compiles.cache_hits} from the persistent cache)", file=sys.stderr, flush=True)
    return engine, tokenizer, a.served_model_name or Path(folder).name


def main(argv=None) -> int:
    a = parse_args(argv)
    enable_compile_cache()
    try:
        engine, tokenizer, model_id = build_engine(a)
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)
    import uvicorn  # lazy: only the server needs it

    from medusa_jax.inference.openai_server import OpenAIServer

    engine.start()
    server = uvicorn.Server(uvicorn.Config(OpenAIServer(engine, tokenizer, model_id).app(), host=a.host,
                                           port=a.port, log_level="warning", lifespan="on"))
    print(f"medusa-serve: {model_id} on http://{a.host}:{a.port}/v1 ({a.batch_size} rows of "
          f"{engine.config.context} tokens, {'tree' if engine.drafted else 'plain'} decoding)", file=sys.stderr,
          flush=True)
    server.run()  # on SIGTERM/SIGINT uvicorn drains, then re-raises the signal: the process ends by it
    engine.close(drain=False, timeout=60)
    return 0 if engine.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
