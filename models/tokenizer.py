"""Tokenizer: a Hugging Face ``tokenizers`` tokenizer built from a GGUF vocabulary (byte-level
BPE with the file's pre-tokenizer, or SentencePiece-style BPE) or loaded from a
``tokenizer.json``, plus special tokens and a jinja2 chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from models.errors import ModelFileError

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre names (llama.cpp) -> pre-tokenizer family
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "smaug"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "dbrx", "smaug-bpe", "falcon3", "pixtral"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "qwen35"}
_PRE_GPT2 = {"default", "gpt-2", "gpt2", "olmo", "phi-2", "jina-es", "mpt", "bloom", "poro-chat"}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_DIGITS_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_LLAMA3:
        split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in _PRE_QWEN2:
        split = pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in _PRE_GPT2 or pre is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ModelFileError(
        f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
        f"{sorted(_PRE_DIGITS_GPT2 | _PRE_LLAMA3 | _PRE_QWEN2 | _PRE_GPT2)}"
    )


def _spm_merges(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece vocabulary (as HF's SentencePieceExtractor)."""
    found = []
    for piece, pid in vocab.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        score = scores[pid] if pid < len(scores) else 0.0
        found.extend((-score, pid, n, lr[2], lr[3]) for n, lr in enumerate(local))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _build_from_gguf_metadata(meta: Mapping[str, Any]) -> tuple[HFTokenizer, list[str]]:
    """Return the tokenizers object and the list of special token strings."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelFileError("GGUF file has no tokenizer.ggml.tokens (no embedded vocabulary)")
    tokens = [str(t) for t in tokens]
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges_raw = meta.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise ModelFileError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
        merges = []
        for m in merges_raw:
            left, sep, right = str(m).partition(" ")
            if not sep:
                raise ModelFileError(f"malformed merge {m!r} in tokenizer.ggml.merges")
            merges.append((left, right))
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
        unk = tokens[int(unk_id)] if unk_id is not None and int(unk_id) < len(tokens) else None
        bpe = models.BPE(
            vocab, _spm_merges(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
        tok = HFTokenizer(bpe)
        norms: list[normalizers.Normalizer] = []
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            norms.append(normalizers.Prepend("\u2581"))
        norms.append(normalizers.Replace(" ", "\u2581"))
        tok.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            decs.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decs)
    else:
        raise ModelFileError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )
    specials = [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED]
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok, specials


def _token_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of a model.

    Build with :meth:`from_gguf` / :meth:`from_gguf_metadata` or :meth:`from_hf`.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self.hf = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        eos = {int(i) for i in extra_eos_token_ids}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: set[int] = eos
        self._template: jinja2.Template | None = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer embedded in a GGUF file."""
        from models.loading import gguf_metadata, open_gguf

        return cls.from_gguf_metadata(gguf_metadata(open_gguf(path)))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (``tokenizer.ggml.*`` and ``tokenizer.chat_template``)."""
        tok, _ = _build_from_gguf_metadata(meta)
        tokens = meta["tokenizer.ggml.tokens"]

        def name(key: str) -> str | None:
            i = meta.get(key)
            return str(tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else None

        bos = name("tokenizer.ggml.bos_token_id")
        eos = name("tokenizer.ggml.eos_token_id")
        extra: list[int] = []
        for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if meta.get(k) is not None:
                extra.append(int(meta[k]))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tok.token_to_id(bos))],
            )
        return cls(
            tok,
            bos_token=bos,
            eos_token=eos,
            extra_eos_token_ids=extra,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=add_bos,
        )

    @classmethod
    def from_hf(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``,
        ``chat_template.jinja``) from a Hugging Face model folder."""
        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a generic Exception on bad JSON
            raise ModelFileError(f"cannot read {tj}: {e}") from e
        cfg: dict[str, Any] = {}
        tc = folder / "tokenizer_config.json"
        if tc.is_file():
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = folder / name
            if p.is_file():
                eid = json.loads(p.read_text(encoding="utf-8")).get("eos_token_id")
                if isinstance(eid, int):
                    extra.append(eid)
                elif isinstance(eid, list):
                    extra.extend(int(i) for i in eid)
        return cls(
            tok,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            extra_eos_token_ids=extra,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    # -- API ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds BOS where the model expects it.

        Special-token strings in ``text`` (e.g. ``<|im_start|>``) map to their ids.
        """
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``skip_special_tokens`` drops control tokens."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.

        Returns the prompt text, or its token ids when ``tokenize`` (special tokens in the text
        are mapped, no BOS is added beyond what the template writes).
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (base model?); format the prompt")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        text = self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text
