"""A GGUF copy of the tiny Llama checkpoint, written with the ``gguf`` package.

The llama.cpp backend's parity tests compare it against the transformers backend on the
same weights, so it is float32 (no quantisation error) and carries the same tokenizer:
byte-level BPE with the GPT-2 pre-tokenizer, the special tokens, BOS on encode and the
ChatML template.  Only the Llama family is converted (the tiny Gemma2/GPT-2 checkpoints
exist for the hook-placement tests of the other backends).

llama.cpp's ``llama`` graph applies RoPE to adjacent pairs of each head, HF Llama to the
two halves (``rotate_half``); the Q and K rows are permuted accordingly, as llama.cpp's
own ``convert_hf_to_gguf.py`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

TINY_GGUF_NAME = "tiny-llama-f32.gguf"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split rotary rows → llama.cpp's interleaved pairs (per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_tiny_gguf(model_dir: Path, out_path: Path) -> Path:
    """Write ``model_dir`` (the tiny Llama checkpoint) as a float32 GGUF at ``out_path``.

    Written to a temporary name and renamed, so a reader never sees half a file."""
    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))

    n_head, n_kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    tmp = out_path.with_name(out_path.name + f".{os.getpid()}.tmp")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(model_dir.name)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # the tokenizer: ids in order, the added tokens typed, the BPE merges
    vocab = tok_json["model"]["vocab"]
    added = {t["content"]: t for t in tok_json.get("added_tokens", [])}
    ids = vocab | {text: t["id"] for text, t in added.items()}
    tokens = [""] * len(ids)
    for text, i in ids.items():
        tokens[i] = text
    # special added tokens are control tokens; the others (a template's <tool_call>) are
    # user-defined: written as text, as transformers writes them
    types = [
        gguf.TokenType.NORMAL
        if t not in added
        else gguf.TokenType.CONTROL
        if added[t].get("special", True)
        else gguf.TokenType.USER_DEFINED
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    w.add_bos_token_id(int(cfg["bos_token_id"]))
    w.add_eos_token_id(int(cfg["eos_token_id"]))
    w.add_pad_token_id(int(cfg["pad_token_id"]))
    w.add_eot_token_id(ids["<|im_end|>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tok_cfg.get("chat_template")
    if template:
        w.add_chat_template(template)

    def put(name: str, arr: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(weights[p + "self_attn.q_proj.weight"], n_head))
        put(f"blk.{i}.attn_k.weight", _permute(weights[p + "self_attn.k_proj.weight"], n_kv))
        put(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    put("output.weight", weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)
    return out_path


__all__ = ["TINY_GGUF_NAME", "build_tiny_gguf"]
