"""Small Hugging Face checkpoints written by transformers itself, with tokenizer files built here (no hub).

The tokenizer is a byte-level BPE trained on a few sentences, saved with a chat
template and an end-of-turn token as eos; the models are tiny, with head sizes
vLLM's CPU attention accepts (32).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<bos>", "<|end|>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? 48 + 24 = 72 #### 72",
    "What is 1000 + 250? The answer is 1,250. #### 1,250",
    "Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes of babysitting. -3.5 0.25",
    "reverse copy sort the letters abcdefghij",
]


def make_tokenizer(directory: str | Path, vocab_size: int = 320, chat_template: bool = True) -> Path:
    """A byte-level BPE tokenizer (any text encodes), saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|end|>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return Path(directory)


def make_checkpoint(kind: str, directory: str | Path, *, vocab_size: int = 384, seed: int = 0,
                    chat_template: bool = True) -> str:
    """A random `kind` ('qwen3_moe' or 'deepseek_v3') model saved by transformers, with its tokenizer files."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    d = Path(directory)
    make_tokenizer(d, chat_template=chat_template)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert len(tok) <= vocab_size, (len(tok), vocab_size)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, num_experts_per_tok=2, norm_topk_prob=True,
                  max_position_embeddings=512, tie_word_embeddings=False, **ids)
    if kind == "deepseek_v3":
        cfg = DeepseekV3Config(**common, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5)
        model = DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a non-zero expert bias, so its path is exercised
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=32, num_experts=4)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.save_pretrained(str(d))
    return str(d)
