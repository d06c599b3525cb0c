"""Several heads for one base model side by side on the same text: held-out top-1/top-5, tokens/step of greedy
trees of each size, chains and dynamic trees, and wall-clock speedup per batch size; training-free drafters and
mixes join the table. What each column counts: docs/modules.md."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

from medusa_jax.atomic import pyplot, save_figure_atomic
from medusa_jax.paths import portable_path
from medusa_jax.settings import at_least, check_settings, each, each_or_none, setting
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import DEFAULT_DYNAMIC_DEPTH, DynamicTree, TreeError, build_tree, parse_dynamic_tree
from medusa_jax.trees.trees_file import trees_of
from medusa_jax.trees.policy import tree_choice
from medusa_jax.trees.policy.choose import HEADS_TREE
from medusa_jax.heads.kinds import training_free_kinds
from medusa_jax.heads.recycle import DEFAULT_TEMPLATE, recycle_drafter, template_tree, template_within
from medusa_jax.inference.api import BatchSettings, generate_batch, plan_batches
from medusa_jax.inference.mixed_decoding import DEFAULT_BUDGET, build_mix, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.trees.search import head_accuracy
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.trees.search.tree_builder import BuildTreeConfig, heldout_prompts
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import machine_line, table


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    max_new_tokens: int = setting(128, at_least(1))
    tree_sizes: tuple[int, ...] = setting((4, 16, 64), each(at_least(1)))  # nodes (root excluded) of counted trees
    chains: tuple[int, ...] = setting((3, 5), each_or_none(at_least(1)))  # chain trees [[0], [0, 0], ...], counted
    batch_sizes: tuple[int, ...] = setting((1, 4), each_or_none(at_least(1)))  # timed batch sizes
    timed_nodes: int = setting(4, at_least(1))  # tree for timing heads that carry no trees.json
    heldout: int = setting(24, at_least(1))
    data: str | None = None  # held-out conversations (None: the packaged ShareGPT file)
    continuation_tokens: int = setting(128, at_least(4))
    top_k: int = 10
    count_batch: int = setting(16, at_least(1))  # rows per call when counting tokens/step (untimed)
    dynamic_nodes: tuple[int, ...] = setting((), each_or_none(at_least(1)))  # N of the dynamic trees counted
    dynamic_top_k: tuple[int, ...] | None = setting(None, each_or_none(at_least(1)))  # None: default_dynamic_top_k
    dynamic_depth: tuple[int, ...] | None = setting(None, each_or_none(at_least(1)))  # None: default, <= the heads

    def __post_init__(self):
        check_settings(self)


def _settings(loaded: LoadedModel, config: CompareConfig, batch: int, tree=None) -> BatchSettings:
    return BatchSettings(batch_size=batch, max_new_tokens=config.max_new_tokens, tree=tree,
                         eos_ids=loaded.eos_ids, pad_id=loaded.pad_id)


def _tokens(run) -> list[list[int]]:
    return [list(r.token_ids) for r in run.results]


def _counted(loaded: LoadedModel, model: ShardedModel, prompts, reference, config: CompareConfig, tree) -> dict:
    """One untimed greedy run of `prompts` at the counting batch size: its tokens/step and rows unlike `reference`."""
    run = generate_batch(model, prompts, _settings(loaded, config, min(config.count_batch, len(prompts)), tree),
                         progress=False)
    return {"tokens_per_step": run.tokens_per_step, "mismatches": sum(a != b for a, b in zip(_tokens(run), reference))}


def count_tokens_per_step(loaded: LoadedModel, heads: MedusaHeads, accuracy_mr, prompts, reference,
                          config: CompareConfig) -> list[dict]:
    """Greedy Medusa decoding of `prompts` with the greedy tree of each size: tokens/step and mismatches."""
    model = ShardedModel(loaded.base, heads)
    rows = []
    for nodes in config.tree_sizes:
        order = tree_choice.greedy_tree(accuracy_mr, nodes)
        tree = build_tree([p for p, _ in order], name=f"greedy_{len(order)}")
        rows.append({"nodes": len(order), **_counted(loaded, model, prompts, reference, config, tree),
                     "predicted_tokens_per_step": tree_choice.expected_tokens_per_step(
                         [p for p, _ in order], accuracy_mr)})
    return rows


def count_chain_tokens_per_step(loaded: LoadedModel, heads: MedusaHeads, prompts, reference,
                                config: CompareConfig) -> list[dict]:
    """Greedy decoding with the chain trees [[0], [0, 0], ...] of each length in `config.chains` that the heads
    reach (a chain of L nodes needs L heads or drafting depths): tokens/step and mismatches."""
    model = ShardedModel(loaded.base, heads)
    rows = []
    for length in config.chains:
        if length < 1 or length > heads.config.num_heads:
            continue
        tree = build_tree([[0] * depth for depth in range(1, length + 1)], name=f"chain_{length}")
        rows.append({"chain": length, **_counted(loaded, model, prompts, reference, config, tree)})
    return rows


def dynamic_trees(config: CompareConfig, num_heads: int) -> list[DynamicTree]:
    """The dynamic trees to count: every valid (N, K, D) of the config (D at most num_heads)."""
    depths = config.dynamic_depth or (min(DEFAULT_DYNAMIC_DEPTH, num_heads),)
    trees = []
    for nodes in config.dynamic_nodes:
        for depth in sorted({min(d, num_heads) for d in depths}):
            for top_k in config.dynamic_top_k or (None,):
                try:
                    text = f"dynamic:{nodes},d={depth}" + ("" if top_k is None else f",k={top_k}")
                    tree = parse_dynamic_tree(text, num_heads=num_heads)
                except TreeError:
                    continue  # K + (D - 1) K^2 < N: this K cannot draft N nodes
                if tree not in trees:
                    trees.append(tree)
    return trees


def count_dynamic(loaded: LoadedModel, heads: MedusaHeads, accuracy_mr, prompts, reference, config: CompareConfig,
                  static_rows: list[dict], progress: Callable[[str], None] = print) -> list[dict]:
    """Greedy decoding with each dynamic tree (`dynamic_trees`), and the best static tree of the same size for
    comparison: rows with tokens/step, mismatches and the ratio to the static tree's tokens/step."""
    model = ShardedModel(loaded.base, heads)
    static = {r["nodes"]: r for r in static_rows}
    rows = []
    for tree in dynamic_trees(config, heads.config.num_heads):
        if tree.nodes not in static:  # the greedy static tree of the same node budget
            static[tree.nodes] = count_tokens_per_step(
                loaded, heads, accuracy_mr, prompts, reference, dataclasses.replace(config, tree_sizes=(tree.nodes,)))[0]
        counted, base_row = _counted(loaded, model, prompts, reference, config, tree), static[tree.nodes]
        tokens_per_step = counted["tokens_per_step"]
        rows.append({"nodes": tree.nodes, "top_k": tree.top_k, "depth": tree.depth, "tree": tree.name, **counted,
                     "static_nodes": base_row["nodes"], "static_tokens_per_step": base_row["tokens_per_step"],
                     "ratio_to_static": tokens_per_step / base_row["tokens_per_step"]})
        progress(f"  {tree.name}: tokens/step {tokens_per_step:.3f} (static {base_row['tokens_per_step']:.3f}, "
                 f"x{rows[-1]['ratio_to_static']:.3f})")
    return rows


