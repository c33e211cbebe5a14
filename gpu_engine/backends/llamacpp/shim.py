"""The eval callback's filter in C, compiled on first use.

llama.cpp asks the eval callback about every node of every graph (several hundred per
token for a 30-layer model) before computing it.  A Python callback pays a ctypes
round trip for each — about a millisecond per token, a sizeable share of a 135M model's
7 ms decode step — even when nothing is hooked.  This filter answers those questions in
C: nothing while no plan is published, and only ``l_out-{il}`` of the layers the plan
names (and, for a Q/K capture, the ``Qcur-{il}``/``Kcur-{il}`` nodes rope made; for an
SAE at another hook point, ``attn_out-{il}``, ``ffn_out-{il}``, ``ffn_norm-{il}`` or the
embeddings, ``embd``).

A claimed node gets one or both of two things (``wanted``'s bits):

- ``TAP`` — the Python side (``taps.EvalTaps``) runs once for the node: its rows go
  through ``route`` (per-row deltas and feature controls, SAE monitors);
- ``STAGE`` — the node's rows are copied, in C, into the capture stage: one float32
  buffer per kind (layer outputs, queries, keys) of (n_layer, capacity, row) that the
  Python side allocated, at the layer's next free row (``got`` counts the rows copied
  this decode; ubatches append).  The copy comes after the tap, so a steered request
  stages its steered stream.  It goes through ``ggml_backend_tensor_get``, so a device
  buffer is copied out as a host one is.  Capture then costs one copy per node and no
  Python inside ``llama_decode``; the rows are handed to the requests' capture plans
  once per decode (``EvalTaps.staged``).  A node that is not a dense float32 block of
  the declared row, or that would overrun the stage, stops the graph with ``error`` set.

It is compiled with the system C compiler (the one that built llama-cpp-python) into
``$MILLM_WHEEL_CACHE`` (default ``~/.cache/millm-wheels``), keyed by its source, and
loaded with ctypes.  Where no compiler is found the backend keeps the Python callback
(``EvalTaps.native_filter`` is False) — the same results, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* kind: 0 a layer output (l_out-N), 1 a query (Qcur-N), 2 a key (Kcur-N) after rope;
   tapped only: 3 attention output (attn_out-N), 4 MLP output (ffn_out-N), 5 MLP input
   (ffn_norm-N), 6 the embeddings (embd, layer 0) */
typedef bool (*tap_fn)(void * tensor, int kind, int layer);
/* ggml_backend_tensor_get */
typedef void (*get_fn)(const void * tensor, void * data, size_t offset, size_t size);

#define TAP 1
#define STAGE 2

struct millm_filter {
    int active;                 /* 0: claim nothing */
    int n_layer;
    unsigned long name_offset;  /* offsetof(struct ggml_tensor, name) */
    unsigned long op_offset;    /* offsetof(struct ggml_tensor, op) */
    int rope_op;                /* GGML_OP_ROPE in this build */
    tap_fn tap;                 /* called with each claimed node */
    unsigned char wanted[4096];     /* layer outputs: TAP | STAGE */
    unsigned char wanted_qk[4096];  /* rotated Q and K: TAP | STAGE */
    unsigned char wanted_sub[4][4096];  /* kinds 3 to 6: TAP */
    /* the capture stage */
    unsigned long type_offset;  /* offsetof(struct ggml_tensor, type), ne, nb */
    unsigned long ne_offset;
    unsigned long nb_offset;
    get_fn tensor_get;
    float * stage[3];           /* per kind: (n_layer, capacity, row_floats) float32 */
    long long row_floats[3];
    long long capacity;         /* rows per layer */
    long long * got;            /* (3, n_layer): rows staged this decode */
    int error;                  /* 1: not a dense float32 block of the row; 2: overrun */
    int error_kind;
    int error_layer;
};

/* the layer number that is the whole rest of the name, or -1 ("Qcur-0 (view)" is not) */
static int layer_of(const char * s) {
    int v = 0;
    if (*s == 0) {
        return -1;
    }
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > 4096) {
            return -1;
        }
        v = v * 10 + (*s - '0');
    }
    return v;
}

static bool stage_copy(struct millm_filter * f, void * tensor, int kind, int il) {
    const char * t = (const char *) tensor;
    int type = *(const int *) (t + f->type_offset);
    const long long * ne = (const long long *) (t + f->ne_offset);
    const size_t * nb = (const size_t *) (t + f->nb_offset);
    /* a layer output is (d, tokens); a rotated Q or K (head_dim, heads, tokens) */
    long long row = kind == 0 ? ne[0] : ne[0] * ne[1];
    long long n = kind == 0 ? ne[1] : ne[2];
    bool dense = nb[0] == 4 && nb[1] == nb[0] * (size_t) ne[0] && nb[2] == nb[1] * (size_t) ne[1]
                 && nb[3] == nb[2] * (size_t) ne[2];
    bool flat = kind == 0 ? (ne[2] == 1 && ne[3] == 1) : ne[3] == 1;
    f->error_kind = kind;
    f->error_layer = il;
    if (type != 0 || !dense || !flat || row != f->row_floats[kind] || f->stage[kind] == NULL) {
        f->error = 1;
        return false;
    }
    long long * got = f->got + (long long) kind * f->n_layer + il;
    if (*got + n > f->capacity) {
        f->error = 2;
        return false;
    }
    float * dst = f->stage[kind] + ((long long) il * f->capacity + *got) * row;
    f->tensor_get(tensor, dst, 0, (size_t) (n * row) * sizeof(float));
    *got += n;
    return true;
}

bool millm_eval_filter(void * tensor, bool ask, void * user_data) {
    struct millm_filter * f = (struct millm_filter *) user_data;
    if (!f->active) {
        return false;
    }
    const char * name = (const char *) tensor + f->name_offset;
    int kind;
    const char * rest;
    if (strncmp(name, "l_out-", 6) == 0) {
        kind = 0;
        rest = name + 6;
    } else if (strncmp(name, "Qcur-", 5) == 0) {
        kind = 1;
        rest = name + 5;
    } else if (strncmp(name, "Kcur-", 5) == 0) {
        kind = 2;
        rest = name + 5;
    } else if (strncmp(name, "attn_out-", 9) == 0) {
        kind = 3;
        rest = name + 9;
    } else if (strncmp(name, "ffn_out-", 8) == 0) {
        kind = 4;
        rest = name + 8;
    } else if (strncmp(name, "ffn_norm-", 9) == 0) {
        kind = 5;
        rest = name + 9;
    } else if (strcmp(name, "embd") == 0 || strcmp(name, "inp_embd") == 0) {
        kind = 6;
        rest = "0";
    } else {
        return false;
    }
    int il = layer_of(rest);
    if (il < 0 || il >= f->n_layer || il >= 4096) {
        return false;
    }
    int want;
    if (kind == 0) {
        want = f->wanted[il];
    } else if (kind >= 3) {
        want = f->wanted_sub[kind - 3][il] & TAP;
    } else {
        /* the projection and its reshape carry the same name: only rope's output */
        int op = *(const int *) ((const char *) tensor + f->op_offset);
        want = op == f->rope_op ? f->wanted_qk[il] : 0;
    }
    if (!want) {
        return false;
    }
    if (ask) {
        return true;
    }
    if ((want & TAP) && !f->tap(tensor, kind, il)) {
        return false;
    }
    if (want & STAGE) {
        return stage_copy(f, tensor, kind, il);
    }
    return true;
}
"""

