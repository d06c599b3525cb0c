"""Size-choice rules of the mixed drafts (`inference.size_choice`) evaluated offline, before any timing: record once
what the drafters propose on real prompts (`bench.size_choice_records`, the `record` command), then replay rules
against the recorded proposals with measured step costs.

Replay (`replay`): a rule walks the answer from the first position: it skips (a plain step of the mixed loop, cost
`skip_cost`) or verifies one size (cost `costs[size]`, `1 + accepted` tokens), and learns from the outcome; the
speed against plain decoding is tokens / cost (plain: one token per unit). `replay_batch` (`--batch`) walks the
answers of rows decoded together: one choice per step for all, the batch as slow as its last row. The rules are
numpy mirrors of `size_choice`: the rules before 2026-12-06 (`BackoffRule`: the step's predictions, with or without
the run's correction, and a backoff after each drafted step that did not pay), the one shipped on 2026-12-06
(`RunningMeanRule`: each size's running estimate, the step's prediction a prior) and the shipped one (`RatioRule`:
the step's prediction scaled by each size's ratio of accepted to predicted tokens), so their states follow the same
arithmetic as on device. Two references no decoder can run sit beside them at one row: `FittedReference` (each
answer's own best calibration of the predictions) and `Oracle` (the outcomes known). Record sets: MT-Bench first
turns, the input-grounded set or HumanEval (`--set`).
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np

from medusa_jax.bench.bench_inputs import PROMPT_SETS, prompt_texts
from medusa_jax.bench.size_choice_records import Position, load, positions, record

OLD_PRIOR, OLD_DECAY = 1.0, 0.9  # the correction's prior and decay in the rule shipped until 2026-12-06


class BackoffRule:
    """numpy mirror of the size rule shipped until 2026-12-06, with its correction off (`prior` None: the first
    rule), run-wide (one ratio of the realised and predicted sums for all sizes, as it shipped) or, with
    `per_size`, one ratio per size (each from the steps of that size: a variant never shipped)."""

    def __init__(self, sizes, costs, prior=None, decay=OLD_DECAY, max_skip=None, per_size=False):
        from medusa_jax.inference import size_choice
        self.sizes, self.costs = np.asarray(sizes), np.asarray(costs)
        self.max_skip = size_choice.MAX_SKIP if max_skip is None else max_skip
        self.prior = prior
        self.decay = decay
        self.per_size = per_size
        self.skip_left, self.misses = 0, 0
        self.realised, self.predicted = np.zeros(len(self.sizes)), np.zeros(len(self.sizes))

    def correction(self):
        if self.prior is None:
            return 1.0
        if not self.per_size:
            return (self.realised.sum() + self.prior) / (self.predicted.sum() + self.prior)
        return (self.realised + self.prior) / (self.predicted + self.prior)

    def decide(self, p: Position):
        """None: skip the drafting; else the size index verified."""
        lookup_pays = bool(np.any((self.sizes > 0) & ((1 + p.lookup_k) / self.costs > 1)))
        if self.skip_left > 0 and not lookup_pays:
            self.skip_left -= 1
            return None
        return int(np.argmax((1 + self.correction() * p.accepts_k) / self.costs))

    def learn(self, choice, predicted, accepted, accepted_k=None):
        pays = choice > 0 and 1 + accepted >= self.costs[choice]
        self.misses = 0 if pays else self.misses + 1
        self.skip_left = 0 if pays else min(1 << min(max(self.misses - 1, 0), 8), self.max_skip)
        if choice > 0:
            learns = np.arange(len(self.sizes)) == choice if self.per_size else np.ones(len(self.sizes), bool)
            self.realised = np.where(learns, self.decay * self.realised, self.realised)
            self.predicted = np.where(learns, self.decay * self.predicted, self.predicted)
            self.realised[choice] += accepted
            self.predicted[choice] += predicted


class RunningMeanRule(BackoffRule):
    """numpy mirror of the rule shipped on 2026-12-06 before `RatioRule`: each size's running estimate of its
    accepted tokens (every size up to the verified one learns), the step's corrected prediction a prior of 3 steps,
    lookup's chains a floor (`lookup`: "floor"; variants never shipped: "none", "corrected" by the run-wide ratio,
    "own": scaled by what the steps whose size lookup's floor chose accepted of it), and a backoff while the best
    size's estimate (break-even prior) loses."""

    def __init__(self, sizes, costs, max_skip=None, lookup="floor"):
        from medusa_jax.inference import size_choice
        super().__init__(sizes, costs, max_skip=max_skip, decay=size_choice.DECAY)
        self.prior = size_choice.PRIOR
        self.seen, self.accepted = np.zeros(len(self.sizes)), np.zeros(len(self.sizes))
        self.realised_sum, self.predicted_sum = 0.0, 0.0
        self.lookup = lookup
        self.lookup_realised, self.lookup_predicted, self.binding = 0.0, 0.0, None

    def estimates(self, prior_k):
        return (self.accepted + self.prior * prior_k) / (self.seen + self.prior)

    def skips(self, p: Position) -> bool:
        """Whether this step skips the drafting (the backoff, unless lookup's chains alone promise a paying step)."""
        lookup_pays = bool(np.any((self.sizes > 0) & ((1 + p.lookup_k) / self.costs > 1)))
        if self.skip_left > 0 and not lookup_pays:
            self.skip_left -= 1
            return True
        return False

    def decide(self, p: Position):
        if self.skips(p):
            return None
        correction = (self.realised_sum + self.prior) / (self.predicted_sum + self.prior)
        estimate_k = self.estimates(correction * p.accepts_k)
        floor_k = {"floor": p.lookup_k, "none": 0 * p.lookup_k, "corrected": correction * p.lookup_k,
                   "own": p.lookup_k * (self.lookup_realised + self.prior) / (self.lookup_predicted + self.prior)
                   }[self.lookup]
        choice = int(np.argmax(np.where(self.sizes > 0, (1 + np.maximum(estimate_k, floor_k)) / self.costs, -np.inf)))
        self.binding = float(p.lookup_k[choice]) if floor_k[choice] > estimate_k[choice] else None
        return choice

    def learn(self, choice, predicted, accepted, accepted_k=None):
        verified = self.sizes[choice] > 0
        if verified:
            shown_k = np.arange(len(self.sizes)) <= choice
            self.seen = self.decay * self.seen + shown_k
            self.accepted = self.decay * self.accepted + np.where(shown_k, accepted_k, 0.0)
            self.realised_sum = self.decay * self.realised_sum + accepted
            self.predicted_sum = self.decay * self.predicted_sum + predicted
            if self.binding is not None:  # lookup's floor chose the size: how far its prediction held
                self.lookup_realised = self.decay * self.lookup_realised + accepted
                self.lookup_predicted = self.decay * self.lookup_predicted + self.binding
        gain_k = (1 + self.estimates(self.costs - 1)) / self.costs
        pays = verified and bool(np.max(np.where((self.sizes > 0) & (self.seen >= 1), gain_k, 0.0)) >= 1)
        self.misses = 0 if pays else self.misses + 1
        self.skip_left = 0 if pays else min(1 << min(max(self.misses - 1, 0), 8), self.max_skip)