def interleaved(runs: dict[str, tuple], prompts: Sequence[Sequence[int]], batch: int) -> dict[str, dict]:
    """Each named (model, BatchSettings) over the same prompts in batches of `batch` (`plan_batches`), the names
    taking turns at going first, batch by batch, so that a drift in the machine's speed falls on all alike. Per
    name: "tokens" per prompt, "seconds" without compilation, "steps", "new" tokens, "tokens_per_s" and the last
    run's "choice" (its tree choice)."""
    names = list(runs)
    out = {name: {"tokens": [None] * len(prompts), "seconds": 0.0, "steps": 0, "choice": None} for name in names}
    for number, indices in enumerate(plan_batches([len(p) for p in prompts], batch)):
        for name in names[number % len(names):] + names[:number % len(names)]:
            run = generate_batch(runs[name][0], [prompts[i] for i in indices], runs[name][1], progress=False)
            totals = out[name]
            totals["seconds"] += run.seconds - run.compile_seconds
            totals["steps"] += sum(r.steps for r in run.results)
            totals["choice"] = run.tree_choice
            for i, r in zip(indices, run.results):
                totals["tokens"][i] = list(r.token_ids)
    for totals in out.values():
        totals["new"] = sum(len(t) for t in totals["tokens"])
        totals["tokens_per_s"] = totals["new"] / max(totals["seconds"], 1e-9)
    return out


