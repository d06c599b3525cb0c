"""Prompts whose replies are of uneven length, for the engine's two admission policies (refilled slots vs sorted
batches, `bench.admission_benchmark --prompt-set uneven`; results in bench/refill/uneven/README.md)."""

from __future__ import annotations

from medusa_jax.bench.bench_inputs import mtbench_questions

COUNTRIES = ("France", "Japan", "Peru", "Kenya", "Canada", "Egypt", "Norway", "Chile", "India", "Italy", "Ghana",
             "Spain", "Brazil", "Poland", "Greece", "Mexico")
SUBJECTS = ("a lighthouse keeper", "a lost robot", "a dragon who bakes", "two rival chefs", "a haunted library",
            "a fox and a crow", "a sailor in a storm", "a city under the sea")


def uneven_questions(n: int) -> list[str]:
    """n prompts cycling through four kinds, so a reply's length is not tied to its prompt's (sorted batches sort
    by prompt length): an MT-Bench first turn (long prompt, long reply), a one-word question (short prompt, short
    reply), a story request (short prompt, long reply), an arithmetic question (short prompt, short reply)."""
    mtbench = [q.first_turn for q in mtbench_questions((n + 3) // 4)]
    kinds = (lambda i: mtbench[i],
             lambda i: f"Name the capital of {COUNTRIES[i % len(COUNTRIES)]} in one word.",
             lambda i: f"Write a long, detailed story about {SUBJECTS[i % len(SUBJECTS)]}.",
             lambda i: f"What is {7 * i + 2} plus {3 * i + 5}? Reply with the number only.")
    return [kinds[k % 4](k // 4) for k in range(n)]