class RatioRule(RunningMeanRule):
    """numpy mirror of the shipped `size_choice.SizeChoiceState`: the step's prediction for each size scaled by
    that size's ratio of accepted to predicted tokens over the steps that showed it (prior: the run-wide ratio worth
    `RATIO_PRIOR` predicted tokens), lookup's chains a floor; the backoff as `RunningMeanRule`'s."""

    def __init__(self, sizes, costs, max_skip=None):
        from medusa_jax.inference import size_choice
        super().__init__(sizes, costs, max_skip=max_skip)
        self.ratio_prior = size_choice.RATIO_PRIOR
        self.predicted = np.zeros(len(self.sizes))
        self.step_k = None

    def decide(self, p: Position):
        if self.skips(p):
            return None
        estimate_k = np.maximum(self.ratios() * p.accepts_k, p.lookup_k)
        self.step_k = p.accepts_k
        return int(np.argmax(np.where(self.sizes > 0, (1 + estimate_k) / self.costs, -np.inf)))

    def ratios(self) -> np.ndarray:
        correction = (self.realised_sum + self.ratio_prior) / (self.predicted_sum + self.ratio_prior)
        return (self.accepted + self.ratio_prior * correction) / (self.predicted + self.ratio_prior)

    def learn(self, choice, predicted, accepted, accepted_k=None):
        if self.sizes[choice] > 0:
            shown_k = np.arange(len(self.sizes)) <= choice
            self.predicted = self.decay * self.predicted + np.where(shown_k, self.step_k, 0.0)
        super().learn(choice, predicted, accepted, accepted_k)


