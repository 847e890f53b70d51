"""The project's own tokenizer: byte-level, built locally and deterministically (no hub download).

Ids 0-2 are <pad>, <bos>, <eos>; ids 3-258 are the 256 bytes (GPT-2's
byte-to-unicode alphabet, so any text round-trips); ids from 259 up to the
model's vocabulary size are reserved `<unused_N>` tokens. The same vocabulary
size always gives the same `tokenizer.json`, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
NUM_BASE = len(SPECIALS) + 256


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable unicode map, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(vocab_size: int) -> dict:
    if vocab_size < NUM_BASE:
        raise ValueError(f"vocab_size={vocab_size}, expected at least {NUM_BASE} (3 specials + 256 bytes)")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i, ch in enumerate(_byte_alphabet()):
        vocab[ch] = len(SPECIALS) + i
    for i in range(NUM_BASE, vocab_size):
        vocab[f"<unused_{i}>"] = i
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in list(SPECIALS) + [f"<unused_{i}>" for i in range(NUM_BASE, vocab_size)]]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json that transformers and vLLM load."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab_size), ensure_ascii=False, sort_keys=True))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": 1 << 20, "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=2, sort_keys=True))
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2))


class ByteTokenizer:
    """Encode/decode without loading any library: the same ids as tokenizer.json."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < NUM_BASE:
            raise ValueError(f"vocab_size={vocab_size}, expected at least {NUM_BASE}")
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = [b + len(SPECIALS) for b in text.encode("utf-8")]
        return ([self.bos_id] if bos else []) + ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - len(SPECIALS) for i in ids if len(SPECIALS) <= i < NUM_BASE)
        return data.decode("utf-8", errors="replace")
