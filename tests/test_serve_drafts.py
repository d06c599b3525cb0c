"""medusa-serve with the drafters the engine shares across requests (inference/row_drafts.py): `--heads recycle`
(one warm Token Recycling table for all rows) and a mix `--heads recycle+lookup` (a draft size per step), each in a
subprocess driven by the official `openai` client: greedy answers, whole and streamed, several at once, equal
`generate`'s; `--acceptance typical` serves sampled requests; the drafter flags' bad values are one error line."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from test_serve import (MODEL, decode_tokens, free_port, load_script, metrics, reference,  # noqa: F401
                        running_server, tiny_with_tokenizer)


@pytest.mark.parametrize("heads", ["recycle", "recycle+lookup"])
def test_serve_with_a_shared_drafter_answers_greedily_as_generate(tiny_with_tokenizer, reference, heads):  # noqa: F811
    tokenizer, greedy = reference
    args = ["--model", str(tiny_with_tokenizer), "--batch-size", "3", "--context", "64", "--chunk-steps", "3",
            "--heads", heads, "--acceptance", "typical"]
    with running_server(args, {"JAX_PLATFORMS": "cpu"}, wait=600) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = [f"w{i} w{2 * i} w{3 * i} w{i}" for i in (1, 4, 7, 9, 11)]
        wants = [decode_tokens(tokenizer, greedy(tokenizer(p)["input_ids"], 12)) for p in prompts]

        def ask(i):  # five requests through three rows: admitted into a running batch
            return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0)

        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(ask, range(5)))
        assert [a.choices[0].text for a in answers] == wants
        pieces = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in pieces) == wants[0]  # a warm table: still greedy's tokens
        sampled = [client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=8, temperature=0.8, seed=3)
                   for _ in range(2)]
        assert all(s.usage.completion_tokens >= 1 for s in sampled)
        with pytest.raises(openai.BadRequestError, match="top-p and top-k do not apply to typical"):
            client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=8, temperature=0.8, top_p=0.5)
        assert metrics(base)["medusa_accepted_tokens_per_step"] > 1  # drafts were accepted


def test_drafter_flags_are_one_error_line_before_loading(tiny_with_tokenizer, capsys):  # noqa: F811
    serve = load_script("serve")
    for args, words in ((["--acceptance", "typical"], "--acceptance typical: needs --heads"),
                        (["--heads", "recycle+lookup", "--tree", "mc_sim_7b_8"], "chooses its draft size per step"),
                        (["--heads", "recycle", "--tree", "dynamic:8"], "Token Recycling drafts a static template"),
                        (["--heads", "recycle", "--acceptance", "greedy"], "--acceptance")):
        with pytest.raises(SystemExit) as exit_:
            serve.main(["--model", str(tiny_with_tokenizer), "--port", str(free_port()), *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    # a mix's parts are checked where the model folder is (before anything loads)
    assert serve.main(["--model", str(tiny_with_tokenizer), "--port", str(free_port()), "--heads", "recycle+nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --heads recycle+nope: 'nope' is neither a drafter"), err