class FixedSize(BackoffRule):
    """Every step drafts and verifies the size of index `index` (no choice, no backoff)."""

    def __init__(self, sizes, costs, index):
        super().__init__(sizes, costs)
        self.index = index % len(self.sizes)

    def decide(self, p: Position):
        return self.index


class Oracle(BackoffRule):
    """Knows each size's accepted tokens: the best size, or skipping where no size beats a skipped step."""

    def __init__(self, sizes, costs, skip_cost):
        super().__init__(sizes, costs)
        self.skip_cost = skip_cost

    def decide(self, p: Position):
        gain_k = (1 + p.true_k) / self.costs
        return int(np.argmax(gain_k)) if gain_k.max() > 1 / self.skip_cost else None


class FittedReference(BackoffRule):
    """A reference, not a rule a decoder can run: it knows from the first step this answer's own least-squares fit
    of each size's accepted tokens on the step's two predictions (the drafters' and prompt lookup's chains', with
    an intercept), made over every position of the answer (`fit`, called by `replay`), and at each step verifies
    the size with the most fitted (1 + accepted) / cost, or skips where none beats a skipped step. So it is what a
    rule reading these predictions could make with a perfect calibration per answer: where it stays near plain, the
    predictions carry no paying steps that a better calibration could find (the oracle, knowing the outcomes,
    bounds every rule)."""

    def __init__(self, sizes, costs, skip_cost):
        super().__init__(sizes, costs)
        self.skip_cost = skip_cost
        self.coef_k3 = None

    def fit(self, steps: list[Position]) -> None:
        accepts, lookup, true = (np.asarray([getattr(p, f) for p in steps]) for f in ("accepts_k", "lookup_k",
                                                                                    "true_k"))
        self.coef_k3 = np.stack([np.linalg.lstsq(np.stack([np.ones(len(steps)), accepts[:, k], lookup[:, k]], 1),
                                                 true[:, k], rcond=None)[0] for k in range(len(self.sizes))])

    def decide(self, p: Position):
        fitted_k = np.maximum(self.coef_k3[:, 0] + self.coef_k3[:, 1] * p.accepts_k + self.coef_k3[:, 2] * p.lookup_k,
                              0.0)
        gain_k = np.where(self.sizes > 0, (1 + fitted_k) / self.costs, -np.inf)
        return int(np.argmax(gain_k)) if gain_k.max() > 1 / self.skip_cost else None


def replay(steps: list[Position], rule, costs, skip_cost: float) -> dict:
    """Walks one answer (module docstring): {tokens, cost, speedup, drafted, skipped, accepted}; a rule with a `fit`
    (`FittedReference`) first sees the whole answer."""
    if hasattr(rule, "fit"):
        rule.fit(steps)
    pos, cost, drafted, skipped, accepted = 0, 0.0, 0, 0, 0.0
    while pos < len(steps):
        p = steps[pos]
        choice = rule.decide(p)
        if choice is None:
            cost += skip_cost
            skipped += 1
            pos += 1
            continue
        got = float(p.true_k[choice])
        got = min(got, len(steps) - pos - 1)
        rule.learn(choice, float(p.accepts_k[choice]), got, np.minimum(p.true_k, len(steps) - pos - 1))
        cost += costs[choice]
        drafted += 1
        accepted += got
        pos += 1 + int(got)
    return {"tokens": len(steps), "cost": cost, "speedup": len(steps) / cost, "drafted": drafted,
            "skipped": skipped, "accepted_per_drafted": accepted / max(drafted, 1)}


ROW_WEIGHTS = ("mean", "left")


