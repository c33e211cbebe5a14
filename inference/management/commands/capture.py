"""Run a JSONL file of prompts through the engine offline, each steered as a /v1 request
would be, and write one capture artifact per prompt (the original's offline "steer and
capture" entry point; docs/capture.md, "Offline").

    python manage.py capture MODEL --input prompts.jsonl --layers 0,6,12 \
        --positions last --out captures/ [--max-tokens 16] [--attention-layers 3 --heads 0,1] \
        [--steering JSON | --steering-file PATH] [--profile NAME] [--steering-intensity X] \
        [--attach SAE[@LAYER] ...]

Each input line is ``{"prompt": "..."}`` or ``{"messages": [...]}``, optionally with
``id``, ``max_tokens`` and the /v1 body's ``steering``, ``profile`` and
``steering_intensity``, which replace the command's ``--steering``/``--steering-file``,
``--profile`` and ``--steering-intensity`` for that line. The steering is read, resolved
and checked as /v1's is (``inference.offline_steering``); a line naming none runs
unsteered (never the live steering). The files go to ``--out`` as
``<capture id>.safetensors`` (the sidecar, with the steering hash and apply counts, in its
header and beside it as ``<capture id>.json``), and ``--out/index.jsonl`` gets one line per
input: its ``line`` and ``id``, the ``capture_id``, the text, the finish reason, the usage
and the steering that ran (``steering``, ``steering_apply_count``, ``steering_fired``, as a
/v1 answer's ``millm`` says them). A bad line or bad steering stops the command before
anything runs, naming the line, the option its value came from and the field; a line the
engine refuses while running stops it too, and the run's other captures are removed.

Embedded mode: the command runs its own engine in this process (the server's engine lives
in ``manage.py serve`` and cannot be reached from here), loads MODEL's files on the
configured device and attaches what ``--attach`` names and the attachments the lines'
profiles are bound to; nothing in the registry changes. Distributed mode: the running
``run_engine`` does the work on the model and attachments it holds (load MODEL and attach
first; ``--attach`` is refused), and ``--out`` must be a directory the engine's host can
write.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from gpu_engine.api.artifacts import file_names
from gpu_engine.api.errors import EngineError, InvalidParameter
from gpu_engine.api.protocol import (
    AttachmentStatus,
    AttachSpec,
    AttentionCaptureSpec,
    CaptureSpec,
    GenerationJob,
    GenerationResult,
    SamplingParams,
)
from inference import offline_steering
from inference.offline_steering import VECTOR_LAYOUT
from orchestration.services import load_job
from registry import maintenance
from registry.models import SAE
from steering.services import steering_profile_binding


def _ints(text: str | None, name: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"--{name} takes comma-separated integers, got {text!r}") from None


LINE_KEYS = ("prompt", "messages", "id", "max_tokens", *offline_steering.STEERING_KEYS)


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
        unknown = sorted(set(item) - set(LINE_KEYS))
        if unknown:
            raise CommandError(f"line {n}: unknown key(s) {', '.join(unknown)} (a line takes {', '.join(LINE_KEYS)})")
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
                "raw": item,
            }
        )
    if not items:
        raise CommandError(f"--input {path} holds no prompts")
    return items


def _steering_defaults(options: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """The command's steering options as /v1 body fields: field -> (value, option)."""
    out: dict[str, tuple[Any, str]] = {}
    text, path = options.get("steering"), options.get("steering_file")
    if text is not None and path is not None:
        raise CommandError("give --steering or --steering-file, not both")
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CommandError(f"--steering-file {path}: cannot read it ({exc.strerror})") from None
    if text is not None:
        option = "--steering-file" if path is not None else "--steering"
        try:
            out["steering"] = (json.loads(text), option)
        except ValueError as exc:
            raise CommandError(f"{option}: not JSON ({exc})") from None
    if options.get("profile") is not None:
        out["profile"] = (options["profile"], "--profile")
    intensity = options.get("steering_intensity")
    if intensity is not None:
        try:  # a number, or /v1's "off"
            value: Any = json.loads(intensity)
        except ValueError:
            value = intensity
        out["steering_intensity"] = (value, "--steering-intensity")
    return out


def _attach_options(values: list[str]) -> list[tuple[str, int | None]]:
    """``--attach SAE[@LAYER]`` (repeated or comma-separated) as (sae id, layer or None)."""
    out = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            sae_id, _, layer = part.partition("@")
            if layer and not (layer.isascii() and layer.isdigit()):
                raise CommandError(f"--attach {part}: the layer after @ must be a non-negative integer")
            out.append((sae_id, int(layer) if layer else None))
    return out


