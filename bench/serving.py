"""Online serving benchmark: Poisson arrivals against an OpenAI-compatible server.

By default it starts `tierserve api-server` on the default model and drives it; `--base-url`
drives any other OpenAI-compatible server (vLLM's, for one) with the same workload. The
workload is synthetic chat built with the default model's tokenizer (nothing downloaded):
prompts of about --input-len tokens, --output-len tokens each (ignore_eos), at each rate of
--rates (requests/s; `inf` sends them all at once). Each request streams; the bench records its
time to first token, the gaps between its chunks, its end-to-end time and its status: 200,
refused (503: the server's queue is full) or failed.

Reported per rate: request throughput, output tok/s, TTFT / TPOT / ITL at p50 and p99 (of
admitted requests), and goodput: requests per second that met the SLO (--slo-ttft-ms and
--slo-tpot-ms).

With --structured it also prints the structured-output line: output tok/s of --batch
requests at once constrained by a JSON schema against the same requests free (same prompts,
both greedy, tokens counted from usage), the grammar compile time cold and cached (on the
model's tokenizer, in this process), and the per-request cost of the API key and tenant checks
(a 100-key table with limits, in this process).

    python bench/serving.py [--json] [--rates 1,2,4,8,inf] [--base-url URL --model NAME]
    python bench/serving.py --structured --rates '' [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import print_table  # noqa: E402

_WORDS = ("the cache keeps every block of a prompt so that a later request with the same "
          "prefix skips its prefill while tensor parallel ranks share the heads of each layer "
          "and the scheduler spends one token budget on chunks and decodes alike").split()


def build_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[str]:
    """n distinct user messages of about input_len tokens each (random words)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [f"Request {i}:"]
        while len(tokenizer.encode(" ".join(words))) < input_len:
            words.append(rng.choice(_WORDS))
        prompts.append(" ".join(words))
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      output_len: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = {"status": None, "ttft": None, "itl": [], "e2e": None, "tokens": 0}
    try:
        async with client.stream("POST", url, json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return out
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out["ttft"] = now - t0
                else:
                    out["itl"].append(now - last)
                last = now
        out["e2e"] = time.perf_counter() - t0
    except httpx.HTTPError as e:
        out["status"] = f"error: {type(e).__name__}"
    return out


# A schema a model fills until max_tokens: a list of short strings, never closed early.
LIST_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 24}}}}