def row_weights(kind: str, active_b: np.ndarray, out_b: np.ndarray, capacity: int) -> np.ndarray:
    """How much each row's tokens count in a batch step's choice (summing to 1 over the active rows): "mean" every
    active row alike (the rule until 2026-12-07, and the shipped rule's where rows are refilled); "left" the active
    rows with the most tokens left (capacity - out; the shipped rule's `SizeChoiceState.counted_rows` for rows that
    end together): in a batch that ends when its last row does, only the tokens of the row that finishes last
    shorten it. (A variant that ranked the rows by their steps left at their own pace so far, never shipped, made
    the same choices as "left" on every record set.)"""
    if kind == "mean":
        w_b = active_b.astype(float)
    else:
        left_b = np.where(active_b, capacity - out_b, -np.inf)
        w_b = (left_b == left_b.max()).astype(float) * active_b
    return w_b / max(w_b.sum(), 1e-12)


def replay_batch(rows: list[list[Position]], rule, costs, skip_cost: float, weights: str = "left",
                 capacity: int = 128) -> dict:
    """`replay` for a batch of rows decoded together (one size per step for all of them, the batch done when its
    last row is): each step's position is the weighted mean of the active rows' (`row_weights`), the rule learns
    the weighted means of what they predicted and accepted, every active row advances by its own accepted tokens.
    Plain decoding takes as many steps as the longest row: the speedup is that over the cost."""
    b = len(rows)
    len_b = np.asarray([len(r) for r in rows])
    pos_b, steps_b = np.zeros(b, int), np.zeros(b, int)
    cost, drafted, skipped = 0.0, 0, 0
    while np.any(pos_b < len_b):
        active_b = pos_b < len_b
        w_b = row_weights(weights, active_b, pos_b, capacity)
        here = [rows[i][pos_b[i]] if active_b[i] else None for i in range(b)]
        mean = lambda field: sum(w_b[i] * getattr(here[i], field) for i in range(b) if active_b[i])
        choice = rule.decide(Position(mean("accepts_k"), mean("lookup_k"), mean("true_k")))
        steps_b += active_b
        if choice is None:
            cost += skip_cost
            skipped += 1
            pos_b += active_b
            continue
        left_b = len_b - pos_b - 1
        got_b = np.asarray([min(here[i].true_k[choice], left_b[i]) if active_b[i] else 0.0 for i in range(b)])
        got_k = sum(w_b[i] * np.minimum(here[i].true_k, left_b[i]) for i in range(b) if active_b[i])
        rule.learn(choice, float(mean("accepts_k")[choice]), float(w_b @ got_b), got_k)
        cost += costs[choice]
        drafted += 1
        pos_b += np.where(active_b, 1 + got_b.astype(int), 0)
    return {"tokens": int(len_b.sum()), "cost": cost, "speedup": int(len_b.max()) / cost, "drafted": drafted,
            "skipped": skipped, "tokens_per_step": float(len_b.sum() / steps_b.sum())}


def evaluate_batch(records: list[dict], rule_of, sizes, costs, skip_cost, batch: int, weights: str = "left") -> dict:
    """`replay_batch` over the records in batches of `batch` (in order); mean: the plain steps over the cost."""
    groups = [records[i: i + batch] for i in range(0, len(records), batch)]
    per = [replay_batch([positions(r, sizes) for r in g], rule_of(), costs, skip_cost, weights) for g in groups]
    plain = sum(max(len(r["answer"]) for r in g) for g in groups)
    return {"mean": plain / sum(r["cost"] for r in per), "worst": min(r["speedup"] for r in per), "per_prompt": per}