class Command(BaseCommand):
    help = (
        "Capture hidden states (and attention Q/K) of a JSONL file of prompts, offline, each "
        "steered as a /v1 request would be (steering, profile, steering_intensity)."
    )

    def add_arguments(self, parser):
        parser.add_argument("model", help="a registered model's name or id")
        parser.add_argument("--input", required=True, type=Path, help="JSONL of prompts")
        parser.add_argument("--out", required=True, type=Path, help="directory for the artifacts")
        parser.add_argument("--layers", default="", help="comma-separated decoder blocks")
        parser.add_argument("--positions", default="last", help="last | last_prompt | prompt | completion | all")
        parser.add_argument("--attention-layers", default="", help="layers whose Q/K to capture")
        parser.add_argument("--heads", default="", help="query heads (default: all)")
        parser.add_argument("--max-tokens", type=int, default=16)
        parser.add_argument(
            "--steering",
            help="every line's steering, a /v1 steering object as JSON: "
            '\'{"sae_id": "...", "features": [{"index": 3, "strength": 8}]}\' (a line\'s own replaces it)',
        )
        parser.add_argument("--steering-file", type=Path, help="the same, read from a JSON file")
        parser.add_argument("--profile", help="every line's steering: a saved profile (or cluster) by name")
        parser.add_argument("--steering-intensity", help='the dial λ in [0, 2], or "off"')
        parser.add_argument(
            "--attach",
            action="append",
            default=[],
            metavar="SAE[@LAYER]",
            help="embedded mode: an SAE or vector (by id) for this command's engine to hold, at LAYER "
            "(default: the layer it was trained on); repeat it or separate with commas",
        )

    def handle(self, *args, model, input, out, layers, positions, attention_layers, heads, max_tokens, **options):
        items = _read_lines(input, max_tokens)
        defaults = _steering_defaults(options)
        attach = _attach_options(options.get("attach") or [])
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
        asked = [offline_steering.line_steering(item["line"], item["raw"], defaults) for item in items]
        try:
            reqs = [offline_steering.read(a, row.name) for a in asked]
            if settings.EMBEDDED:
                held = self._attachments_planned(row, attach, asked, reqs)
            else:
                if attach:
                    raise CommandError(
                        "--attach is for embedded mode: the running engine holds the server's attachments "
                        "(manage.py attach_sae)"
                    )
                self._check_resident(row)
                self._resolved(asked, reqs, self._model_engine(row), row)  # checked before the folder is made
        except offline_steering.OfflineSteeringError as exc:
            raise CommandError(str(exc)) from None
        made = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--out {out}: cannot create it ({exc.strerror})") from None
        try:
            client, own = self._engine(row, held if settings.EMBEDDED else [])
            try:
                resolved = self._resolved(asked, reqs, client, row)
                self._run(client, items, resolved, spec, out)
            finally:
                if own:
                    client.shutdown()
        except (CommandError, offline_steering.OfflineSteeringError) as exc:
            if made and out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # refused before anything was written: no folder left behind
            raise CommandError(str(exc)) from None

    def _attachments_planned(self, row, attach, asked, reqs) -> list[tuple[Any, int]]:  # type: ignore[no-untyped-def]
        """Embedded: the (SAE row, layer) pairs this command's engine will hold — those
        ``--attach`` names and those the lines' profiles are bound to — with every line's
        steering resolved against them before any weight loads (their registry rows stand
        for the attachments; the engine's own are asked again once attached)."""
        from registry import selectors

        planned: dict[tuple[str, int], Any] = {}

        def add(sae_id: str, layer: int | None, where: str) -> None:
            try:
                sae = selectors.sae_get(sae_id=sae_id)
            except MillmError as exc:
                raise CommandError(f"{where}: {exc.code}: {exc.message}") from None
            if sae.status not in (SAE.Status.READY, SAE.Status.ATTACHED) or not sae.local_path:
                raise CommandError(f"{where}: SAE {sae.id} is not ready to attach (status {sae.status})")
            if layer is None:
                layers = list(sae.vector_layers or []) if sae.format == VECTOR_LAYOUT else []
                layer = sae.trained_on_layer if sae.trained_on_layer is not None else (layers or [None])[0]
                if layer is None or len(layers) > 1:
                    raise CommandError(f"{where}: name the layer to attach {sae.id} at ({sae.id}@LAYER)")
            if row.num_layers and layer >= row.num_layers:
                raise CommandError(f"{where}: {row.name} has layers 0-{row.num_layers - 1}, not {layer}")
            planned.setdefault((sae.id, layer), sae)

        for sae_id, layer in attach:
            add(sae_id, layer, f"--attach {sae_id}" + ("" if layer is None else f"@{layer}"))
        for a, req in zip(asked, reqs, strict=True):
            if req is None or req.profile is None or req.steering is not None:
                continue  # (both named: the resolver refuses it)
            try:
                binding = steering_profile_binding(name=req.profile)
            except MillmError as exc:
                raise offline_steering.refused(a, exc) from None
            if binding is not None:
                add(binding[0], binding[1], f"{a.where('profile')}: profile {req.profile!r}")
        statuses = [
            AttachmentStatus(
                sae_id=sae.id,
                layer=layer,
                layer_module_path="",
                d_in=sae.d_in or 0,
                # unknown until loaded: the engine's attachment is asked again
                d_sae=sae.d_sae or sae.width or 2**31,
                activation=sae.activation,
                layout=sae.format,
                path=sae.local_path,
            )
            for (_, layer), sae in planned.items()
        ]
        for a, req in zip(asked, reqs, strict=True):
            offline_steering.resolve(a, req, attachments=statuses, model=row.name)
        return [(sae, layer) for (_, layer), sae in planned.items()]

    def _resolved(self, asked, reqs, client, row) -> list[Any]:  # type: ignore[no-untyped-def]
        """Every line's steering resolved against what ``client``'s engine holds and
        checked against its backend, before any line is sent."""
        try:
            attachments, status = client.attachments(), client.status()
        except (EngineError, MillmError) as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        return [
            offline_steering.resolve(
                a,
                req,
                attachments=attachments,
                model=row.name,
                capabilities=status.capabilities,
                backend=status.backend,
            )
            for a, req in zip(asked, reqs, strict=True)
        ]

    def _check_resident(self, row) -> None:  # type: ignore[no-untyped-def]
        """Distributed: run_engine captures on the model it holds, which must be ``row``
        (else the captures would be another model's, labelled as this one)."""
        try:
            held = self._model_engine(row).status().model_id
        except (EngineError, MillmError) as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        if held != row.name:
            raise CommandError(
                f"the engine holds {held or 'no model'}, not {row.name}: "
                f"load it first (manage.py load_model {row.name})"
            )

    def _model_engine(self, row):  # type: ignore[no-untyped-def]
        """Distributed: the client of the engine holding ``row`` (several engines:
        ``registry.engines``; a model no engine may hold stops the command)."""
        from core.runtime import runtime
        from registry.engines import addressing_model

        try:
            with addressing_model(row.name):
                return runtime().engine
        except MillmError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None

    def _engine(self, row, attach):  # type: ignore[no-untyped-def]
        from core.engine_client import EmbeddedEngineClient, resolve_device_and_dtype

        if not settings.EMBEDDED:
            return self._model_engine(row), False
        client = EmbeddedEngineClient()
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
        where = ""
        try:
            client.load_model(load_job(row, device=device, dtype=dtype))
            if attach:
                where = "--attach " + ",".join(f"{sae.id}@{layer}" for sae, layer in attach) + ": "
                client.attach_set(
                    [
                        AttachSpec(sae_id=sae.id, path=sae.local_path, layer=layer, layout=sae.format or None)
                        for sae, layer in attach
                    ]
                )
        except (EngineError, MillmError) as exc:
            client.shutdown()
            raise CommandError(f"{where}{exc.code}: {exc.message}") from None
        return client, True

    def _run(self, client, items, resolved, spec, out) -> None:  # type: ignore[no-untyped-def]
        handles = []
        for item, steering in zip(items, resolved, strict=True):
            job = GenerationJob(
                f"capture-{uuid.uuid4().hex}",
                prompt=item["prompt"],
                messages=item["messages"],
                capture=spec,
                sampling=SamplingParams(max_tokens=item["max_tokens"], temperature=0.0),
                steering=steering.spec if steering is not None else None,
            )
            handles.append((item, steering, client.generate(job)))  # all at once: one batch
        done, failed = [], None
        for item, steering, handle in handles:  # every one to its end, so that none writes after a refusal
            try:
                done.append((item, steering, GenerationResult.from_events(handle.events(timeout_s=3600))))
            except (EngineError, MillmError) as exc:
                failed = failed or f"line {item['line']}: {exc.code}: {exc.message}"
        if failed is not None:
            for _, _, result in done:  # all or nothing: a run with a refused line leaves no capture
                if result.capture is not None and result.capture.file:
                    for name in file_names(result.capture.capture_id):
                        (out / name).unlink(missing_ok=True)
            raise CommandError(failed)
        with (out / "index.jsonl").open("a") as index:
            for item, steering, result in done:
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
                            **offline_steering.summary(steering, result),
                        }
                    )
                    + "\n"
                )
        self.stdout.write(self.style.SUCCESS(f"{len(done)} capture(s) written to {out}"))
