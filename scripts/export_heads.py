"""Export Medusa heads for PyTorch serving systems (official Medusa code, TGI, TensorRT-LLM, vLLM), and EAGLE
drafters in the EAGLE authors' layout (vLLM's and SGLang's EAGLE loaders, EAGLE's own code).

Example:
  python scripts/export_heads.py --heads default-medusa --out exported/medusa --model default
  python scripts/export_heads.py --heads my_heads --out exported/vllm --format vllm --dtype bfloat16
  python scripts/export_heads.py --heads my_drafter --out exported/eagle --format eagle --model default
  python scripts/export_heads.py --heads my_eagle3 --out exported/eagle3 --format eagle3 --model default
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.eagle3_layout import eagle3_serving_notes, export_eagle3
from medusa_jax.heads.eagle_layout import eagle_serving_notes, export_eagle
from medusa_jax.heads.export import ExportError, export_heads, not_an_export, serving_notes
from medusa_jax.heads.load import load_heads
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # exporting is host work; never grab an accelerator for it


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    options.HEADS.add(p, required=True, more="('default' is the shipped Hydra heads, which no PyTorch layout "
                      "describes: export 'default-medusa')")
    options.OUT.add(p, required=True, more="folder (written atomically; must not exist or be empty; temp "
                    "folders left by a killed export are removed)")
    p.add_argument("--format", choices=("medusa", "vllm", "eagle", "eagle-sglang", "eagle3"), default="medusa",
                   help="'medusa': medusa_lm_head.safetensors + config.json for the official Medusa code, TGI and "
                        "TensorRT-LLM (default); 'vllm': model.safetensors + config.json for vLLM; for an EAGLE "
                        "drafter: 'eagle' (the EAGLE authors' EAGLE-1 layout: vLLM, EAGLE's own code; an fc bias "
                        "only if the drafter has one) or 'eagle-sglang' (the same with an fc.bias, zero if the drafter "
                        "has none, and SGLang's architecture name); for an EAGLE-3 drafter: 'eagle3' (the authors' "
                        "published EAGLE-3 layout: vLLM, SGLang, speculators). All three need --model (the base's "
                        "input embedding or lm_head goes into the file)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written tensors (default float32; serve in the base model's dtype)")
    p.add_argument("--materialize-lm-head", action="store_true",
                   help="for heads that share the base lm_head: copy it into every head (needed by the official "
                        "Medusa code and TensorRT-LLM); without it the medusa format is TGI's ResBlock-only 'v2' "
                        "and the vllm format stores it once with original_lm_head. Needs --model. Own and "
                        "truncated heads already have an lm_head per head: a no-op for them")
    options.MODEL.add(p, more="(the base model): needed to write a shared lm_head (vllm format or "
                      "--materialize-lm-head) and used to check the heads' hidden size and vocabulary")
    p.add_argument("--base-model-name-or-path", default=None,
                   help="value written to config.json's base_model_name_or_path, which TGI and the official code "
                        "load as the base model (default: the heads' own value, else the --model path)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it holds an earlier export (config.json + weights written by this "
                        "script); a folder with any other file is refused, and so is --out equal to --heads")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    try:
        return run(args)
    except (OSError, ValueError) as e:  # CheckpointError, ExportError and UsageError are ValueErrors
        return validate.fail(e)


def same_folder(out: str, heads: Path | None) -> None:
    if heads is not None and Path(out).exists() and Path(out).resolve() == heads.resolve():
        raise ExportError(f"--out {out} is the --heads folder: an export would replace the source (and its "
                          f"checkpoints); choose another --out")


def check_paths(args: argparse.Namespace) -> None:
    """--out writable, not an input and (without --overwrite) empty: before anything loads."""
    validate.given("--out", args.out, "a folder")
    validate.given("--heads", args.heads, "a heads folder, 'default-medusa' or a Hub id")
    if args.format.startswith("eagle") and args.model is None:
        raise validate.UsageError(f"--format {args.format} needs --model: the drafter's file carries the base's "
                                  f"input embedding")
    out = Path(args.out)
    same_folder(args.out, options.heads_location(args.heads))
    validate.output_folder("--out", args.out, {"--heads": options.heads_location(args.heads),
                                               "--model": options.model_location(args.model)})
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise validate.UsageError(f"--out {out} is not empty: choose a new or empty folder, or pass --overwrite to "
                                  f"replace an earlier export")
    foreign = not_an_export(out) if out.is_dir() and args.overwrite else []
    if foreign:
        raise validate.UsageError(f"--out {out} holds files that are not an earlier export ({', '.join(foreign[:5])}): "
                                  f"--overwrite replaces only an earlier export; choose another --out")


def run(args: argparse.Namespace) -> int:
    check_paths(args)
    heads_dir = options.heads_arg("--heads", args.heads)  # 'default' / 'default-medusa': the shipped heads
    same_folder(args.out, heads_dir)
    model_dir = options.model_arg("--model", args.model, tokenizer=False) if args.model else None
    base = load_pretrained(model_dir, dtype="float32") if model_dir else None
    heads = load_heads(heads_dir, base_config=base.config if base is not None else None)
    if heads.export_formats and args.format not in heads.export_formats:  # none: export_heads says why
        raise ExportError(f"--format {args.format} does not fit {heads.config.head_type} heads: EAGLE drafters export "
                          f"with --format eagle or eagle-sglang, EAGLE-3 drafters with eagle3, Medusa heads with "
                          f"medusa or vllm")
    cfg, sglang = heads.config, args.format == "eagle-sglang"
    what = f"{cfg.head_type} drafter of {cfg.num_layers} decoder layer(s), lm_head {cfg.lm_head}"
    if args.format == "eagle3":  # EAGLE-1 and EAGLE-3 drafters in their authors' layouts (check_paths: --model given)
        out = export_eagle3(heads, base, args.out, dtype=args.dtype, overwrite=args.overwrite)
        notes = eagle3_serving_notes(heads)
    elif args.format.startswith("eagle"):
        out = export_eagle(heads, base, args.out, dtype=args.dtype, sglang=sglang, overwrite=args.overwrite)
        notes = eagle_serving_notes(heads, sglang)
    else:
        name = args.base_model_name_or_path
        if name is None and not cfg.base_model_name_or_path and args.model:
            name = str(model_dir.resolve())
        out = export_heads(heads, args.out, format=args.format, dtype=args.dtype, base=base,
                           materialize_lm_head=args.materialize_lm_head, base_model_name_or_path=name,
                           overwrite=args.overwrite)
        notes = serving_notes(heads, args.format, args.materialize_lm_head,
                              name if name is not None else cfg.base_model_name_or_path)
        what = f"{cfg.num_heads} heads x {cfg.num_layers} ResBlocks, lm_head={cfg.lm_head}"
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wrote {out} ({args.format} layout, {args.dtype}, {size_mb:.1f} MiB): {what}, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}")
    for note in notes:
        print(f"  - {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
