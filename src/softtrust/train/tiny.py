"""The embedded default model: a character-level tokenizer and a tiny Qwen2, built locally.

Nothing here touches the network: the tokenizer is assembled with the ``tokenizers``
library from a fixed character set, and the model is a real ``transformers`` Qwen2
architecture with a small config and random weights. Both save and load with
``save_pretrained`` / ``from_pretrained`` like any Hugging Face checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Every printable ASCII character is one token: enough for arithmetic tasks and
# for user datasets of plain text; anything else maps to <unk>.
CHARACTERS = tuple(chr(c) for c in range(32, 127))


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (one token per printable ASCII char).

    Returns:
        A tokenizer with ``pad``, ``bos``, ``eos`` and ``unk`` special tokens, no
        automatic BOS/EOS insertion (the caller decides), left padding (what batched
        generation wants), and a decoder that joins characters without spaces.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character into its own piece ("isolated"), keeping spaces.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of the embedded default causal LM (a Qwen2 architecture)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True


def build_tiny_model(tokenizer, config: TinyModelConfig | None = None, seed: int = 0):
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``config`` for ``tokenizer``.

    With the defaults it has about 0.9 M parameters. The initialisation is seeded,
    so two calls with the same ``seed`` give identical weights.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = config or TinyModelConfig()
    hf_config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **asdict(config),
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
