"""Trains the mock backend's shipped tokenizer, ``assets/tokenizers/kappa-mock-bpe/``, from text in this repo.

``python -m tokenization.train --out assets/tokenizers/kappa-mock-bpe`` reproduces the shipped
``tokenizer.json`` and ``tokenizer_config.json`` byte for byte from the shipped training text
(``corpus.txt.gz`` beside them); nothing is downloaded. ``--extract-corpus`` first rebuilds that
text from the repository as it is now (every tracked ``*.md`` file, and the docstrings and
comments of every tracked ``*.py`` file, via ``git ls-files``), which changes the tokenizer.

The tokenizer is a byte-level BPE (GPT-2's byte alphabet, so every string encodes and decodes
losslessly) with Llama 3's pre-tokenizer split (``tokenizers`` ``Split`` on its regex, digits in
groups of up to three), trained with ``tokenizers.trainers.BpeTrainer`` (`VOCAB_SIZE`,
`MIN_FREQUENCY`). Its special tokens come first, at the ids the older hash tokenizer
(`mock_vllm.tokenizer`) reserved: 0 ``<|pad|>``, 1 ``<|bos|>``, 2 ``<|eos|>``, 3.. one role header
``<|role|>\\n`` per role (``system``, ``developer``, ``user``, ``assistant``, ``tool``,
``function``, ``tools``). The post-processor adds BOS when ``add_special_tokens`` (Llama 3's
``TemplateProcessing``), so a completion prompt starts with BOS and a chat writes its own.

The chat template (`CHAT_TEMPLATE`) is `mock_vllm.tokenizer`'s ChatML-like layout, after BOS::

    <|tools|>\\n{tools as JSON, keys sorted, no spaces}\\n   only when tools are given
    <|{role}|>\\n{content}{tool_calls as JSON}\\n          one block per message, in order
                                                     (an unknown role: <|user|>\\n{role}: ...)
    <|assistant|>\\n                                   the generation prompt

Each role header is one special token and the text between headers is encoded on its own, so
the ids of a conversation's earlier turns are a prefix of the longer conversation's ids.

The traces' text. A trace gives token counts, not text; the replay tools and the simulator write a
prompt of n tokens as n words drawn from the 17,576 three-letter words ``" abc"`` (`sim.traces`
``_WORDS``: one token each under the mock's own tokenizer). So that a trace keeps its token counts
under this tokenizer too (the demo replays Mooncake's lengths), the training text also holds
`TRACE_WORD_PASSES` shuffled passes over those words (`trace_word_documents`): BPE then learns each
as one token, at the cost of ~18,300 of the vocabulary's ids. English prose is unaffected by them.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import io
import itertools
import json
import random
import string
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "assets" / "tokenizers" / "kappa-mock-bpe"
CORPUS_FILE = "corpus.txt.gz"
DOCUMENT_SEPARATOR = "\n\x1e\n"  # ASCII record separator between the corpus's documents
# 16,000 ids: ~3.5 bytes per token on English prose from a ~1 MB corpus (README.md beside the
# tokenizer); with MIN_FREQUENCY 1 the merges reach the bound (2 would stop near 11,000).
VOCAB_SIZE = 32_000
MIN_FREQUENCY = 1
# Passes over the traces' three-letter words in the training text (module docstring): two are
# enough for every one of them to become a single token at VOCAB_SIZE.
TRACE_WORD_PASSES = 2
MODEL_MAX_LENGTH_TOKENS = 131_072
# Llama 3's pre-tokenizer regex (meta-llama/Meta-Llama-3-8B tokenizer.json).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "tools")
ROLE_HEADERS = tuple(f"<|{role}|>\n" for role in ROLES)
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_HEADERS)
_JSON = "tojson(separators=(',', ':'), sort_keys=True)"
CHAT_TEMPLATE = "".join((
    "{{- bos_token -}}\n",
    "{%- if tools -%}{{- '<|tools|>\\n' + (tools | " + _JSON + ") + '\\n' -}}{%- endif -%}\n",
    "{%- set roles = [" + ", ".join(f"'{r}'" for r in ROLES) + "] -%}\n",
    "{%- for message in messages -%}\n",
    "{%- if message['role'] in roles -%}{{- '<|' + message['role'] + '|>\\n' -}}\n",
    "{%- else -%}{{- '<|user|>\\n' + message['role'] + ': ' -}}{%- endif -%}\n",
    "{{- message['content'] if message['content'] is string else '' -}}\n",
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}",
    "{{- message['tool_calls'] | " + _JSON + " -}}{%- endif -%}\n",
    "{{- '\\n' -}}\n",
    "{%- endfor -%}\n",
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}\n",
))


def _python_text(source: str) -> list[str]:
    """A Python file's docstrings (module, classes, functions) and its comments, one text each."""
    tree = ast.parse(source)
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                          ast.AsyncFunctionDef)))
    texts = [doc for n in nodes if (doc := ast.get_docstring(n))]
    comments = [t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    if comments:
        texts.append("\n".join(comments))
    return texts


def extract_corpus(root: Path = REPO_ROOT) -> str:
    """The training text from the repository at ``root``: tracked ``*.md`` files whole, and the
    docstrings and comments of tracked ``*.py`` files, in path order.

    Raises:
        subprocess.CalledProcessError: ``root`` is not a git checkout.
    """
    listed = subprocess.run(["git", "ls-files", "*.md", "*.py"], cwd=root, check=True, capture_output=True,
                            text=True).stdout.split()
    documents: list[str] = []
    for rel in sorted(listed):
        text = (root / rel).read_text(encoding="utf-8")
        documents.extend([text] if rel.endswith(".md") else _python_text(text))
    return DOCUMENT_SEPARATOR.join(d for d in documents if d.strip())


def read_corpus(path: Path) -> Iterator[str]:
    """The documents of a corpus file written by `write_corpus`."""
    yield from gzip.decompress(path.read_bytes()).decode("utf-8").split(DOCUMENT_SEPARATOR)


def write_corpus(text: str, path: Path) -> None:
    path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))


