"""Load and soak runs against a running medusa-serve on this machine (scripts/benchmark_serve.py), over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from urllib.parse import urlparse

import httpx
import numpy as np

PROMPTS = ["Write a haiku about the sea.", "Explain what a hash table is.", "Give three tips for better sleep.",
           "What is the capital of France, and why is it famous?", "Describe a cat to someone who never saw one.",
           "List five fruits and their colours.", "How do airplanes stay in the air?", "Tell a short joke.",
           "Summarise the plot of Romeo and Juliet.", "Why is the sky blue?", "Write a limerick about a robot.",
           "What are prime numbers?", "Suggest a name for a bakery.", "How does a rainbow form?",
           "Give a recipe for pancakes.", "What is machine learning?"]
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class ServeLoadConfig:
    url: str = "http://127.0.0.1:8000"
    concurrency: tuple[int, ...] = (1, 4, 16)  # concurrent clients of each load level
    requests_per_client: int = 2  # requests each client sends in a load level
    max_tokens: int = 64  # of each request
    soak_seconds: float = 0.0  # > 0: the soak mix this long instead of the load levels
    timeout: float = 600.0  # seconds one request may take at most

    def __post_init__(self):
        if urlparse(self.url).hostname not in LOOPBACK or urlparse(self.url).scheme != "http":
            raise ValueError(f"--url {self.url}: give http://127.0.0.1:PORT (this benchmark loads servers on this "
                             f"machine only)")


async def chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, stream: bool = True,
               cancel_after_first: bool = False) -> dict:
    """One chat request; returns its timings, token count, status and the number of finish chunks seen."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    first = last = None
    tokens = finishes = 0
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            answer = response.json()
            tokens, finishes = answer["usage"]["completion_tokens"], len(answer["choices"])
        return {"status": response.status_code, "tokens": tokens, "finishes": finishes, "ttft": None,
                "per_token": None, "seconds": time.perf_counter() - start}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "tokens": 0, "finishes": 0}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    if cancel_after_first:
                        return {"status": "cancelled", "tokens": 0, "finishes": 0}
                finishes += choice.get("finish_reason") is not None
    ttft = None if first is None else first - start
    per_token = None if first is None or tokens < 2 else (last - first) / (tokens - 1)
    return {"status": 200, "tokens": tokens, "finishes": finishes, "ttft": ttft, "per_token": per_token,
            "seconds": time.perf_counter() - start}


def percentiles(values: list) -> dict:
    values = [v for v in values if v is not None]
    return {f"p{q}": round(float(np.percentile(values, q)), 4) if values else None for q in (50, 95)}


async def load_level(a: ServeLoadConfig, model: str, clients: int) -> dict:
    async with httpx.AsyncClient(base_url=a.url, timeout=a.timeout) as client:
        async def one_client(c):
            return [await chat(client, model, PROMPTS[(c * a.requests_per_client + r) % len(PROMPTS)], a.max_tokens)
                    for r in range(a.requests_per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(c) for c in range(clients))) for r in rs]
        seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "failed": sum(r["status"] != 200 for r in results),
            "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "ttft_s": percentiles([r["ttft"] for r in results]),
            "per_token_s": percentiles([r["per_token"] for r in results])}


async def resident_bytes(client: httpx.AsyncClient) -> float | None:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    return None


BAD_BODIES = [{"messages": []}, {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, {"model": "no-such-model"}]


MEMORY_EVERY_S = 60.0


async def soak(a: ServeLoadConfig, model: str) -> dict:
    clients, deadline = max(a.concurrency), time.monotonic() + a.soak_seconds
    counts = {"good": 0, "answered_once": 0, "bad": 0, "bad_4xx": 0, "cancelled": 0, "server_errors": 0,
              "other_failures": 0}
    async with httpx.AsyncClient(base_url=a.url, timeout=a.timeout) as client:
        memory_start = await resident_bytes(client)

        async def one_client(c):
            rng = random.Random(c)
            while time.monotonic() < deadline:
                kind = rng.choice(["stream", "stream", "whole", "cancel", "bad"])
                prompt = rng.choice(PROMPTS)
                if kind == "bad":
                    body = {"model": model, **rng.choice(BAD_BODIES)}
                    response = await client.post("/v1/chat/completions", json=body)
                    counts["bad"] += 1
                    counts["bad_4xx"] += 400 <= response.status_code < 500 and "error" in response.json()
                    counts["server_errors"] += response.status_code >= 500
                    continue
                result = await chat(client, model, prompt, rng.randint(1, a.max_tokens), kind != "whole",
                                    cancel_after_first=kind == "cancel")
                if result["status"] == "cancelled":
                    counts["cancelled"] += 1
                    continue
                counts["good"] += 1
                counts["answered_once"] += result["status"] == 200 and result["finishes"] == 1
                counts["server_errors"] += isinstance(result["status"], int) and result["status"] >= 500
                counts["other_failures"] += result["status"] != 200 and result["status"] < 500

        async def sample_memory():  # resident memory once a minute: growth over time, not just two points
            while time.monotonic() < deadline:
                await asyncio.sleep(min(MEMORY_EVERY_S, max(0.0, deadline - time.monotonic())))
                samples.append(await resident_bytes(client))

        samples: list[int | None] = []
        await asyncio.gather(sample_memory(), *(one_client(c) for c in range(clients)))
        await asyncio.sleep(2)
        health = (await client.get("/health")).json()
        memory_end = await resident_bytes(client)
    return {"clients": clients, "seconds": a.soak_seconds, **counts, "rows_busy_after": health["rows_busy"],
            "resident_mib_start": memory_start and round(memory_start / 2**20, 1),
            "resident_mib_end": memory_end and round(memory_end / 2**20, 1),
            "resident_mib_each_minute": [m and round(m / 2**20, 1) for m in samples]}


async def run(a: ServeLoadConfig) -> dict:
    """The soak (a.soak_seconds > 0) or the load levels, after one warm-up request."""
    async with httpx.AsyncClient(base_url=a.url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await chat(client, model, PROMPTS[0], 4)  # warm-up: the first admission shape compiles
    if a.soak_seconds:
        return {"model": model, "soak": await soak(a, model)}
    levels = [await load_level(a, model, c) for c in a.concurrency]
    for level in levels:
        level["speedup_vs_first"] = round(level["tokens_per_s"] / levels[0]["tokens_per_s"], 2)
    return {"model": model, "max_tokens": a.max_tokens, "requests_per_client": a.requests_per_client,
            "levels": levels}