def time_speedup(loaded: LoadedModel, heads: MedusaHeads, accuracy_mr, prompts, config: CompareConfig) -> list[dict]:
    """Plain and Medusa with the heads' own tree per batch size (`time_against_plain`)."""
    medusa = ShardedModel(loaded.base, heads)
    own = trees_of(heads) is not None
    fallback = build_tree([p for p, _ in tree_choice.greedy_tree(accuracy_mr, config.timed_nodes)],
                          name=f"greedy_{config.timed_nodes}")
    return time_against_plain(loaded, prompts, config,
                              lambda batch: (medusa, HEADS_TREE if own else fallback, fallback.name))


def time_against_plain(loaded: LoadedModel, prompts, config: CompareConfig,
                       drafted: Callable[[int], tuple[ShardedModel, object, str]]) -> list[dict]:
    """Plain and drafted decoding (drafted(batch): the model, its tree setting and the tree's name for the report)
    over the same prompts at each batch size, compilation excluded, interleaved batch by batch."""
    plain = ShardedModel(loaded.base, None)
    rows = []
    for batch in config.batch_sizes:
        model, tree, tree_name = drafted(batch)
        runs = interleaved({"plain": (plain, _settings(loaded, config, batch)),
                            "medusa": (model, _settings(loaded, config, batch, tree))}, prompts, batch)
        p, m = runs["plain"], runs["medusa"]
        rows.append({"batch": batch, "plain_tokens_per_s": p["tokens_per_s"], "medusa_tokens_per_s": m["tokens_per_s"],
                     "speedup": m["tokens_per_s"] / p["tokens_per_s"], "tokens_per_step": m["new"] / max(m["steps"], 1),
                     "tree": m["choice"].note if m["choice"] is not None else tree_name,
                     "mismatches": sum(a != b for a, b in zip(m["tokens"], p["tokens"]))})
    return rows


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """--heads LABEL=FOLDER, repeated -> {label: folder or drafts}."""
    labels = {}
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise ValueError(f"--heads {item!r}: expected LABEL=FOLDER")
        if label in labels:
            raise ValueError(f"--heads: label {label!r} given twice")
        labels[label] = folder
    return labels


def is_drafts(name: str) -> bool:
    """Whether a `--heads LABEL=NAME` names training-free drafters or a mix rather than a heads folder."""
    return name in training_free_kinds() or "+" in name


def drafts_model(loaded: LoadedModel, name: str, budget: int, batch: int, heads_of) -> tuple[ShardedModel, object]:
    """(the model, its tree setting) of drafts `name` within `budget` nodes: `recycle` alone its largest template
    within the budget, anything else the mix (`mixed_decoding.build_mix`, step costs at `batch`)."""
    if name == "recycle":
        drafter = recycle_drafter(loaded.base)
        return ShardedModel(loaded.base, drafter), template_tree(template_within(budget), drafter.config.top_k)
    untrained, trained = parse_mix(name)
    mix, sizes = build_mix(loaded.base, untrained, heads_of(trained) if trained else None, budget, batch=batch)
    return ShardedModel(loaded.base, mix), sizes


