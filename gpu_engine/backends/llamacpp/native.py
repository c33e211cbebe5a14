"""The llama.cpp C API as this backend uses it (llama-cpp-python's low-level bindings).

``Llama()`` hides what we need — the context's eval callback (``cb_eval``), control
vectors, several sequences in one ``llama_decode`` — so the model and context are
built here from ``llama_cpp.llama_cpp`` directly.  Everything that touches a pointer
lives in this module: the ``ggml_tensor`` layout the eval callback reads, a reusable
``llama_batch``, logits and embeddings as numpy copies.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as lc
import numpy as np

from ...api.errors import InsufficientMemory, ModelLoadFailed


# ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64
class GGMLTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GGMLTensor.name.offset
OP_OFFSET = GGMLTensor.op.offset
GGML_TYPE_F32 = 0

# GGUF_KV_CACHE_TYPE → ggml_type (ggml.h)
KV_CACHE_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
UNQUANTIZED_KV = ("f32", "f16", "bf16")


def _load_ggml(name: str) -> ctypes.CDLL | None:
    """One of the ggml libraries llama-cpp-python ships beside its own (the device and
    tensor functions are not in its Python bindings)."""
    lib_dir = Path(lc.__file__).parent / "lib"
    for file in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        if (lib_dir / file).exists():
            return ctypes.CDLL(str(lib_dir / file))
    return None


GGML_BASE = _load_ggml("ggml-base")
GGML = _load_ggml("ggml")
if GGML_BASE is not None:
    GGML_BASE.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    GGML_BASE.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    for _fn in (GGML_BASE.ggml_backend_tensor_get, GGML_BASE.ggml_backend_tensor_set):
        _fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        _fn.restype = None
    GGML_BASE.ggml_op_name.argtypes = [ctypes.c_int]
    GGML_BASE.ggml_op_name.restype = ctypes.c_char_p
if GGML is not None:
    GGML.ggml_backend_dev_count.argtypes = []
    GGML.ggml_backend_dev_count.restype = ctypes.c_size_t
    GGML.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    GGML.ggml_backend_dev_get.restype = ctypes.c_void_p
    GGML.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    GGML.ggml_backend_dev_type.restype = ctypes.c_int
# ggml_backend_dev_memory(dev, &free, &total): in ggml-base (ggml-backend.cpp)
_DEV_MEMORY = getattr(GGML_BASE, "ggml_backend_dev_memory", None) if GGML_BASE is not None else None
if _DEV_MEMORY is not None:
    _DEV_MEMORY.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    _DEV_MEMORY.restype = None


def _op_id(name: bytes) -> int | None:
    """The ``ggml_op`` number of the op called ``name`` in this build (the enum moves
    between ggml versions), or None.  ``ggml_op_name`` indexes a table of every op, so
    the scan stops at the op sought, well inside it."""
    if GGML_BASE is None:
        return None
    for i in range(1, 256):
        found = GGML_BASE.ggml_op_name(i)
        if found == name:
            return i
        if not found:
            return None
    return None


# the rotary embedding's op: Q/K capture reads the ``Qcur-{il}``/``Kcur-{il}`` node it made
GGML_OP_ROPE = _op_id(b"ROPE")

_init_lock = threading.Lock()
_initialised = False


def _backend_init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            lc.llama_backend_init()
            # llama.cpp logs every tensor at load: keep errors only
            _silence_logs()
            _initialised = True


_LOG_CB = None


def _silence_logs() -> None:
    global _LOG_CB

    @lc.llama_log_callback
    def quiet(level, text, user_data):  # type: ignore[no-untyped-def]
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            import sys

            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_CB = quiet  # kept alive for the process
    lc.llama_log_set(quiet, ctypes.c_void_p())


def resolve_gguf(path: str, gguf_file: str | None) -> Path:
    """The file llama.cpp opens: the GGUF itself, or for a split model its first part
    (``…-00001-of-0000N.gguf``; llama.cpp finds the others beside it)."""
    p = Path(path)
    if p.is_dir():
        if gguf_file:
            p = p / gguf_file
        else:
            found = sorted(p.glob("*.gguf"))
            firsts = [f for f in found if "-of-" not in f.name or "-00001-of-" in f.name]
            if len(firsts) != 1:
                raise ModelLoadFailed(
                    f"{path} holds {len(firsts)} GGUF models; name one (gguf_file)",
                    details={"path": path, "files": [f.name for f in found]},
                )
            p = firsts[0]
    if not p.is_file():
        raise ModelLoadFailed(f"GGUF file {p} does not exist", details={"path": str(p)})
    return p


@dataclass(frozen=True)
class ContextSettings:
    n_ctx: int
    n_seq: int
    n_batch: int
    kv_type: str
    flash_attention: bool
    n_threads: int


class NativeModel:
    """A loaded ``llama_model`` and its vocabulary; freed by ``close``."""

    def __init__(
        self,
        gguf: Path,
        *,
        gpu_layers: int,
        tensor_split: list[float] | None,
        main_gpu: int = 0,
        split_mode: int | None = None,
    ) -> None:
        _backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        if gpu_layers != 0:
            # MILLM_ENGINE_DEVICE=cuda:N: the whole model on card N (split mode none);
            # cuda: split by layer over every card (gpu_engine.api.devices.gguf_placement)
            params.main_gpu = main_gpu
            if split_mode is not None:
                params.split_mode = split_mode
        params.use_mmap = True
        self._split = None
        if tensor_split:
            self._split = (ctypes.c_float * lc.LLAMA_MAX_DEVICES)(*tensor_split)
            params.tensor_split = self._split
        self.ptr = lc.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.ptr:
            raise ModelLoadFailed(f"llama.cpp could not load {gguf}", details={"path": str(gguf)})
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_embd = lc.llama_model_n_embd(self.ptr)
        self.n_layer = lc.llama_model_n_layer(self.ptr)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.ptr)
        self.has_decoder = bool(lc.llama_model_has_decoder(self.ptr))
        self.n_head = lc.llama_model_n_head(self.ptr)
        self.n_head_kv = lc.llama_model_n_head_kv(self.ptr)
        rope_type = lc.llama_model_rope_type(self.ptr)
        self.rotary = rope_type != lc.LLAMA_ROPE_TYPE_NONE
        # NORM rotates adjacent pairs: the converter interleaved HF's two halves (llama family)
        self.interleaved_rope = rope_type == lc.LLAMA_ROPE_TYPE_NORM
        arch = self.meta("general.architecture") or ""
        key_length = self.meta(f"{arch}.attention.key_length")
        self.head_dim = int(key_length) if key_length else self.n_embd // max(self.n_head, 1)
        # llama.cpp's kq_scale: the file's attention.scale, else 1/sqrt(head_dim)
        scale = self.meta(f"{arch}.attention.scale")
        self.attention_scale = float(scale) if scale and float(scale) != 0.0 else self.head_dim**-0.5

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def model_size(self) -> int:
        """The bytes of the tensors llama.cpp holds for this model (``llama_model_size``)."""
        return int(lc.llama_model_size(self.ptr))

    def eog_ids(self) -> set[int]:
        return {t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)}

    # ---- tokens
    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, True)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self.vocab, raw, len(raw), buf, -n, add_special, True)
        return list(buf[:n])

    def detokenize(self, ids: list[int], *, skip_special: bool) -> str:
        if not ids:
            return ""
        arr = (lc.llama_token * len(ids))(*ids)
        size = 16 * len(ids) + 16
        out = ctypes.create_string_buffer(size)
        n = lc.llama_detokenize(self.vocab, arr, len(ids), out, size, False, not skip_special)
        if n < 0:
            size = -n + 1
            out = ctypes.create_string_buffer(size)
            n = lc.llama_detokenize(self.vocab, arr, len(ids), out, size, False, not skip_special)
        return out.raw[:n].decode("utf-8", "replace")

    def close(self) -> None:
        if self.ptr:
            lc.llama_model_free(self.ptr)
            self.ptr = None


class NativeContext:
    """One ``llama_context``: a KV cache shared by ``n_seq`` sequences (unified, so a
    multi-sequence batch is split into ubatches in order), the eval callback, control
    vectors, and a reusable batch."""

    def __init__(
        self, model: NativeModel, settings: ContextSettings, eval_callback: object, eval_user_data: int | None = None
    ) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_seq_max = settings.n_seq
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.kv_unified = True
        params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        params.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attention else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.type_k = params.type_v = KV_CACHE_TYPES[settings.kv_type]
        params.embeddings = False
        params.no_perf = True
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.cb_eval_user_data = eval_user_data
        self.settings = settings
        self.model = model
        self.ptr = lc.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise ModelLoadFailed(
                f"llama.cpp could not create a context (n_ctx {settings.n_ctx}, KV {settings.kv_type})"
            )
        self.mem = lc.llama_get_memory(self.ptr)
        self.batch = lc.llama_batch_init(settings.n_batch, 0, 1)
        self.cvec_key: object = None

    # ---- memory
    def seq_clear(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def clear(self) -> None:
        lc.llama_memory_clear(self.mem, True)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Positions ``p0..p1-1`` of sequence ``src`` become ``dst``'s too: the unified KV
        cache adds ``dst`` to the cells' owners, nothing is copied (the prefix cache)."""
        lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    # ---- control vectors
    def set_cvec(self, key: object, data: np.ndarray | None, il_start: int = 1, il_end: int = -1) -> None:
        """Set the context's control vector (``data``: (n_layer - 1, n_embd) float32 for
        layers 1..n_layer-1 — llama.cpp's buffer starts at layer 1), or clear it."""
        if key == self.cvec_key:
            return
        if data is None:
            rc = lc.llama_set_adapter_cvec(self.ptr, None, 0, self.model.n_embd, -1, -1)
        else:
            flat = np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
            end = il_end if il_end >= 0 else self.model.n_layer - 1
            rc = lc.llama_set_adapter_cvec(
                self.ptr,
                flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                flat.size,
                self.model.n_embd,
                il_start,
                end,
            )
        if rc != 0:
            raise RuntimeError(f"llama_set_adapter_cvec failed ({rc})")
        self.cvec_key = key

    # ---- decode
    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants output) rows."""
        b = self.batch
        n = len(tokens)
        if n > self.settings.n_batch:
            raise ValueError("batch larger than n_batch")
        for i, (tok, pos, seq, out) in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = n
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            if rc == 1:
                raise InsufficientMemory(
                    "llama.cpp: no room left in the KV cache for this batch "
                    "(out of memory); lower the batch size or GGUF_CONTEXT_LENGTH"
                )
            raise RuntimeError(f"llama_decode failed ({rc})")

    def logits(self, i: int) -> np.ndarray:
        ptr = lc.llama_get_logits_ith(self.ptr, i)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def logits_rows(self, idx: list[int]) -> np.ndarray:
        out = np.empty((len(idx), self.model.n_vocab), dtype=np.float32)
        for r, i in enumerate(idx):
            out[r] = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))
        return out

    def embeddings_rows(self, idx: list[int]) -> np.ndarray:
        out = np.empty((len(idx), self.model.n_embd), dtype=np.float32)
        for r, i in enumerate(idx):
            out[r] = np.ctypeslib.as_array(lc.llama_get_embeddings_ith(self.ptr, i), shape=(self.model.n_embd,))
        return out

    def set_embeddings(self, on: bool) -> None:
        lc.llama_set_embeddings(self.ptr, on)

    def close(self) -> None:
        if self.ptr:
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ptr)
            self.ptr = None


def _gpu_devices() -> list[int]:
    """The ggml devices of GPU type, in llama.cpp's order (``main_gpu`` indexes them)."""
    if GGML is None:
        return []
    _backend_init()
    gpu = 1  # GGML_BACKEND_DEVICE_TYPE_GPU
    return [
        GGML.ggml_backend_dev_get(i)
        for i in range(GGML.ggml_backend_dev_count())
        if GGML.ggml_backend_dev_type(GGML.ggml_backend_dev_get(i)) == gpu
    ]


