"""Train the tiny test tokenizer in-process.

The tiny models need a real tokenizer (byte-level BPE, special tokens, a chat template)
so that the engine's chat formatting, stop tokens and detokenisation run the same code
paths as with a hub model, but nothing may come from the network. Byte-level BPE covers
every input string, so no ``<unk>`` token is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from offline_assets.corpus import CORPUS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _training_lines(seed: int) -> list[str]:
    """Corpus lines in a seed-dependent order.

    BPE merge counts do not depend on order, so the vocabulary is the same for every
    seed; the shuffle only keeps the seed meaningful should the trainer ever change.
    """
    order = np.random.default_rng(seed).permutation(len(CORPUS))
    return [CORPUS[i] for i in order]


def build_tokenizer(out_dir: Path, *, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (vocab 512) on the built-in corpus and save it.

    Encoding prepends ``<s>`` like Llama tokenizers do, so prompt-length bookkeeping in
    the engine sees a BOS token as it does with real models; the chat template writes the
    BOS itself because ``apply_chat_template`` encodes without special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_lines(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast
