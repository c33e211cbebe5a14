"""Raw steering vectors from the command line: the services behind /api/vectors, with the
same checks and refusals. Each subcommand prints the /api envelope as JSON on stdout
(``{success, data, error: {code, message, details}}``) and exits 1 on a refusal."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from core.api import error_body
from core.errors import MillmError
from orchestration.vectors import vector_compute
from registry import selectors, services, vectors
from registry.errors import VectorInvalid
from registry.management.commands._progress import require_engine
from registry.vector_io import POOLINGS, vector_out


def read_pairs(path: str) -> list[tuple[str, str]]:
    """``{"positive": …, "negative": …}`` per line of a JSONL file (blank lines skipped)."""
    pairs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise VectorInvalid(f"cannot read {path}: {exc}", details={"field": "pairs"}) from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            pairs.append((item["positive"], item["negative"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise VectorInvalid(
                f'{path} line {number} is not {{"positive": …, "negative": …}}',
                details={"field": "pairs", "line": number},
            ) from exc
    return pairs


class Command(BaseCommand):
    help = "Steering vectors: import a file, compute one from prompt pairs, list, delete."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        imp = sub.add_parser(
            "import", help="register a vector file (safetensors, layer.<L> tensors); miLLM keeps its own copy"
        )
        imp.add_argument("path", help="absolute path of the file")
        imp.add_argument("--name", required=True)
        imp.add_argument("--model", required=True, help="the registered model (id or name)")
        imp.add_argument(
            "--layer", type=int, default=None, help="keep only this layer's vector (default: all in the file)"
        )
        comp = sub.add_parser(
            "compute", help="mean difference of the resident model's residuals over contrastive prompt pairs"
        )
        comp.add_argument("--pairs", required=True, help='JSONL file, one {"positive": …, "negative": …} per line')
        comp.add_argument("--layer", type=int, required=True)
        comp.add_argument("--name", required=True)
        comp.add_argument("--model", default=None, help="must name the resident model")
        comp.add_argument("--pooling", choices=POOLINGS, default="last")
        sub.add_parser("list", help="every steering vector")
        rm = sub.add_parser("delete", help="delete a vector (and only the copy miLLM wrote)")
        rm.add_argument("vector_id")

    def _print(self, body: dict) -> None:
        self.stdout.write(json.dumps(body, cls=DjangoJSONEncoder, indent=2))

    def handle(self, *args, action, **options):
        try:
            data = getattr(self, f"_{action}")(**options)
        except MillmError as exc:
            self._print(error_body(exc.code, exc.message, exc.details))
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        self._print({"success": True, "data": data, "error": None})

    def _import(self, *, path, name, model, layer, **_):
        row = vectors.vector_import(path=path, name=name, layer=layer, model=selectors.model_get(model_id=model))
        return vector_out(row)

    def _compute(self, *, pairs, layer, name, model, pooling, **_):
        require_engine()
        row = vector_compute(name=name, layer=layer, pairs=read_pairs(pairs), model_name=model, pooling=pooling)
        return vector_out(row)

    def _list(self, **_):
        rows = list(vectors.vector_list())
        return {"vectors": [vector_out(v) for v in rows], "total": len(rows)}

    def _delete(self, *, vector_id, **_):
        services.sae_delete(sae=vectors.vector_get(vector_id=vector_id))
        return {"status": "deleted", "id": vector_id, "freed_disk_mb": None}