async def _batch(url: str, model: str, prompts: list[str], output_len: int,
                 extra: dict) -> tuple[int, float]:
    """All prompts at once (non-streaming, greedy): (completion tokens, seconds)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        async def one(prompt: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": output_len, "temperature": 0} | extra
            r = await client.post(url, json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - t0


def structured_line(url: str, model: str, prompts: list[str], output_len: int) -> dict:
    """Free and JSON-schema-constrained batches on the same prompts, alternated twice."""
    free, constrained = [], []
    schema = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "list", "schema": LIST_SCHEMA}}}
    for _ in range(2):
        tokens, seconds = asyncio.run(_batch(url, model, prompts, output_len,
                                             {"ignore_eos": True}))
        free.append(tokens / seconds)
        tokens, seconds = asyncio.run(_batch(url, model, prompts, output_len, schema))
        constrained.append(tokens / seconds)
    out = {"batch": len(prompts), "free_tok_s": round(max(free), 1),
           "structured_tok_s": round(max(constrained), 1)}
    out["structured_vs_free"] = round(out["structured_tok_s"] / out["free_tok_s"], 3)
    return out | grammar_compile_ms() | {"auth_overhead_us": auth_overhead_us()}


def grammar_compile_ms() -> dict:
    """Compiling a new JSON schema on the default model's tokenizer, and taking a cached one
    (the median of 20 of each; the tokenizer view is built once, before timing)."""
    from tierserve.runtime.tokenizer import tokenizer_json_file
    from tierserve.runtime import envs
    from tierserve.scheduler.output_rules import StructuredOutputs
    from tierserve.workers.model.loader import default_model_path
    from tierserve.workers.structured import GrammarMatchers
    from tierserve.runtime.tokenizer import load_model_tokenizer
    path = default_model_path()
    tok = load_model_tokenizer(path)
    matchers = GrammarMatchers(tokenizer_json_file(path, envs.cache_dir()), len(tok.hf),
                               [tok.eos_token_id])
    matchers.add("warm", StructuredOutputs(json=json.dumps(LIST_SCHEMA)))
    matchers.masks(["warm"])
    cold, cached = [], []
    for i in range(20):
        schema = dict(LIST_SCHEMA, title=f"schema {i}")
        spec = StructuredOutputs(json=json.dumps(schema))
        for times, rid in ((cold, f"cold{i}"), (cached, f"cached{i}")):
            t0 = time.perf_counter()
            matchers.add(rid, spec)
            matchers.masks([rid])
            times.append(time.perf_counter() - t0)
    ms = lambda xs: round(float(np.median(xs)) * 1000, 3)  # noqa: E731
    return {"grammar_compile_ms_cold": ms(cold), "grammar_compile_ms_cached": ms(cached)}


def auth_overhead_us(n: int = 20000) -> float:
    """Authenticate a Bearer key, admit under a tenant's limits and derive its salt: the
    mean over n requests against a 100-key table."""
    from tierserve.deploy.openai.tenants import KeyTable
    keys = {f"sk-{i:04d}-{'x' * 40}": f"tenant{i % 10}" for i in range(100)}
    table = KeyTable.from_dict({"keys": keys, "tenants": {
        f"tenant{t}": {"requests_per_second": 1e9, "tokens_per_minute": 1e12}
        for t in range(10)}})
    headers = [f"Bearer {k}" for k in keys]
    t0 = time.perf_counter()
    for i in range(n):
        tenant = table.authenticate(headers[i % 100])
        tenant.admit(1)
        tenant.cache_salt("client")
    return round((time.perf_counter() - t0) / n * 1e6, 2)


async def run_rate(url: str, model: str, prompts: list[str], rate: float, output_len: int,
                   seed: int) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt,
                                                         output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[dict], duration: float, rate: float, slo_ttft_ms: float,
              slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    refused = sum(1 for r in results if r["status"] == 503)
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 1) if len(xs) else None  # noqa
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [x for r in ok for x in r["itl"]]
    good = sum(1 for r in ok if r["ttft"] * 1000 <= slo_ttft_ms and (
        r["tokens"] <= 1 or (r["e2e"] - r["ttft"]) / (r["tokens"] - 1) * 1000 <= slo_tpot_ms))
    return {
        "rate": "inf" if rate == float("inf") else rate, "requests": len(results),
        "completed": len(ok), "refused": refused,
        "failed": len(results) - len(ok) - refused, "duration_s": round(duration, 2),
        "req_per_s": round(len(ok) / duration, 3),
        "output_tok_per_s": round(sum(r["tokens"] for r in ok) / duration, 1),
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
        "goodput_req_per_s": round(good / duration, 3),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tierserve(args) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tierserve.deploy.cli", "api-server", "--port", str(port),
           "--max-queued-requests", str(args.max_queued_requests)] + args.server_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
                return proc, base, model
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None,
                    help="an OpenAI-compatible server (default: start tierserve's)")
    ap.add_argument("--model", default=None, help="the model name to send (default: the "
                    "server's first /v1/models entry)")
    ap.add_argument("--label", default=None, help="the engine's name in the table")
    ap.add_argument("--rates", default="1,2,4,8,inf")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--max-queued-requests", type=int, default=16,
                    help="tierserve's admission bound (requests without a first token)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra `tierserve api-server` argument (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--structured", action="store_true",
                    help="also the structured-output line (JSON schema vs free, compile, auth)")
    ap.add_argument("--batch", type=int, default=16, help="requests at once, --structured")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from tierserve.runtime.tokenizer import load_model_tokenizer
    from tierserve.workers.model.loader import default_model_path
    tokenizer = load_model_tokenizer(default_model_path())
    proc = None
    if args.base_url is None:
        proc, base, model = start_tierserve(args)
        label = args.label or "tierserve"
    else:
        base = args.base_url.rstrip("/").removesuffix("/v1")
        model = args.model or httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        label = args.label or base
    rows, structured = [], None
    try:
        url = base + "/v1/chat/completions"
        # One warm-up request: first-call costs (kernel loads, caches) are not the workload's.
        asyncio.run(run_rate(url, model, ["warm up"], float("inf"), 4, args.seed))
        if args.structured:
            asyncio.run(_batch(url, model, ["warm up"], 4, {"guided_json": LIST_SCHEMA}))
            structured = {"engine": label} | structured_line(
                url, model, build_prompts(tokenizer, args.batch, args.input_len, args.seed),
                args.output_len)
        for i, text in enumerate(t for t in args.rates.split(",") if t):
            rate = float(text)
            prompts = build_prompts(tokenizer, args.num_prompts, args.input_len,
                                    args.seed * 1000 + i)
            results, duration = asyncio.run(run_rate(url, model, prompts, rate,
                                                     args.output_len, args.seed + i))
            rows.append({"engine": label} | summarize(results, duration, rate,
                                                      args.slo_ttft_ms, args.slo_tpot_ms))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps({"workload": {k: getattr(args, k) for k in (
            "num_prompts", "input_len", "output_len", "slo_ttft_ms", "slo_tpot_ms",
            "max_queued_requests")}, "rows": rows, "structured": structured}, indent=2))
    else:
        if rows:
            print_table(rows)
        if structured is not None:
            print_table([structured])


if __name__ == "__main__":
    main()