def compare_drafts(loaded: LoadedModel, name: str, prompts, reference, config: CompareConfig, heads_of,
                   progress: Callable[[str], None] = print) -> dict:
    """A row of the table for training-free drafts `name`: tokens/step and mismatches within each node budget of
    `tree_sizes`, timed against plain within the default budget; no held-out accuracy."""
    counted = []
    for nodes in config.tree_sizes:
        model, tree = drafts_model(loaded, name, nodes, min(config.count_batch, len(prompts)), heads_of)
        counted.append({"nodes": nodes, "tree": tree.name, **_counted(loaded, model, prompts, reference, config, tree)})
    progress("tokens/step " + ", ".join(f"{r['nodes']} nodes {r['tokens_per_step']:.2f}" for r in counted))
    budget = int(DEFAULT_TEMPLATE.split("_")[1]) if name == "recycle" else DEFAULT_BUDGET

    def drafted(batch: int):
        model, tree = drafts_model(loaded, name, budget, batch, heads_of)
        return model, tree, tree.name

    timed = time_against_plain(loaded, prompts, config, drafted) if config.batch_sizes else []
    for r in timed:
        progress(f"batch {r['batch']} speedup x{r['speedup']:.2f} ({r['tree']})")
    origin = "+".join(portable_path(part) if Path(part).exists() else part for part in name.split("+"))
    return {"origin": origin, "head_type": "training-free" if "+" not in name else "mix", "num_heads": 0,
            "heldout_top1": [], "heldout_top5": [], "positions_per_head": [], "tree_sizes": counted, "chains": [],
            "dynamic": [], "timed": timed}


def compare(loaded: LoadedModel, heads_by_label: dict[str, tuple[MedusaHeads, str]], prompts: Sequence[Sequence[int]],
            config: CompareConfig, progress: Callable[[str], None] = print,
            drafts_by_label: dict[str, str] | None = None, heads_of: Callable[[str], MedusaHeads] | None = None
            ) -> dict:
    """Runs the comparison. heads_by_label: label -> (heads, where they came from, for the report);
    drafts_by_label: label -> a training-free drafter or mix (`bench.drafts_comparison`), whose trained part
    heads_of(location) loads."""
    source, text = "none (no trained heads compared)", None
    if heads_by_label:
        held = BuildTreeConfig(data=config.data, heldout=config.heldout,
                               continuation_tokens=config.continuation_tokens)
        held_prompts, source = heldout_prompts(loaded, held)
        progress(f"held-out text: greedy continuations of {len(held_prompts)} prompts ({source})")
        text = head_accuracy.self_distill(loaded.base, held_prompts, max_new_tokens=config.continuation_tokens,
                                          eos_ids=loaded.eos_ids, pad_id=loaded.pad_id)
    reference = _tokens(generate_batch(ShardedModel(loaded.base, None), prompts,
                                       _settings(loaded, config, min(config.count_batch, len(prompts))),
                                       progress=False))
    results = {"heldout": source, "questions": len(prompts), "config": dataclasses.asdict(config), "heads": {}}
    for label, name in (drafts_by_label or {}).items():
        results["heads"][label] = compare_drafts(loaded, name, prompts, reference, config, heads_of,
                                                 lambda line, label=label: progress(f"{label}: {line}"))
    for label, (heads, origin) in heads_by_label.items():
        acc = head_accuracy.measure_head_accuracy(loaded.base, heads, *text,
                                                  top_k=min(config.top_k, heads.config.head_vocab_size))
        top5 = acc.topk_cumulative()[:, min(4, acc.accuracy_mr.shape[1] - 1)]
        progress(f"{label}: held-out top-1 " + ", ".join(f"{a:.3f}" for a in acc.top1_m))
        counted = count_tokens_per_step(loaded, heads, acc.accuracy_mr, prompts, reference, config)
        progress(f"{label}: tokens/step " + ", ".join(f"{r['nodes']} nodes {r['tokens_per_step']:.2f}"
                                                      for r in counted))
        chains = count_chain_tokens_per_step(loaded, heads, prompts, reference, config)
        if chains:
            progress(f"{label}: chains " + ", ".join(f"{r['chain']} {r['tokens_per_step']:.2f}" for r in chains))
        dynamic = count_dynamic(loaded, heads, acc.accuracy_mr, prompts, reference, config, counted, progress)
        timed = time_speedup(loaded, heads, acc.accuracy_mr, prompts, config) if config.batch_sizes else []
        for r in timed:
            progress(f"{label}: batch {r['batch']} speedup x{r['speedup']:.2f} ({r['tree']})")
        results["heads"][label] = {
            "origin": origin, "head_type": type(heads).__name__, "num_heads": heads.config.num_heads,
            "heldout_top1": acc.top1_m.tolist(), "heldout_top5": top5.tolist(),
            "positions_per_head": acc.positions_m.tolist(), "tree_sizes": counted, "chains": chains,
            "dynamic": dynamic, "timed": timed}
    return results