def trace_word_documents() -> list[str]:
    """`TRACE_WORD_PASSES` documents, each every word ``" abc"`` (a–z, three letters) once in a
    seeded shuffle: the words `sim.traces` writes a trace's prompts in (module docstring)."""
    words = [" " + "".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3)]
    rng = random.Random(0)
    out = []
    for _ in range(TRACE_WORD_PASSES):
        rng.shuffle(words)
        out.append("".join(words))
    return out


def train(documents: Iterator[str]) -> Tokenizer:
    """A byte-level BPE trained on ``documents`` (module docstring); deterministic for given text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=MIN_FREQUENCY, show_progress=False,
                                  special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])])
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    """``tokenizer_config.json`` as transformers writes it for a ``PreTrainedTokenizerFast``."""
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    return {"added_tokens_decoder": added, "additional_special_tokens": list(ROLE_HEADERS), "bos_token": BOS,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": EOS,
            "model_max_length": MODEL_MAX_LENGTH_TOKENS, "pad_token": PAD,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write ``tokenizer.json`` (compact) and ``tokenizer_config.json`` (indented) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str() + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenization.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="tokenizer directory to write")
    parser.add_argument("--corpus", type=Path, default=None, help=f"training text (default: OUT/{CORPUS_FILE})")
    parser.add_argument("--extract-corpus", action="store_true",
                        help="first rebuild the corpus from this repository's .md files and docstrings")
    args = parser.parse_args(argv)
    corpus = args.corpus or args.out / CORPUS_FILE
    if args.extract_corpus:
        corpus.parent.mkdir(parents=True, exist_ok=True)
        write_corpus(extract_corpus(), corpus)
    tok = train(itertools.chain(read_corpus(corpus), trace_word_documents()))
    write_tokenizer(tok, args.out)
    print(f"{args.out}: vocab {tok.get_vocab_size()} from {corpus} ({corpus.stat().st_size:,} bytes gzipped)")


if __name__ == "__main__":
    main()
