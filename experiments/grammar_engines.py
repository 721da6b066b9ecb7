"""llguidance against xgrammar: compile time and mask time per token on a real vocabulary.

Each schema comes with a document that satisfies it; the document is tokenized with the
tokenizer under test and walked token by token: fill the mask, then accept the token, as a
sampler would. Single-sequence time is one matcher; batch time fills 32 matchers, each at its
own position in the walk, with the library's batched call. Both libraries are held to
compact JSON (no free whitespace), which is what the engine asks of llguidance.

Stand-alone on purpose (no project imports): xgrammar needs torch, which the project venv
does not carry, so it runs from a venv of its own.

    python experiments/grammar_engines.py --tokenizer PATH/tokenizer.json [--engines llguidance,xgrammar]
    python experiments/grammar_engines.py --train-bpe PATH/tokenizer.json   # the 128k stand-in, offline

No 128k-vocabulary tokenizer was in any offline cache, so `--train-bpe` makes one: a byte-level
BPE trained to 128,256 tokens on up to 60 MB of the Python sources on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "order": {"type": "integer"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                        "required": ["sku", "qty", "price"],
                        "additionalProperties": False,
                    },
                },
                "shipping": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["order", "items", "shipping"],
            "additionalProperties": False,
        },
        {
            "order": 1042,
            "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1, "price": 120.0}],
            "shipping": {"city": "Lisbon", "zip": "10001"},
        },
    ),
    "enums": (
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "topics": {"type": "array", "items": {"enum": ["price", "quality", "delivery", "support"]}, "maxItems": 4},
                "urgent": {"type": "boolean"},
                "score": {"type": "integer", "minimum": 0, "maximum": 10},
            },
            "required": ["sentiment", "topics", "urgent", "score"],
            "additionalProperties": False,
        },
        {"sentiment": "negative", "topics": ["delivery", "support"], "urgent": True, "score": 3},
    ),
    "anyof": (
        {
            "type": "object",
            "properties": {
                "events": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {
                                "type": "object",
                                "properties": {"kind": {"const": "click"}, "x": {"type": "integer"}, "y": {"type": "integer"}},
                                "required": ["kind", "x", "y"],
                                "additionalProperties": False,
                            },
                            {
                                "type": "object",
                                "properties": {"kind": {"const": "key"}, "key": {"type": "string"}},
                                "required": ["kind", "key"],
                                "additionalProperties": False,
                            },
                        ]
                    },
                }
            },
            "required": ["events"],
            "additionalProperties": False,
        },
        {"events": [{"kind": "click", "x": 10, "y": 20}, {"kind": "key", "key": "Enter"}, {"kind": "click", "x": 3, "y": 4}]},
    ),
}

BATCH = 32


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import llguidance
        import llguidance.numpy as lln

        self.llg, self.lln = llguidance, lln
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, schema: dict):
        opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        return self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=opts)

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def bitmask(self, rows: int):
        return self.lln.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, mask) -> None:
        self.lln.fill_next_token_bitmask(matcher, mask, 0)

    def fill_batch(self, matchers, mask) -> None:
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab = vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, mask) -> None:
        matcher.fill_next_token_bitmask(mask, 0)

    def fill_batch(self, matchers, mask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def _tokenizer(tokenizer_json: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def train_bpe(out: str, vocab: int = 128_256, max_chars: float = 60e6) -> None:
    import glob
    import sys

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    roots = [f"{sys.base_prefix}/lib/python3.*/**/*.py", f"{sys.prefix}/lib/python3.*/site-packages/**/*.py"]
    texts, total = [], 0
    for path in (p for root in roots for p in sorted(glob.glob(root, recursive=True))):
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total > max_chars:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(out)
    print(f"{out}: vocab {tok.get_vocab_size()} from {total / 1e6:.0f} M characters")


def measure(engine, tokens: list[int], schema: dict) -> dict:
    t0 = time.perf_counter()
    grammar = engine.compile(schema)
    first = engine.matcher(grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = engine.bitmask(1)
    single = []
    for token in tokens:
        t = time.perf_counter()
        engine.fill(first, mask)
        single.append(time.perf_counter() - t)
        assert engine.accept(first, token), f"{engine.name} refused token {token}"
    # The batch: matcher i has walked i tokens of the document (positions spread over the walk).
    matchers = [engine.matcher(grammar) for _ in range(BATCH)]
    for i, m in enumerate(matchers):
        for token in tokens[: (i * len(tokens)) // BATCH]:
            engine.accept(m, token)
    batch_mask = engine.bitmask(BATCH)
    batch = []
    for _ in range(5):
        t = time.perf_counter()
        engine.fill_batch(matchers, batch_mask)
        batch.append(time.perf_counter() - t)
    return {
        "compile_ms": compile_ms,
        "mean_us": statistics.mean(single) * 1e6,
        "p99_us": sorted(single)[int(0.99 * (len(single) - 1))] * 1e6,
        "batch32_ms": statistics.median(batch) * 1e3,
        "tokens": len(tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="a tokenizers tokenizer.json")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--train-bpe", metavar="OUT", help="write a 128k byte-level BPE trained on local Python sources, then stop")
    args = ap.parse_args()
    if args.train_bpe:
        return train_bpe(args.train_bpe)
    if not args.tokenizer:
        ap.error("--tokenizer is needed")
    text = open(args.tokenizer, encoding="utf-8").read()
    tok = _tokenizer(text)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|endoftext|>")
    print(f"tokenizer {args.tokenizer}: vocab {vocab}")
    print(f"{'engine':11} {'schema':7} {'tokens':>6} {'compile ms':>10} {'mask us mean':>12} {'p99':>8} {'batch32 ms':>10}")
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        engine = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](text, vocab, eos)
        print(f"{name}: tokenizer setup {(time.perf_counter() - t0) * 1e3:.0f} ms")
        for label, (schema, doc) in SCHEMAS.items():
            tokens = tok.encode(json.dumps(doc, separators=(",", ":"))).ids
            r = measure(engine, tokens, schema)
            print(
                f"{name:11} {label:7} {r['tokens']:>6} {r['compile_ms']:>10.1f} {r['mean_us']:>12.1f} {r['p99_us']:>8.1f} {r['batch32_ms']:>10.2f}"
            )


if __name__ == "__main__":
    main()