def evaluate(records: list[dict], rule_of, sizes, costs, skip_cost) -> dict:
    per = [replay(positions(r, sizes), rule_of(), costs, skip_cost) for r in records]
    total = sum(r["tokens"] for r in per) / sum(r["cost"] for r in per)
    return {"mean": total, "worst": min(r["speedup"] for r in per), "per_prompt": per}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("record", "replay"))
    p.add_argument("records", help="the JSON-lines file record writes and replay reads")
    p.add_argument("--questions", type=int, default=8, help="record: the set's first prompts (mtbench: 1-80, grounded: 1-16, humaneval: 1-164)")
    p.add_argument("--set", default="mtbench", choices=PROMPT_SETS, dest="prompt_set",
                   help="record: the prompts (default: %(default)s first turns)")
    p.add_argument("--budget", type=int, default=4, choices=(4, 16, 64),
                   help="record: the mix's node budget (default: %(default)s: sizes 0, 1, 4)")
    p.add_argument("--costs", default="1.13,1.48,1.62",
                   help="replay: the draft sizes' step costs in plain steps (default: %(default)s)")
    p.add_argument("--skip-cost", type=float, default=1.06, help="replay: a skipped step's cost (default: 1.06)")
    p.add_argument("--batch", type=int, default=1,
                   help="replay: rows decoded together, the records in turn (default: %(default)s; > 1: "
                        "`replay_batch`; the shipped rule also counting every active row)")
    a = p.parse_args(argv)
    if a.command == "record":
        available = len(prompt_texts(a.prompt_set, 10_000))
        if not 1 <= a.questions <= available:
            p.error(f"--questions {a.questions}: the {a.prompt_set} set has {available} prompts; give 1-{available}")
        if os.path.exists(a.records):
            p.error(f"{a.records} exists: record writes a new file; remove it or name another")
        if not os.path.isdir(os.path.dirname(a.records) or "."):
            p.error(f"{a.records}: its folder does not exist")
        from pathlib import Path

        from medusa_jax.demo_model import default_model_dir
        if Path(a.records).resolve().is_relative_to(default_model_dir().resolve()):
            p.error(f"{a.records} is inside the model folder {default_model_dir()}: choose a path outside it")
        record(a.records, questions=a.questions, budget=a.budget, prompt_set=a.prompt_set)
        return 0
    if not a.skip_cost > 0 or a.skip_cost == float("inf"):
        p.error(f"--skip-cost {a.skip_cost}: give a skipped step's cost in plain steps, a number > 0 (e.g. 1.06)")
    if a.batch < 1:
        p.error(f"--batch {a.batch}: give the rows decoded together, a whole number >= 1")
    if not os.path.isfile(a.records):
        p.error(f"{a.records}: no such records file (make one with: record {a.records})")
    records = load(a.records)
    sizes = records[0]["sizes"]
    try:
        costs = [float(c) for c in a.costs.split(",")]
    except ValueError:
        p.error(f"--costs {a.costs}: give numbers joined by commas, one per draft size {sizes}")
    if len(costs) != len(sizes) or not all(0 < c < float("inf") for c in costs):
        p.error(f"--costs {a.costs}: one finite cost > 0 per draft size {sizes}")
    rules = {"backoff (no correction)": lambda: BackoffRule(sizes, costs),
             "backoff + correction (until 2026-12-06)": lambda: BackoffRule(sizes, costs, prior=OLD_PRIOR),
             "backoff + per-size correction": lambda: BackoffRule(sizes, costs, prior=OLD_PRIOR, per_size=True),
             "running estimate per size (2026-12-06)": lambda: RunningMeanRule(sizes, costs),
             "running estimate, no lookup floor": lambda: RunningMeanRule(sizes, costs, lookup="none"),
             "running estimate, floor x correction": lambda: RunningMeanRule(sizes, costs, lookup="corrected"),
             "running estimate, floor x its own ratio": lambda: RunningMeanRule(sizes, costs, lookup="own"),
             "prediction x ratio per size (shipped)": lambda: RatioRule(sizes, costs),
             **{f"every step {sizes[i]} nodes": partial(FixedSize, sizes, costs, i) for i in (-2, -1) if sizes[i] > 0},
             "fitted per answer (reference)": lambda: FittedReference(sizes, costs, a.skip_cost),
             "oracle": lambda: Oracle(sizes, costs, a.skip_cost)}
    if a.batch > 1:  # a step's oracle is not the batch's: each row's best size differs (nor is one answer's fit)
        del rules["oracle"], rules["fitted per answer (reference)"]
        rules["prediction x ratio per size, every active row counted (until 2026-12-07)"] = \
            lambda: RatioRule(sizes, costs)
    unit = "prompt" if a.batch == 1 else "batch"
    print(f"| rule | speedup | worst {unit} | per {unit} |\n|---|---|---|---|")
    for name, rule_of in rules.items():
        weights = "mean" if "every active row" in name else "left"
        result = evaluate(records, rule_of, sizes, costs, a.skip_cost) if a.batch == 1 else \
            evaluate_batch(records, rule_of, sizes, costs, a.skip_cost, a.batch, weights)
        per_prompt = " ".join(f"{r['speedup']:.2f}" for r in result["per_prompt"])
        print(f"| {name} | {result['mean']:.3f} | {result['worst']:.3f} | {per_prompt} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