def markdown(results: dict, command: str, machine: str) -> str:
    heads = results["heads"]
    sizes = sorted({r["nodes"] for h in heads.values() for r in h["tree_sizes"]})
    chains = sorted({r["chain"] for h in heads.values() for r in h.get("chains", [])})
    batches = sorted({r["batch"] for h in heads.values() for r in h["timed"]})
    lines = [f"Command: `{command}`", machine,
             f"{results['questions']} MT-Bench first turns, greedy, at most {results['config']['max_new_tokens']} "
             f"new tokens; held-out accuracy on {results['heldout']}.", ""]
    header = " | ".join(["heads", "held-out top-1 per head (depth)", "top-5 per head"]
                        + [f"tokens/step @{n}" for n in sizes] + [f"chain of {c}" for c in chains]
                        + [f"speedup b{b}" for b in batches] + ["mismatches"])
    rows = []
    for label, h in heads.items():
        tps = {r["nodes"]: r["tokens_per_step"] for r in h["tree_sizes"]}
        chain = {r["chain"]: r["tokens_per_step"] for r in h.get("chains", [])}
        spd = {r["batch"]: r["speedup"] for r in h["timed"]}
        bad = sum(r["mismatches"] for key in ("tree_sizes", "chains", "timed", "dynamic") for r in h.get(key, []))
        rows.append([label, " / ".join(f"{a:.2f}" for a in h["heldout_top1"]) or "-",
                     " / ".join(f"{a:.2f}" for a in h["heldout_top5"]) or "-"]
                    + [f"{tps[n]:.2f}" if n in tps else "-" for n in sizes]
                    + [f"{chain[c]:.2f}" if c in chain else "-" for c in chains]
                    + [f"{spd[b]:.2f}x" if b in spd else "-" for b in batches] + [bad])
    lines += table(header, rows) + dynamic_markdown(results)
    if not batches:
        return "\n".join(lines + ["", "(untimed run: --batch-sizes '')"]) + "\n"
    lines += ["", "Timed runs (compilation excluded; plain and Medusa interleaved batch by batch):", "",
              *table("heads | batch | plain tok/s | Medusa tok/s | speedup | tokens/step | tree",
                     ([label, r["batch"], f"{r['plain_tokens_per_s']:.1f}", f"{r['medusa_tokens_per_s']:.1f}",
                       f"{r['speedup']:.2f}x", f"{r['tokens_per_step']:.2f}", r["tree"]]
                      for label, h in heads.items() for r in h["timed"]))]
    return "\n".join(lines) + "\n"


def dynamic_markdown(results: dict) -> list[str]:
    """The dynamic-tree table (none when no dynamic tree was counted): per heads and node budget N, the best
    static tree's tokens/step and each dynamic tree's."""
    rows = [(label, r) for label, h in results["heads"].items() for r in h.get("dynamic", [])]
    if not rows:
        return []
    return ["", "Dynamic trees (EAGLE-2 style: K children of the K best frontier nodes per depth, D depths, the N "
                "best drafted nodes kept) against the greedy static tree of the same N nodes, tokens/step:", "",
            *table("heads | N | dynamic tree | static tokens/step | dynamic tokens/step | dynamic / static | "
                   "mismatches",
                   ([label, r["nodes"], r["tree"], f"{r['static_tokens_per_step']:.3f}",
                     f"{r['tokens_per_step']:.3f}", f"{r['ratio_to_static']:.3f}x", r["mismatches"]]
                    for label, r in rows))]


def plot(results: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, h in results["heads"].items():
        rows = h["tree_sizes"]
        ax.plot([r["nodes"] for r in rows], [r["tokens_per_step"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tree nodes (root excluded)", ylabel="tokens per step (MT-Bench, greedy)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    return path


def write(results: dict, out: str | Path, command: str, machine: dict) -> Path:
    """OUT/heads.json, heads.md and heads.png; returns the markdown file."""
    files = write_files(out, {"heads.json": json.dumps({"command": command, "machine": machine, **results},
                                                       indent=1, default=float),
                              "heads.md": markdown(results, command, machine_line(machine))})
    plot(results, Path(out) / "heads.png")
    return files["heads.md"]
