"""Run a JSONL file of prompts through the engine offline and write one capture artifact
per prompt (the original's offline entry point; docs/capture.md, "Offline").

    python manage.py capture MODEL --input prompts.jsonl --layers 0,6,12 \
        --positions last --out captures/ [--max-tokens 16] [--attention-layers 3 --heads 0,1]

Each input line is ``{"prompt": "..."}`` or ``{"messages": [...]}``, optionally with
``id`` and ``max_tokens``. The files go to ``--out`` as ``<capture id>.safetensors`` (the
sidecar in its header and beside it as ``<capture id>.json``), and ``--out/index.jsonl``
gets one line per input: its ``line`` and ``id``, the ``capture_id``, the text, the
finish reason and the usage. A bad line stops the command before anything runs, naming
the line.

Embedded mode: the command runs its own engine in this process (the server's engine lives
in ``manage.py serve`` and cannot be reached from here) and loads MODEL's files on the
configured device; nothing in the registry changes. Distributed mode: the running
``run_engine`` does the work on the model it holds (load MODEL first), and ``--out`` must
be a directory the engine's host can write.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from gpu_engine.api.errors import EngineError, InvalidParameter
from gpu_engine.api.protocol import (
    AttentionCaptureSpec,
    CaptureSpec,
    GenerationJob,
    GenerationResult,
    SamplingParams,
)
from orchestration.services import load_job
from registry import maintenance


def _ints(text: str | None, name: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"--{name} takes comma-separated integers, got {text!r}") from None


def _read_lines(path: Path, max_tokens: int) -> list[dict[str, Any]]:
    if not path.is_file():
        raise CommandError(f"--input {path} is not a file")
    items = []
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as exc:
            raise CommandError(f"line {n}: not JSON ({exc})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise CommandError(f"line {n}: give exactly one of prompt, messages")
        tokens = item.get("max_tokens", max_tokens)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise CommandError(f"line {n}: max_tokens must be a positive integer")
        items.append(
            {
                "line": n,
                "id": item.get("id"),
                "prompt": item.get("prompt"),
                "messages": item.get("messages"),
                "max_tokens": tokens,
            }
        )
    if not items:
        raise CommandError(f"--input {path} holds no prompts")
    return items


class Command(BaseCommand):
    help = "Capture hidden states (and attention Q/K) of a JSONL file of prompts, offline."

    def add_arguments(self, parser):
        parser.add_argument("model", help="a registered model's name or id")
        parser.add_argument("--input", required=True, type=Path, help="JSONL of prompts")
        parser.add_argument("--out", required=True, type=Path, help="directory for the artifacts")
        parser.add_argument("--layers", default="", help="comma-separated decoder blocks")
        parser.add_argument("--positions", default="last", help="last | last_prompt | prompt | completion | all")
        parser.add_argument("--attention-layers", default="", help="layers whose Q/K to capture")
        parser.add_argument("--heads", default="", help="query heads (default: all)")
        parser.add_argument("--max-tokens", type=int, default=16)

    def handle(self, *args, model, input, out, layers, positions, attention_layers, heads, max_tokens, **options):
        items = _read_lines(input, max_tokens)
        try:
            row = maintenance.model_by_name_or_id(model)
        except MillmError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        try:
            attention = None
            if attention_layers:
                attention = AttentionCaptureSpec(
                    layers=_ints(attention_layers, "attention-layers"),
                    heads=_ints(heads, "heads") or None,
                    positions=positions,
                )
            spec = CaptureSpec(
                layers=_ints(layers, "layers"),
                positions=positions,
                attention=attention,
                max_bytes=int(settings.CAPTURE_MAX_BYTES),
                inline_max_bytes=0,
                directory=str(out.resolve()),
                model=row.name,
            )
        except InvalidParameter as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        if row.num_layers:  # what the registry knows is checked before the weights load
            wanted = {"--layers": spec.layers, "--attention-layers": attention.layers if attention else []}
            for option, chosen in wanted.items():
                outside = [layer for layer in chosen if layer >= row.num_layers]
                if outside:
                    raise CommandError(
                        f"{option}: {row.name} has layers 0-{row.num_layers - 1}, not {', '.join(map(str, outside))}"
                    )
        if not settings.EMBEDDED:
            self._check_resident(row)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--out {out}: cannot create it ({exc.strerror})") from None
        client, own = self._engine(row)
        try:
            self._run(client, items, spec, out)
        finally:
            if own:
                client.shutdown()

    def _check_resident(self, row) -> None:  # type: ignore[no-untyped-def]
        """Distributed: run_engine captures on the model it holds, which must be ``row``
        (else the captures would be another model's, labelled as this one)."""
        from core.runtime import runtime

        try:
            held = runtime().engine.status().model_id
        except (EngineError, MillmError) as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        if held != row.name:
            raise CommandError(
                f"the engine holds {held or 'no model'}, not {row.name}: "
                f"load it first (manage.py load_model {row.name})"
            )

    def _engine(self, row):  # type: ignore[no-untyped-def]
        from core.engine_client import EmbeddedEngineClient, resolve_device_and_dtype
        from core.runtime import runtime

        if not settings.EMBEDDED:
            return runtime().engine, False
        client = EmbeddedEngineClient()
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
        try:
            client.load_model(load_job(row, device=device, dtype=dtype))
        except (EngineError, MillmError) as exc:
            client.shutdown()
            raise CommandError(f"{exc.code}: {exc.message}") from None
        return client, True

    def _run(self, client, items, spec, out) -> None:  # type: ignore[no-untyped-def]
        handles = []
        for item in items:
            job = GenerationJob(
                f"capture-{uuid.uuid4().hex}",
                prompt=item["prompt"],
                messages=item["messages"],
                capture=spec,
                sampling=SamplingParams(max_tokens=item["max_tokens"], temperature=0.0),
            )
            handles.append((item, client.generate(job)))  # all at once: one batch
        written = 0
        with (out / "index.jsonl").open("a") as index:
            for item, handle in handles:
                try:
                    result = GenerationResult.from_events(handle.events(timeout_s=3600))
                except (EngineError, MillmError) as exc:
                    raise CommandError(f"line {item['line']}: {exc.code}: {exc.message}") from None
                cap = result.capture
                index.write(
                    json.dumps(
                        {
                            "line": item["line"],
                            "id": item["id"],
                            "capture_id": cap.capture_id if cap else None,
                            "file": cap.file if cap else None,
                            "text": result.text,
                            "finish_reason": result.finish_reason,
                            "usage": {
                                "prompt_tokens": result.usage.prompt_tokens,
                                "completion_tokens": result.usage.completion_tokens,
                            },
                        }
                    )
                    + "\n"
                )
                written += 1
        self.stdout.write(self.style.SUCCESS(f"{written} capture(s) written to {out}"))