# ``wanted``'s bits
TAP, STAGE = 1, 2

TAP_FN = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


class Filter(ctypes.Structure):
    _fields_ = [
        ("active", ctypes.c_int),
        ("n_layer", ctypes.c_int),
        ("name_offset", ctypes.c_ulong),
        ("op_offset", ctypes.c_ulong),
        ("rope_op", ctypes.c_int),
        ("tap", TAP_FN),
        ("wanted", ctypes.c_ubyte * 4096),
        ("wanted_qk", ctypes.c_ubyte * 4096),
        ("wanted_sub", (ctypes.c_ubyte * 4096) * 4),
        ("type_offset", ctypes.c_ulong),
        ("ne_offset", ctypes.c_ulong),
        ("nb_offset", ctypes.c_ulong),
        ("tensor_get", ctypes.c_void_p),
        ("stage", ctypes.c_void_p * 3),
        ("row_floats", ctypes.c_longlong * 3),
        ("capacity", ctypes.c_longlong),
        ("got", ctypes.c_void_p),
        ("error", ctypes.c_int),
        ("error_kind", ctypes.c_int),
        ("error_layer", ctypes.c_int),
    ]


def _cache_dir() -> Path:
    return Path(os.environ.get("MILLM_WHEEL_CACHE") or Path.home() / ".cache" / "millm-wheels")


def load_filter() -> ctypes.CDLL | None:
    """The compiled filter library, building it once; None without a C compiler (or with
    ``MILLM_LLAMACPP_PYTHON_CALLBACK=1``, which the benchmark uses to measure the filter)."""
    if os.environ.get("MILLM_LLAMACPP_PYTHON_CALLBACK") == "1":
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    target = _cache_dir() / f"millm-eval-filter-{digest}.so"
    if not target.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "filter.c"
            src.write_text(SOURCE)
            out = Path(tmp) / "filter.so"
            done = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, timeout=120
            )
            if done.returncode != 0:
                return None
            os.replace(out, target)  # atomic: a parallel build leaves one whole file
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    lib.millm_eval_filter.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
    lib.millm_eval_filter.restype = ctypes.c_bool
    return lib


__all__ = ["STAGE", "TAP", "TAP_FN", "Filter", "load_filter"]
