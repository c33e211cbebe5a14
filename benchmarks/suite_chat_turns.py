"""The ``chat_turns`` group of ``benchmarks/run.py``: ``chat_turns.py`` on the transformers
demo model and on its GGUF (llama.cpp, where installed), each with the prefix cache on
(PREFIX_CACHE_MAX_MB 256) and off (0), one process per run; the rows are the last turn's
time to first token with ÷ without the cache per backend (issue 36's target ≤ 0.3) and
the cache's hit rate; and, on the transformers run, /v1/responses streaming ÷
/v1/chat/completions streaming per output token (target ≤ 1.03)."""

from __future__ import annotations

from benchmarks.harness import Ctx, Row, target

GROUP = "chat_turns"
CACHE_MB = 256


def _run(ctx: Ctx, backend: str, mb: int, *extra: str) -> dict:
    argv = ["--backend", backend, "--cache-mb", str(mb), "--rounds", str(ctx.rounds), *extra]
    if backend == "transformers":
        argv += ["--model", ctx.model]
    if ctx.quick:
        argv += ["--turns", "3", "--max-tokens", str(ctx.tokens), "--system-chars", "120"]
    return ctx.script(GROUP, "chat_turns.py", argv)  # type: ignore[return-value]


def group_chat_turns(ctx: Ctx, llamacpp_missing: str | None) -> list[Row]:
    rows: list[Row] = []
    for backend in ("transformers", "llamacpp"):
        what = f"{backend}, {3 if ctx.quick else 10}-turn chat through /v1/chat/completions streaming: last-turn TTFT, prefix cache on ÷ off"
        if backend == "llamacpp" and llamacpp_missing:
            rows.append(Row(GROUP, what, status="not installed", note=f"needs {llamacpp_missing}"))
            continue
        # off, on, off, on would cost twice the loads; on and off back to back, in one order
        # the transformers run with the cache on also times /v1/responses against chat
        on = _run(ctx, backend, CACHE_MB, *(["--responses"] if backend == "transformers" else []))
        off = _run(ctx, backend, 0)
        note = (
            f"{on['model']}: {off['last_turn_ttft_ms']:.0f} → {on['last_turn_ttft_ms']:.0f} ms at "
            f"{on['prompt_tokens'][-1]} prompt tokens"
        )
        if on["answers_sha256"] != off["answers_sha256"]:
            note += "; THE ANSWERS DIFFER between cache on and off"
        rows.append(
            Row(
                GROUP,
                what,
                on["last_turn_ttft_ms"] / off["last_turn_ttft_ms"],
                note=note,
                **target("<=", 0.3, "issue 36"),
            )
        )
        rows.append(
            Row(
                GROUP,
                f"{backend}: last-turn TTFT ÷ the same prompt at once in an empty prompt_cache_key (cache on, paired)",
                on.get("last_over_cold"),
                note="the pair shares the machine's load; the row above compares two processes",
            )
        )
        counts = ((on.get("prefix_cache") or {}).get("classes") or {}).get("unsteered") or {}
        rows.append(
            Row(
                GROUP,
                f"{backend}: prefix cache hits ÷ lookups over the chats (cache on)",
                counts["hits"] / counts["lookups"] if counts.get("lookups") else None,
                note=f"{counts.get('hits', 0)} hits, {counts.get('tokens_reused', 0)} prompt tokens reused",
            )
        )
        if "responses_over_chat_tpot" in on:
            t = on["tpot_ms"]
            rows.append(
                Row(
                    GROUP,
                    f"{backend}: /v1/responses streaming ÷ /v1/chat/completions streaming, time per output token",
                    on["responses_over_chat_tpot"],
                    note=f"{t['responses']:.2f} ÷ {t['chat']:.2f} ms",
                    **target("<=", 1.03, "issue 36"),
                )
            )
    return rows


__all__ = ["group_chat_turns"]
