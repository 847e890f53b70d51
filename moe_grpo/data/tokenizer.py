"""Tokenizers: the project's own byte-level one, and a checkpoint's own (`HFTokenizer`, local files only).

Both answer the same four questions the driver asks: `encode_prompt(text)`
(the ids an engine is given; text, or chat messages where a chat template renders them), `encode_answer(text)`
(a warm start's target, stop token included), `completion_text(ids)` (what a reward reads) and
`stop_ids` (what ends a completion).

The project's own tokenizer is built locally and deterministically (no hub download).

Ids 0-2 are <pad>, <bos>, <eos>; ids 3-258 are the 256 bytes (GPT-2's
byte-to-unicode alphabet, so any text round-trips); ids from 259 up to the
model's vocabulary size are reserved `<unused_N>` tokens. The same vocabulary
size always gives the same `tokenizer.json`, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from moe_grpo.data.chat import check_rendered

if TYPE_CHECKING:  # the model's spec is a layer above data (pyproject.toml)
    from moe_grpo.models.spec import MoEModelSpec

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

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    has_chat_template = False
    """The byte model has none: a dataset of chat messages is refused at start (data/prompts.py)."""

    def encode_prompt(self, text: str | Sequence[Mapping[str, str]]) -> list[int]:
        """<bos> + the text's bytes."""
        if not isinstance(text, str):
            raise ValueError("the byte tokenizer has no chat template: a prompt of chat messages cannot be encoded")
        return self.encode(text)

    def encode_answer(self, text: str) -> list[int]:
        return self.encode(text, bos=False) + [self.eos_id]

    def completion_text(self, ids: Sequence[int]) -> str:
        return self.decode(_until_stop(ids, self.stop_ids))


def _until_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    out = []
    for i in ids:
        if int(i) in stops:
            break
        out.append(int(i))
    return out


class HFTokenizer:
    """A checkpoint's own tokenizer (transformers' AutoTokenizer, read from the directory only, never the hub).

    Prompts go through the tokenizer's chat template when it has one (one user
    turn, generation prompt added); otherwise they are encoded as plain text
    with the tokenizer's own special tokens (e.g. <bos>)."""

    def __init__(self, directory: str | Path, vocab_size: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.directory = str(directory)
        try:
            self.tok: Any = AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - re-raised naming the directory
            raise ValueError(f"init.hf={self.directory}: no usable tokenizer files there ({type(e).__name__}: {e}); "
                             "a checkpoint brings its tokenizer (tokenizer.json / tokenizer_config.json)") from e
        if vocab_size is not None and len(self.tok) > vocab_size:
            raise ValueError(f"init.hf={self.directory}: the tokenizer has {len(self.tok)} tokens but config.json's "
                             f"vocab_size is {vocab_size}; ids past the embedding would crash the model")
        stops = _as_ids(self.tok.eos_token_id) + _as_ids(_generation_eos(self.directory))
        if not stops:
            raise ValueError(f"init.hf={self.directory}: the tokenizer has no eos token (tokenizer_config.json "
                             "eos_token) and generation_config.json names none; completions would never stop")
        self._stops = tuple(dict.fromkeys(stops))
        self.eos_id = self._stops[0]
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = vocab_size or len(self.tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stops

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=bos)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def encode_prompt(self, text: str | Sequence[Mapping[str, str]]) -> list[int]:
        """Text goes in as one user turn; chat messages (`[{"role": ..., "content": ...}]`) as they are. Both through
        the chat template with its generation prompt (a final assistant turn is continued instead); without a
        template, text is encoded plain and messages raise. A message the template left out raises `MessageDropped`."""
        if self.has_chat_template:
            messages = [{"role": "user", "content": text}] if isinstance(text, str) else [dict(m) for m in text]
            # A conversation that ends with an assistant turn (a prefilled "<think>" or "The answer is") is
            # continued, as TRL does, not closed for a new turn.
            prefilled = messages[-1]["role"] == "assistant"
            rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefilled,
                                                    continue_final_message=prefilled)
            if not isinstance(text, str):
                check_rendered(messages, rendered)
            return list(self.tok(rendered, add_special_tokens=False)["input_ids"])  # the template wrote them
        if not isinstance(text, str):
            raise ValueError(f"{self.directory}: the tokenizer has no chat template to render chat messages")
        return self.encode(text)

    def encode_answer(self, text: str) -> list[int]:
        return self.encode(text, bos=False) + [self.eos_id]

    def completion_text(self, ids: Sequence[int]) -> str:
        return self.decode(_until_stop(ids, self.stop_ids))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _generation_eos(directory: str) -> Any:
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return None


def load_tokenizer(spec: MoEModelSpec, hf_dir: str | None) -> ByteTokenizer | HFTokenizer:
    """The run's tokenizer: the checkpoint's own when starting from one (`init.hf`), else the byte tokenizer.

    A run's `policy/` given as `init.hf` holds the byte tokenizer's files; it gets the byte tokenizer, which puts
    <bos> before every prompt as the policy was trained (transformers' reading of those files does not)."""
    if hf_dir:
        return policy_tokenizer(spec, hf_dir)
    return ByteTokenizer(spec.vocab_size)


def policy_tokenizer(spec: MoEModelSpec, directory: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a policy directory was trained with: the byte tokenizer when its tokenizer.json is the one
    `write_tokenizer` writes (a run that did not start from `init.hf`; encoding then matches the run's exactly),
    else the directory's own (as `init.hf` loads it)."""
    path = Path(directory) / "tokenizer.json"
    try:
        written = json.loads(json.dumps(tokenizer_json(spec.vocab_size)))  # as stored: lists, string keys
        ours = path.is_file() and json.loads(path.read_text()) == written
    except (json.JSONDecodeError, UnicodeDecodeError):
        ours = False
    return ByteTokenizer(spec.vocab_size) if ours else HFTokenizer(directory, spec.vocab_size)