def card_free_memory(cards: list[int]) -> int | None:
    """The free bytes of llama.cpp's GPU devices ``cards`` together, as ggml reports them
    (``ggml_backend_dev_memory``); None when this build cannot say."""
    devices = _gpu_devices()
    if _DEV_MEMORY is None or not cards or any(c >= len(devices) for c in cards):
        return None
    total_free = 0
    for card in cards:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _DEV_MEMORY(devices[card], ctypes.byref(free), ctypes.byref(total))
        total_free += int(free.value)
    return total_free


def gpu_device_count() -> int:
    """Cards llama.cpp can offload to (0 on a CPU build)."""
    if not lc.llama_supports_gpu_offload():
        return 0
    if GGML is None:
        return 1
    _backend_init()
    gpu = 1  # GGML_BACKEND_DEVICE_TYPE_GPU
    return sum(
        1
        for i in range(GGML.ggml_backend_dev_count())
        if GGML.ggml_backend_dev_type(GGML.ggml_backend_dev_get(i)) == gpu
    )


__all__ = [
    "GGMLTensor",
    "GGML_OP_ROPE",
    "KV_CACHE_TYPES",
    "NAME_OFFSET",
    "OP_OFFSET",
    "ContextSettings",
    "NativeContext",
    "NativeModel",
    "card_free_memory",
    "gpu_device_count",
    "resolve_gguf",
]
