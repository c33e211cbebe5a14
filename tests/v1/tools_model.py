"""A tiny tool-calling chat model for the tools tests: tiny-llama with ``<tool_call>`` and
``</tool_call>`` as single added tokens (as in Qwen's vocabulary; its embeddings grown by
two rows, its context 2,048) and a Hermes-style chat template that renders ``tools``, assistant
``tool_calls`` and ``tool`` results."""

from __future__ import annotations

from pathlib import Path

NAME = "tiny-llama-tools"

TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tools_model(source: Path, out: Path) -> Path:
    """tiny-llama at ``source`` as a tool-calling model at ``out`` (built once)."""
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TOOLS_TEMPLATE
    # tools' JSON is long in a 512-token vocabulary: room for it (RoPE takes any length)
    tok.model_max_length = 2048
    model = AutoModelForCausalLM.from_pretrained(str(source))
    model.config.max_position_embeddings = 2048
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out
